"""The artifact of a layer-by-layer run, assembled from its finished blocks in OUT.partial/stage
(dsq.quant.staging says how the run's files are laid out): shards, index, config with
quantization_config, tokenizer files, dsq_quant.json and the model card; then the evaluation on
held-out text, whose numbers go into dsq_quant.json and the card before the stage is published."""

from __future__ import annotations

import shutil
from pathlib import Path

from dsq.quant import faults
from dsq.quant.spec import OnStep, QuantSpec, Step
from dsq.quant.staging import Run, place_shards

EVAL_TASK = "evaluating on held-out text"


def assemble(run: Run, hf, spec: QuantSpec) -> None:
    """Build stage/ from the finished blocks and the rest tensors (written again here)."""
    from dsq.formats.hf import TOKENIZER_FILES, write_json
    from dsq.quant.space import remove

    remove(run.stage)
    files = [run.block_file(i) for i in range(run.n)] + _write_rest(hf, run.dir / "rest")
    faults.point("finalize:rest")
    run.stage.mkdir()
    weight_map, size = place_shards(run, files)
    write_json(run.stage / "model.safetensors.index.json", {"metadata": {"total_size": size}, "weight_map": weight_map})
    faults.point("finalize:index")
    write_json(run.stage / "config.json", {**hf.config, "quantization_config": spec.quantization_config()})
    faults.point("finalize:config")
    for name in TOKENIZER_FILES:
        if (hf.path / name).is_file():
            shutil.copy2(hf.path / name, run.stage / name)
    faults.point("finalize:tokenizer")
    write_json(run.stage / "dsq_quant.json", _record(run, hf, spec))
    faults.point("finalize:record")
    (run.stage / "README.md").write_text(model_card(hf, spec, size))
    run.record(phase="staged", size=size)


def _record(run: Run, hf, spec: QuantSpec, evals: dict | None = None) -> dict:
    """dsq_quant.json: where the artifact came from (dsq eval finds the source here), how it was
    made, and its evaluation."""
    return {"source": str(hf.path.resolve()), "spec": spec.record(), "method": spec.method,
            "seconds": run.state["seconds"], "blocks": run.n, "calibration_tokens": run.state["calibration_tokens"],
            **({"eval": evals} if evals else {})}


def _write_rest(hf, folder: Path) -> list[Path]:
    """The tensors outside the blocks (embeddings, final norm, output head), unchanged."""
    from dsq.formats.hf import ShardedSafetensorsWriter
    from dsq.quant.space import remove

    remove(folder)
    folder.mkdir()
    rest = ShardedSafetensorsWriter(folder)
    for name in hf.tensor_names():
        if not name.startswith("model.layers.") and not name.endswith("inv_freq"):
            rest.add(name, hf.get_tensor(name))
    return rest.close()


def evaluate_stage(run: Run, hf, spec: QuantSpec, tokens: int, progress: OnStep) -> None:
    """Evaluate stage/ against its source on `tokens` held-out tokens (0: no evaluation) and put
    the numbers in its dsq_quant.json and model card."""
    from dsq.formats.hf import write_json

    evals = _evaluate(run.stage, hf.path, tokens, progress) if tokens else None
    write_json(run.stage / "dsq_quant.json", _record(run, hf, spec, evals))
    shown = {k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in evals.items()} if evals else None
    (run.stage / "README.md").write_text(model_card(hf, spec, run.state["size"], shown))
    faults.point("finalize:card")
    run.record(phase="ready", eval_tokens=tokens)


def _evaluate(model: Path, source: Path, tokens: int, progress: OnStep) -> dict:
    from dsq.eval.quality import evaluate

    progress(Step(EVAL_TASK))

    def on_window(done: int, total: int) -> None:
        faults.point("eval")
        progress(Step(EVAL_TASK, done, total))

    r = evaluate(str(model), str(source), ctx=min(512, tokens), max_tokens=tokens, on_window=on_window)
    return {"perplexity": r["perplexity"], "source perplexity": r["reference_perplexity"], "KLD": r["kld"],
            "top-1 agreement": r["top1_agreement"], "tokens": r["tokens"]}


def model_card(hf, spec: QuantSpec, size: int, evals: dict | None = None) -> str:
    q = spec.quantization_config()
    lines = [f"# {hf.path.name} — {spec.method.upper()} ({q['quant_method']})", "",
             f"Quantized with [dsq](https://example.invalid/dsq) from `{hf.path.name}`.", "",
             "| setting | value |", "|---|---|"]
    settings = spec.impl.card_settings(spec)
    settings["kept 16-bit"] = ", ".join(["lm_head", "embeddings", "norms"] + list(spec.skip))
    settings["size"] = f"{size / 2**20:.1f} MiB"
    lines += [f"| {k} | {v} |" for k, v in settings.items()]
    if evals:
        lines += ["", "## Evaluation (dsq eval, held-out text)", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in evals.items()]
    lines += ["", "Loads in vLLM / SGLang / transformers as its `quantization_config` says, and in dsq's native runtime."]
    return "\n".join(lines) + "\n"
