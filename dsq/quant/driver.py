"""The layer-by-layer quantization driver: one decoder block in memory at a time.

For each block: read its weights from the memory-mapped source, let the method quantize it (a
calibrated method runs the calibration activations through it for what it needs: Hessians for
GPTQ, inputs for AWQ), write the block's tensors, and pass the *quantized* block's outputs on to
the next block. Progress is saved after every block, so an interrupted run resumes where it
stopped. Peak memory: one block + the calibration activations + the embeddings. The method
(dsq.quant.registry) decides everything method-specific.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
from torch import nn

from dsq.errors import OutputExists
from dsq.quant.blocks import (Block, block_tensors, default_dtype, device_for, embed_calibration, home, linears,
                              materialize, meta_model, phase, run_block)
from dsq.quant.calib import calibration_for
from dsq.quant.method import check_target, dir_size
from dsq.quant.spec import OnStep, QuantSpec, Step, no_progress


class ResumeState:
    """Resumable state of a run: finished blocks and the activations entering the next one."""

    SAVE_EVERY_S = 30.0  # large activation sets (GBs for an 8B model) are saved at most this often
    SMALL_BYTES = 256 << 20

    def __init__(self, partial: Path, key: str):
        self.last_save = time.perf_counter()
        self.dir = partial / ".dsq-state"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = key
        self.file = self.dir / "progress.json"

    def load(self) -> tuple[int, torch.Tensor | None]:
        if not self.file.is_file():
            return 0, None
        st = json.loads(self.file.read_text())
        if st.get("key") != self.key:
            return 0, None
        hidden = None
        if (self.dir / "hidden.safetensors").is_file():
            from safetensors.torch import load_file

            hidden = load_file(str(self.dir / "hidden.safetensors"))["hidden"]
        return int(st["done"]), hidden

    def save(self, done: int, hidden: torch.Tensor | None) -> None:
        """Record `done` finished blocks (with the activations entering the next). Large activation
        sets are written at most every SAVE_EVERY_S: a resumed run then redoes a few blocks."""
        if hidden is not None and hidden.numel() * hidden.element_size() > self.SMALL_BYTES \
                and time.perf_counter() - self.last_save < self.SAVE_EVERY_S:
            return
        self.last_save = time.perf_counter()
        if hidden is not None:
            from safetensors.torch import save_file

            tmp = self.dir / "hidden.safetensors.tmp"
            save_file({"hidden": hidden.contiguous().cpu()}, str(tmp))
            os.replace(tmp, self.dir / "hidden.safetensors")
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": self.key, "done": done}))
        os.replace(tmp, self.file)


def _settings_key(src: Path, spec: QuantSpec) -> str:
    stamp = [(f.name, f.stat().st_size) for f in sorted(src.glob("*.safetensors"))]
    return hashlib.sha256(json.dumps([str(src.resolve()), stamp, spec.record()], sort_keys=True).encode()).hexdigest()


def check_model(hf, spec: QuantSpec) -> None:
    """Every quantized layer must fit the format: refuse before any work."""
    from dsq.models.registry import build_args

    mod, args = build_args(hf.config, f"{hf.path}/config.json")
    model = meta_model(mod, args)
    for name, m in linears(model.model.layers[0]).items():
        full = f"model.layers.0.{name}"
        if not _skipped(full, spec):
            spec.impl.check_shape(full, m.out_features, m.in_features, spec)


def _skipped(full_name: str, spec: QuantSpec) -> bool:
    return any(fnmatch.fnmatch(full_name, p) for p in spec.skip)


# ---------------------------------------------------------------------------------------------
def quantize_block(layer: nn.Module, i: int, spec: QuantSpec, hidden, ctx, device, dtype, batch: int) -> dict:
    """Quantize block `i`, materialized, in place (weights become their dequantized values).
    Returns the tensors to write, by name inside the block."""
    lins = {n: m for n, m in linears(layer).items() if not _skipped(f"model.layers.{i}.{n}", spec)}
    return spec.impl.quantize_block(Block(layer, lins, hidden, ctx, torch.device(device), dtype, batch), spec)


def quantize_layers(src: str | Path, out: str | Path, spec: QuantSpec, *, device: str = "auto", force: bool = False,
                    progress: OnStep = no_progress, batch: int = 8, compute_dtype: torch.dtype | None = None) -> dict:
    """Quantize the HF model at `src` into an HF directory at `out`. Returns a run summary."""
    method = spec.validate().impl
    out = Path(out)
    hf, mod, args = _open_source(src, out, spec, force)
    dev = device_for(device)
    dtype = compute_dtype or default_dtype(dev)
    calib_ids = calibration_for(hf, spec.calib) if method.needs_calibration else None
    task = f"{spec.method} {method.label(spec)}: blocks"
    progress(Step(task))

    partial = out.with_name(out.name + ".partial")
    state, done, hidden = _resume(partial, _settings_key(hf.path, spec))
    model = meta_model(mod, args)
    t_start = time.perf_counter()
    if calib_ids is not None:
        hidden = home(embed_calibration(hf, args, calib_ids) if hidden is None else hidden, dev, dtype)
    n = args.num_hidden_layers
    for i in range(done, n):
        ctx = model.block_context(i, calib_ids.shape[1], dev) if calib_ids is not None else None
        hidden = _quantize_one(model.model.layers[i], i, hf, spec, hidden, ctx, dev, dtype, batch, partial)
        state.save(i + 1, hidden)
        progress(Step(task, i + 1, n))

    _finalize(hf, partial, out, spec, _write_rest(hf, partial), n, force)
    summary = {"method": spec.method, "seconds": round(time.perf_counter() - t_start, 1), "blocks": n,
               "calibration_tokens": int(calib_ids.numel()) if calib_ids is not None else 0}
    _write_record(out, hf, spec, summary)
    return summary


def _open_source(src: str | Path, out: Path, spec: QuantSpec, force: bool):
    """(the HF model, its model module, its ModelArgs), refused before any work if `out` exists or
    a layer does not fit the format."""
    from dsq.formats.hf import HFModelDir
    from dsq.models.registry import build_args

    check_target(out, force)
    hf = HFModelDir(src)
    mod, args = build_args(hf.config, f"{hf.path}/config.json")
    check_model(hf, spec)
    return hf, mod, args


def _write_record(out: Path, hf, spec: QuantSpec, summary: dict) -> None:
    """dsq_quant.json: where the artifact came from and how it was made (dsq eval finds the source here)."""
    from dsq.formats.hf import write_json

    write_json(out / "dsq_quant.json", {"source": str(hf.path.resolve()), "spec": spec.record(), **summary})


def _resume(partial: Path, key: str) -> tuple[ResumeState, int, torch.Tensor | None]:
    """The saved state of an interrupted run with these settings, or a clean start."""
    state = ResumeState(partial, key)
    done, hidden = state.load()
    if done == 0 and partial.exists():  # stale or from other settings: start clean
        shutil.rmtree(partial)
        state = ResumeState(partial, key)
    (partial / "blocks").mkdir(parents=True, exist_ok=True)
    return state, done, hidden


def _quantize_one(layer: nn.Module, i: int, hf, spec: QuantSpec, hidden, ctx, dev, dtype, batch: int,
                  partial: Path) -> torch.Tensor | None:
    """Quantize block i and write it under partial/blocks; the activations entering the next block."""
    from safetensors.torch import save_file

    tensors = block_tensors(hf, i)
    materialize(layer, tensors, dev, dtype)
    qt = quantize_block(layer, i, spec, hidden, ctx, dev, dtype, batch)
    if hidden is not None:
        with phase("block outputs"):
            hidden = run_block(layer, hidden, ctx, dev, dtype, batch)
    block = {}
    state = layer.state_dict()
    for name, t in tensors.items():  # norms, biases, skipped layers: as the method left them
        base = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and (f"{base}.qweight" in qt or name in qt):
            continue
        block[f"model.layers.{i}.{name}"] = state[name].to("cpu", t.dtype) if name in state else t
    block.update({f"model.layers.{i}.{k}": v.contiguous() for k, v in qt.items()})
    tmp = partial / "blocks" / f"block-{i:05d}.tmp"
    save_file(block, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, partial / "blocks" / f"block-{i:05d}.safetensors")
    layer.to("meta")
    return hidden


def _write_rest(hf, partial: Path) -> list[Path]:
    """The tensors outside the blocks (embeddings, final norm, output head), unchanged."""
    from dsq.formats.hf import ShardedSafetensorsWriter

    rest = ShardedSafetensorsWriter(partial / "blocks")
    for name in hf.tensor_names():
        if not name.startswith("model.layers.") and not name.endswith("inv_freq"):
            rest.add(name, hf.get_tensor(name))
    return rest.close()


def _finalize(hf, partial: Path, out: Path, spec: QuantSpec, rest_files: list[Path], n_layer: int, force: bool):
    """Shards, index, config with quantization_config, tokenizer files, model card; then rename."""
    from dsq.formats.hf import TOKENIZER_FILES, write_json

    files = [partial / "blocks" / f"block-{i:05d}.safetensors" for i in range(n_layer)] + list(rest_files)
    total = len(files)
    weight_map, size = {}, 0
    from safetensors import safe_open

    for k, f in enumerate(files):
        final = partial / f"model-{k + 1:05d}-of-{total:05d}.safetensors"
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                weight_map[name] = final.name
        size += f.stat().st_size
        os.replace(f, final)
    write_json(partial / "model.safetensors.index.json", {"metadata": {"total_size": size}, "weight_map": weight_map})
    cfg = dict(hf.config)
    cfg["quantization_config"] = spec.quantization_config()
    write_json(partial / "config.json", cfg)
    for name in TOKENIZER_FILES:
        if (hf.path / name).is_file():
            shutil.copy2(hf.path / name, partial / name)
    (partial / "README.md").write_text(model_card(hf, spec, size))
    shutil.rmtree(partial / "blocks", ignore_errors=True)
    shutil.rmtree(partial / ".dsq-state", ignore_errors=True)
    if out.exists():
        if not force:
            raise OutputExists(f"{out} already exists", "pass --force")
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    os.replace(partial, out)


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


def write_card(out: Path, source: str | Path, spec: QuantSpec, evals: dict | None = None) -> None:
    """Rewrite the model card of the artifact at `out` (with its size as it is now), adding
    evaluation numbers."""
    from dsq.formats.hf import HFModelDir

    (out / "README.md").write_text(model_card(HFModelDir(source), spec, dir_size(out), evals))
