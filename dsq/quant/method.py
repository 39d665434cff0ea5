"""The contract of a quantization method, and what the layer-by-layer methods share.

One instance of each method lives in `dsq.quant.registry.METHODS`; `dsq.quant.quantize` and the
driver ask it instead of comparing method names.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from dsq.errors import DsqError, OutputExists
from dsq.quant.spec import EVAL_TOKENS, OnStep, QuantSpec, no_progress

if TYPE_CHECKING:
    import torch

    from dsq.quant.blocks import Block


def check_target(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise OutputExists(f"{out} already exists", "pass --force to overwrite it or choose another --out")


def weights_bytes(folder: Path) -> int:
    """An HF artifact's size as dsq quantize's summary and its model card both give it: its
    safetensors files (the tokenizer, config and card are not counted)."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def run_key(source: Path, *settings) -> str:
    """What a run's saved work is valid for: dsq's version, the source (its path and the name, size
    and mtime of its files) and the settings."""
    from dsq import __version__

    key = [__version__, str(source.resolve()), _stamp(source), *settings]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def calib_stamp(calib) -> list:
    """The calibration settings, with the stamp of a calibration file."""
    path = Path(calib.source)
    return [calib.source, calib.samples, calib.seq_len, _stamp(path) if path.is_file() else None]


def _stamp(path: Path) -> list:
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]


class Method:
    """A way to quantize a model: what `dsq quantize --method NAME` runs."""

    name = ""
    spec_type: type = object  # the spec class this method takes
    needs_calibration = False
    writes_card = False  # the artifact has a model card that evaluation numbers can go in

    def spec(self, options: dict):
        """This method's spec from flat options (the CLI's flag names)."""
        raise NotImplementedError

    def validate(self, spec) -> None:
        """Refuse settings the method cannot honour; fill in its defaults."""

    def weight_bits(self, spec) -> float:
        raise NotImplementedError

    def output_name(self, spec) -> str:
        """The default artifact's name after the model's: NAME-<this>."""
        raise NotImplementedError

    def quantize(self, source: Path, out: Path, spec, *, device: str = "auto", force: bool = False,
                 threads: int | None = None, progress: OnStep = no_progress, batch: int = 8,
                 compute_dtype: "torch.dtype | None" = None, eval_tokens: int = EVAL_TOKENS) -> Path:
        raise NotImplementedError

    def describe(self, out: Path) -> str:
        """What `dsq quantize` says about the artifact it wrote."""
        raise NotImplementedError


class LayerMethod(Method):
    """A method that dsq.quant.driver runs one decoder block at a time into an HF directory."""

    spec_type = QuantSpec
    default_sym = True
    takes_act_order = False
    writes_card = True

    def spec(self, options: dict) -> QuantSpec:
        return QuantSpec.from_options(self.name, options)

    def validate(self, spec: QuantSpec) -> None:
        if spec.sym is None:
            spec.sym = self.default_sym
        self.check(spec)
        if spec.act_order and not self.takes_act_order:
            raise DsqError("--act-order applies to gptq only")
        if not 0 < spec.damp < 1:
            raise DsqError(f"--damp must be in (0, 1), got {spec.damp}")
        if spec.min_expert_tokens < 0:
            raise DsqError(f"min_expert_tokens must be 0 or more, got {spec.min_expert_tokens}")

    def check(self, spec: QuantSpec) -> None:
        """The method's own rules on its settings."""

    def weight_bits(self, spec: QuantSpec) -> int:
        return spec.bits

    def label(self, spec: QuantSpec) -> str:
        return f"{self.name}-w{self.weight_bits(spec)}"

    def output_name(self, spec: QuantSpec) -> str:
        return self.label(spec)

    def kept(self, spec: QuantSpec, kept=None) -> list[str]:
        """What the checkpoint keeps 16-bit as loaders match modules by substring (AWQ's
        modules_to_not_convert): the output head, then the skip patterns, or with `kept`
        (dsq.quant.moe.Kept) whole layers by prefix and every other kept Linear by name."""
        if kept is None:
            return ["lm_head"] + list(spec.skip)
        return ["lm_head"] + kept.layer_prefixes() + kept.outside_layers()

    def quantization_config(self, spec: QuantSpec, kept=None) -> dict:
        raise NotImplementedError

    def check_shape(self, name: str, n_out: int, n_in: int, spec: QuantSpec) -> None:
        """Refuse, before any work, a Linear the format cannot hold."""

    def packed_bytes(self, n_out: int, n_in: int, spec: QuantSpec) -> int:
        """About the bytes the checkpoint stores for one quantized (n_out, n_in) Linear: its
        codes, a scale and a zero point per group, the group index."""
        groups = 1 if spec.group_size <= 0 else -(-n_in // spec.group_size)
        return n_out * n_in * self.weight_bits(spec) // 8 + n_out * groups * 4 + n_in * 4

    def quantize_block(self, block: "Block", spec: QuantSpec) -> dict:
        """Quantize the block's Linears in place; the tensors to write, by name inside the block."""
        raise NotImplementedError

    def settings(self, spec: QuantSpec) -> dict:
        """The model card's rows for the method's own settings."""
        return {}

    def card_settings(self, spec: QuantSpec) -> dict:
        rows = {"method": self.name, "bits": self.weight_bits(spec), **self.settings(spec)}
        if self.needs_calibration:
            rows.update(calibration=spec.calib.source, samples=spec.calib.samples, seq_len=spec.calib.seq_len)
        return rows

    def quantize(self, source: Path, out: Path, spec: QuantSpec, *, device: str = "auto", force: bool = False,
                 threads: int | None = None, progress: OnStep = no_progress, batch: int = 8,
                 compute_dtype: "torch.dtype | None" = None, eval_tokens: int = EVAL_TOKENS) -> Path:
        from dsq.quant.driver import quantize_layers
        from dsq.runtime.model_ref import resolve_model

        ref = resolve_model(str(source))
        if ref.kind != "hf":
            raise DsqError(f"{self.name} quantizes HF safetensors models", "convert the GGUF first: dsq convert IN OUT")
        quantize_layers(ref.path, out, spec, device=device, force=force, progress=progress, batch=batch,
                        compute_dtype=compute_dtype, eval_tokens=eval_tokens)
        return out

    def describe(self, out: Path) -> str:
        total, kept = weights_bytes(out), bytes_outside_layers(out)
        return (f"{total / 2**20:.1f} MiB, of which {kept / 2**20:.1f} MiB ({100 * kept / max(total, 1):.0f}%) are "
                "the embeddings, the output head and the final norm, kept 16-bit: only the layers' Linears are "
                "quantized")


_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}


def bytes_outside_layers(out: Path) -> int:
    """Bytes of an HF directory's tensors that are not in a decoder layer (model.layers.*)."""
    from safetensors import safe_open

    total = 0
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), framework="np") as st:
            for name in st.keys():
                if ".layers." not in name:
                    sl = st.get_slice(name)
                    n = 1
                    for d in sl.get_shape():
                        n *= d
                    total += n * _DTYPE_BYTES.get(sl.get_dtype(), 1)
    return total
