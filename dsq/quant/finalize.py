"""The artifact of a layer-by-layer run, assembled from its finished blocks in OUT.partial/stage
(dsq.quant.staging says how the run's files are laid out): shards, index, config with
quantization_config, tokenizer files, dsq_quant.json and the model card; then the evaluation on
held-out text, whose numbers go into dsq_quant.json and the card before the stage is published."""

from __future__ import annotations

import shutil
from pathlib import Path

from dsq.quant import faults
from dsq.quant.method import weights_bytes
from dsq.quant.moe import Kept, card_lines, kept_linears, read_routing
from dsq.quant.spec import OnStep, QuantSpec, Step, eval_name
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
    kept, routing = _facts(run, hf, spec)
    write_json(run.stage / "config.json", {**hf.config, "quantization_config": spec.quantization_config(kept)})
    faults.point("finalize:config")
    for name in TOKENIZER_FILES:
        if (hf.path / name).is_file():
            shutil.copy2(hf.path / name, run.stage / name)
    faults.point("finalize:tokenizer")
    write_json(run.stage / "dsq_quant.json", _record(run, hf, spec, routing))
    faults.point("finalize:record")
    (run.stage / "README.md").write_text(model_card(hf, spec, weights_bytes(run.stage), kept=kept, routing=routing))
    run.record(phase="staged", size=size)


def _facts(run: Run, hf, spec: QuantSpec) -> tuple[Kept, dict[int, dict]]:
    """(the layers' Linears kept 16-bit, the experts' calibration record per layer)."""
    from dsq.models.registry import build_args
    from dsq.quant.blocks import meta_model

    mod, args = build_args(hf.config, f"{hf.path}/config.json")
    routing = read_routing([run.block_file(i) for i in range(run.n)]) if (run.dir / "blocks").is_dir() else {}
    return kept_linears(meta_model(mod, args), args, spec), routing


def _record(run: Run, hf, spec: QuantSpec, routing: dict[int, dict], evals: dict | None = None) -> dict:
    """dsq_quant.json: where the artifact came from (dsq eval finds the source here), how it was
    made, the calibration tokens each routed expert saw (by layer), and its evaluation."""
    return {"source": str(hf.path.resolve()), "spec": spec.record(), "method": spec.method,
            "seconds": run.state["seconds"], "blocks": run.n, "calibration_tokens": run.state["calibration_tokens"],
            **({"experts": {str(i): r for i, r in routing.items()}} if routing else {}),
            **({"eval": evals} if evals else {})}


def _write_rest(hf, folder: Path) -> list[Path]:
    """The tensors outside the blocks (embeddings, final norm, output head), unchanged."""
    from dsq.convert.fp8_source import float_view
    from dsq.formats.hf import ShardedSafetensorsWriter
    from dsq.quant.space import remove

    remove(folder)
    folder.mkdir()
    rest = ShardedSafetensorsWriter(folder)
    hf = float_view(hf)
    for name in hf.tensor_names():
        if not name.startswith("model.layers.") and not name.endswith("inv_freq"):
            rest.add(name, hf.get_tensor(name))
    return rest.close()


def evaluate_stage(run: Run, hf, spec: QuantSpec, tokens: int, progress: OnStep) -> None:
    """Evaluate stage/ against its source on `tokens` held-out tokens (0: no evaluation) and put
    the numbers in its dsq_quant.json and model card."""
    from dsq.formats.hf import write_json

    evals = _evaluate(run.stage, hf.path, tokens, progress) if tokens else None
    kept, routing = _facts(run, hf, spec)
    write_json(run.stage / "dsq_quant.json", _record(run, hf, spec, routing, evals))
    shown = {k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in evals.items()} if evals else None
    (run.stage / "README.md").write_text(model_card(hf, spec, weights_bytes(run.stage), shown, kept, routing))
    faults.point("finalize:card")
    run.record(phase="ready", eval_tokens=tokens)


def _evaluate(model: Path, source: Path, tokens: int, progress: OnStep) -> dict:
    from dsq.eval.quality import evaluate
    from dsq.quant.spec import eval_shape

    progress(Step(EVAL_TASK))

    def on_window(done: int, total: int) -> None:
        faults.point("eval")
        progress(Step(EVAL_TASK, done, total))

    window, batch = eval_shape(tokens)
    r = evaluate(str(model), str(source), ctx=window, max_tokens=tokens, on_window=on_window, batch=batch)
    return {"perplexity": r["perplexity"], "source perplexity": r["reference_perplexity"], "KLD": r["kld"],
            "top-1 agreement": r["top1_agreement"], "tokens": r["tokens"], "evaluation": eval_name(tokens)}


def model_card(hf, spec: QuantSpec, size: int, evals: dict | None = None, kept: Kept | None = None,
               routing: dict[int, dict] | None = None) -> str:
    q = spec.quantization_config(kept)
    lines = [f"# {hf.path.name} — {spec.method.upper()} ({q['quant_method']})", "",
             f"Quantized from `{hf.path.name}` by dsq, which quantizes DeepSeek-family LLMs and runs them locally.",
             "",
             "| setting | value |", "|---|---|"]
    settings = spec.impl.card_settings(spec)
    settings["kept 16-bit"] = ", ".join(["lm_head", "embeddings", "norms"] + _kept_rows(kept) + list(spec.skip))
    settings["size"] = f"{size / 2**20:.1f} MiB"
    lines += [f"| {k} | {v} |" for k, v in settings.items()]
    lines += card_lines(routing or {}, spec)
    if evals:
        lines += ["", f"## Evaluation ({evals.get('evaluation', 'full')}: {evals['tokens']} held-out tokens scored "
                  "against the source; `dsq quantize --eval full` reads more, `dsq eval` any number)", "",
                  "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in evals.items() if k != "evaluation"]
    lines += ["", "Loads in vLLM / SGLang / transformers as its `quantization_config` says, and in dsq's native runtime."]
    return "\n".join(lines) + "\n"


def _kept_rows(kept: Kept | None) -> list[str]:
    """The card's words for what an MoE model keeps 16-bit beyond the usual."""
    rows = ["routers (mlp.gate)"] if kept is not None and kept.routers else []
    if kept is not None and kept.layers:
        rows.append(f"dense layer{'s' if len(kept.layers) > 1 else ''} {', '.join(map(str, kept.layers))}")
    return rows
