"""The layer-by-layer quantization driver: one decoder block in memory at a time.

For each block: read its weights from the memory-mapped source, run the calibration activations
through it (collecting what the method needs: Hessians for GPTQ, inputs for AWQ, squared
activations for a GGUF importance matrix), quantize, write the block's tensors, and pass the
*quantized* block's outputs on to the next block. Progress is saved after every block, so an
interrupted run resumes where it stopped. Peak memory: one block + the calibration activations +
the embeddings.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from dsq.errors import DsqError, OutputExists

LINEAR_GROUPS = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
                 ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
METHODS = ("rtn", "awq", "gptq", "fp8")
PHASES: dict[str, float] = {}  # seconds per phase of the last runs (calibration forwards, solves, ...)


class _phase:
    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        PHASES[self.name] = PHASES.get(self.name, 0.0) + time.perf_counter() - self.t


@dataclass
class QuantSpec:
    method: str
    bits: int = 4
    group_size: int = 128
    sym: bool | None = None  # None: the method's default (GPTQ/RTN symmetric, AWQ asymmetric)
    act_order: bool = False
    damp: float = 0.01
    fp8_scheme: str = "channel"  # channel | block
    fp8_format: str = "compressed-tensors"  # compressed-tensors | deepseek
    calib: str = "builtin"  # builtin | builtin-chat | random | a .txt/.jsonl path
    calib_samples: int = 128
    calib_seq_len: int = 512
    skip: list[str] = field(default_factory=list)  # module-name patterns kept 16-bit

    def validate(self) -> "QuantSpec":
        if self.method not in METHODS:
            raise DsqError(f"unknown method {self.method!r}", f"choose one of: gguf, {', '.join(METHODS)}")
        if self.sym is None:
            self.sym = self.method != "awq"
        if self.method == "awq" and (self.bits != 4 or self.sym):
            raise DsqError("AWQ (GEMM format) is 4-bit asymmetric only", "use --bits 4 without --sym, or gptq")
        if self.method in ("rtn", "gptq") and self.bits not in (4, 8):
            raise DsqError(f"--bits {self.bits} is not supported", "use 4 or 8")
        if self.method != "fp8" and not (self.group_size == -1 or self.group_size in (32, 64, 128, 256)):
            raise DsqError(f"--group-size {self.group_size} is not supported", "use 32, 64, 128, 256 or -1 (per channel)")
        if self.method == "fp8" and self.fp8_scheme not in ("channel", "block"):
            raise DsqError(f"unknown FP8 scheme {self.fp8_scheme!r}", "use channel or block")
        if self.method == "fp8" and self.fp8_format not in ("compressed-tensors", "deepseek"):
            raise DsqError(f"unknown FP8 format {self.fp8_format!r}", "use compressed-tensors or deepseek")
        if self.method == "fp8" and self.fp8_format == "deepseek" and self.fp8_scheme != "block":
            raise DsqError("DeepSeek's native FP8 format is 128x128 blocks", "add --fp8-scheme block")
        if self.act_order and self.method != "gptq":
            raise DsqError("--act-order applies to gptq only")
        if not 0 < self.damp < 1:
            raise DsqError(f"--damp must be in (0, 1), got {self.damp}")
        return self

    @property
    def needs_calibration(self) -> bool:
        return self.method in ("awq", "gptq")

    def quantization_config(self) -> dict:
        from dsq.formats import fp8_checkpoint as f8
        from dsq.formats import awq_gptq as intq

        skip = ["lm_head"] + list(self.skip)
        if self.method == "awq":
            return intq.awq_config(self.group_size, skip)
        if self.method in ("gptq", "rtn"):
            return intq.gptq_config(self.bits, self.group_size, self.act_order, bool(self.sym), self.damp, bool(self.sym))
        if self.fp8_format == "deepseek":
            return f8.deepseek_config()
        return f8.compressed_tensors_config(self.fp8_scheme, skip)


# ---------------------------------------------------------------------------------------------
def _block_tensors(hf, i: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{i}."
    return {n[len(prefix):]: t for n, t in hf.mmap_tensors().items() if n.startswith(prefix)}


def _materialize(layer: nn.Module, tensors: dict[str, torch.Tensor], device, dtype) -> None:
    layer.to_empty(device=device).to(dtype)  # the block computes in `dtype` (bf16 on a GPU), not float32
    sd = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items() if not k.endswith("inv_freq")}
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise DsqError(f"block weights do not match the config (missing {missing[:2]}, unexpected {unexpected[:2]})")


def _linears(layer: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}


def _home(hidden: torch.Tensor, dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Where the calibration activations live: on the GPU (in the compute dtype, so nothing is
    lost) when they fit comfortably, else in CPU memory (then every pass copies them over)."""
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        if hidden.numel() * torch.finfo(dtype).bits // 8 < 0.3 * free:
            return hidden.to(dev, dtype)
    return hidden.cpu()


def _run_block(layer, hidden: torch.Tensor, ctx, device, dtype, batch: int) -> torch.Tensor:
    """hidden (n, T, H) -> the block's outputs (n, T, H), where and as `hidden` is stored."""
    from dsq.models.base import PassThroughCache

    cos, sin, mask, slots = ctx
    out = torch.empty_like(hidden)
    cache = PassThroughCache()
    with torch.no_grad():
        for b in range(0, hidden.shape[0], batch):
            x = hidden[b:b + batch].to(device=device, dtype=dtype)
            out[b:b + batch] = layer(x, cos, sin, mask, cache, slots, None).to(out.device, out.dtype)
    return out


class _Capture:
    """Forward pre-hooks on Linears: Hessians, sampled inputs, or mean squares of their inputs."""

    def __init__(self, mods: dict[str, nn.Linear], kind: str, keep_tokens: int = 8192, batches: int = 1):
        """kind "inputs" keeps about `keep_tokens` evenly spaced rows over `batches` forward batches."""
        from dsq.quant.intq import Hessian

        self.kind, self.keep, self.batches = kind, keep_tokens, batches
        self.data: dict[str, object] = {}
        self.handles = []
        for name, m in mods.items():
            if kind == "hessian":
                self.data[name] = Hessian(m.in_features, m.weight.device)
            elif kind == "sumsq":
                self.data[name] = [torch.zeros(m.in_features, dtype=torch.float64), 0]
            else:
                self.data[name] = []
            self.handles.append(m.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name):
        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            if self.kind == "hessian":
                self.data[name].add(x)
            elif self.kind == "sumsq":
                acc = self.data[name]
                acc[0] += x.double().pow(2).sum(0).to(acc[0].device)
                acc[1] += x.shape[0]
            else:
                step = max(1, x.shape[0] * self.batches // self.keep)
                self.data[name].append(x[::step].float())
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class Progress:
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
    return hashlib.sha256(json.dumps([str(src.resolve()), stamp, asdict(spec)], sort_keys=True).encode()).hexdigest()


def check_model(hf, spec: QuantSpec) -> None:
    """Every quantized layer must fit the format: refuse before any work."""
    from dsq.formats.awq_gptq import check_shape
    from dsq.models.registry import build_args

    mod, args = build_args(hf.config, f"{hf.path}/config.json")
    with torch.device("meta"):
        model = mod.Model(args)
    for name, m in _linears(model.model.layers[0]).items():
        full = f"model.layers.0.{name}"
        if spec.method != "fp8" and not _skipped(full, spec):
            check_shape(full, m.out_features, m.in_features, spec.bits, spec.group_size, spec.method)


def _skipped(full_name: str, spec: QuantSpec) -> bool:
    return any(fnmatch.fnmatch(full_name, p) for p in spec.skip)


# ---------------------------------------------------------------------------------------------
def quantize_block(layer: nn.Module, i: int, spec: QuantSpec, hidden, ctx, device, dtype, batch: int) -> dict:
    """Quantize one materialized block in place (weights become their dequantized values).
    Returns the tensors to write, by name inside the block."""
    from dsq.formats import awq_gptq as intq
    from dsq.quant import awq as A
    from dsq.quant import intq as Q
    from dsq.quant.fp8 import fp8_quantize

    lins = {n: m for n, m in _linears(layer).items() if not _skipped(f"model.layers.{i}.{n}", spec)}
    out: dict[str, torch.Tensor] = {}

    def emit(name: str, iq) -> None:
        lin = lins[name]
        if spec.method == "awq":
            out.update({f"{name}.{k}": v for k, v in intq.awq_tensors(iq.q, iq.scales, iq.zeros).items()})
        else:
            out.update({f"{name}.{k}": v for k, v in intq.gptq_tensors(
                iq.q, iq.scales, iq.zeros, iq.g_idx, spec.bits, v1=bool(spec.sym)).items()})
        lin.weight.data = iq.dequantize().to(device=lin.weight.device, dtype=lin.weight.dtype)

    if spec.method == "fp8":
        for name, lin in lins.items():
            q, scale = fp8_quantize(lin.weight.data.cpu(), spec.fp8_scheme)
            key = "weight_scale_inv" if spec.fp8_format == "deepseek" else "weight_scale"
            out[f"{name}.weight"], out[f"{name}.{key}"] = q, scale
        return out
    if spec.method == "rtn":
        for name, lin in lins.items():
            emit(name, Q.rtn(lin.weight.data.cpu(), spec.bits, spec.group_size, bool(spec.sym)))
        return out
    if spec.method == "gptq":
        for group in LINEAR_GROUPS:
            names = [n for n in group if n in lins]
            if not names:
                continue
            cap = _Capture({names[0]: lins[names[0]]}, "hessian")
            with _phase("gptq: calibration forwards"):
                _run_block(layer, hidden, ctx, device, dtype, batch)
            cap.close()
            # Linears reading the same input share one Hessian, and GPTQ treats rows independently:
            # one solve over their stacked rows equals separate solves, with a third of the steps
            with _phase("gptq: solve"):
                w = torch.cat([lins[n].weight.data.float() for n in names])
                iq = Q.gptq(w, cap.data[names[0]].H, spec.bits, spec.group_size, bool(spec.sym),
                            spec.act_order, spec.damp)
            for n, part in zip(names, iq.split([lins[n].out_features for n in names])):
                emit(n, part)
        return out
    # AWQ: one capture of every group's inputs, then scales, clipping and quantization. The search
    # sees a sample of the tokens (AutoAWQ's 64k would take minutes per block on a CPU).
    keep = 16384 if torch.device(device).type == "cuda" else 4096
    cap = _Capture({g[0]: lins[g[0]] for g in LINEAR_GROUPS if g[0] in lins}, "inputs", keep_tokens=keep,
                   batches=max(1, -(-hidden.shape[0] // batch)))
    with _phase("awq: calibration forward"):
        _run_block(layer, hidden, ctx, device, dtype, batch)
    cap.close()
    xs = {n: torch.cat(v).to(device) for n, v in cap.data.items()}
    layer.awq_output_scales = {}  # Linear -> s folded into its output rows (it now computes y / s)
    for sg in awq_groups(layer, lins):
        x = xs[sg.name].to(sg.linears[0].weight.dtype)
        with _phase("awq: scale search"):
            s = A.search_scale(sg, x, spec.bits, spec.group_size)
        A.apply_scale(sg, s)
        xs[sg.name] = x / s.to(x.dtype)
        if isinstance(sg.prev, nn.Linear):
            layer.awq_output_scales[next(n for n, m in layer.named_modules() if m is sg.prev)] = s
    for group in LINEAR_GROUPS:
        for n in group:
            if n in lins and n not in ("self_attn.q_proj", "self_attn.k_proj") and group[0] in xs:
                with _phase("awq: clip search"):
                    A.apply_clip(lins[n], A.search_clip(lins[n], xs[group[0]], spec.bits, spec.group_size),
                                 spec.group_size)
    for n, lin in lins.items():
        emit(n, Q.rtn(lin.weight.data.float(), 4, spec.group_size, sym=False).cpu())  # rounded where it lives
    return out


def awq_groups(layer, lins) -> list:
    """The scale groups of a decoder layer: (op before, Linears after, what to score)."""
    from dsq.quant.awq import ScaleGroup

    at, mlp = layer.self_attn, layer.mlp
    groups = []
    qkv = [lins.get(f"self_attn.{p}") for p in ("q_proj", "k_proj", "v_proj")]
    if all(qkv):
        groups.append(ScaleGroup("self_attn.q_proj", layer.input_layernorm, qkv,
                                 lambda x: torch.cat([m(x) for m in qkv], dim=-1)))
    if "self_attn.o_proj" in lins and at.v_proj.out_features == at.o_proj.in_features and "self_attn.v_proj" in lins:
        groups.append(ScaleGroup("self_attn.o_proj", at.v_proj, [at.o_proj], lambda x: at.o_proj(x)))
    norm = layer.pre_feedforward_layernorm if getattr(layer, "sandwich", False) else layer.post_attention_layernorm
    if "mlp.gate_proj" in lins and "mlp.up_proj" in lins:
        groups.append(ScaleGroup("mlp.gate_proj", norm, [mlp.gate_proj, mlp.up_proj], lambda x: mlp(x)))
    if "mlp.down_proj" in lins and "mlp.up_proj" in lins:
        groups.append(ScaleGroup("mlp.down_proj", mlp.up_proj, [mlp.down_proj], lambda x: mlp.down_proj(x)))
    return groups


# ---------------------------------------------------------------------------------------------
def quantize_model(src: str | Path, out: str | Path, spec: QuantSpec, *, device: str = "auto", force: bool = False,
                   on_block: Callable[[int, int, float], None] | None = None, calib_ids: torch.Tensor | None = None,
                   batch: int = 8, compute_dtype: torch.dtype | None = None) -> dict:
    """Quantize the HF model at `src` into an HF directory at `out`. Returns a run summary."""
    from dsq.formats.hf import HFModelDir, ShardedSafetensorsWriter, write_json
    from dsq.models.registry import build_args

    spec.validate()
    hf = HFModelDir(src)
    out = Path(out)
    if out.exists() and not force:
        raise OutputExists(f"{out} already exists", "pass --force to overwrite it or choose another --out")
    mod, args = build_args(hf.config, f"{hf.path}/config.json")
    check_model(hf, spec)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    dtype = compute_dtype or (torch.float32 if dev.type == "cpu" else torch.bfloat16)
    if spec.needs_calibration and calib_ids is None:
        calib_ids = calibration_for(hf, spec)

    partial = out.with_name(out.name + ".partial")
    key = _settings_key(hf.path, spec)
    prog = Progress(partial, key)
    done, hidden = prog.load()
    if done == 0 and partial.exists():  # stale or from other settings: start clean
        shutil.rmtree(partial)
        prog = Progress(partial, key)
    (partial / "blocks").mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = mod.Model(args)
    t_start = time.perf_counter()
    if spec.needs_calibration and hidden is None:
        emb = hf.get_tensor("model.embed_tokens.weight").float()
        hidden = emb[calib_ids]
        if args.embed_scale:
            hidden = hidden * float(torch.tensor(args.embed_scale, dtype=emb.dtype))
        del emb
    if hidden is not None:
        hidden = _home(hidden, dev, dtype)
    n = args.num_hidden_layers
    for i in range(done, n):
        t0 = time.perf_counter()
        layer = model.model.layers[i]
        tensors = _block_tensors(hf, i)
        _materialize(layer, tensors, dev, dtype)
        ctx = model.block_context(i, calib_ids.shape[1], dev) if spec.needs_calibration else None
        qt = quantize_block(layer, i, spec, hidden, ctx, dev, dtype, batch)
        if spec.needs_calibration:
            with _phase("block outputs"):
                hidden = _run_block(layer, hidden, ctx, dev, dtype, batch)
        block = {}
        state = layer.state_dict()
        for name, t in tensors.items():  # norms, biases, skipped layers: as the method left them
            base = name.rsplit(".", 1)[0]
            if name.endswith(".weight") and (f"{base}.qweight" in qt or name in qt):
                continue
            block[f"model.layers.{i}.{name}"] = state[name].to("cpu", t.dtype) if name in state else t
        block.update({f"model.layers.{i}.{k}": v.contiguous() for k, v in qt.items()})
        from safetensors.torch import save_file

        tmp = partial / "blocks" / f"block-{i:05d}.tmp"
        save_file(block, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, partial / "blocks" / f"block-{i:05d}.safetensors")
        layer.to("meta")
        prog.save(i + 1, hidden if spec.needs_calibration else None)
        if on_block:
            on_block(i + 1, n, time.perf_counter() - t0)

    # the rest: embeddings, final norm, output head, unchanged
    rest = ShardedSafetensorsWriter(partial / "blocks")
    for name in hf.tensor_names():
        if not name.startswith("model.layers.") and not name.endswith("inv_freq"):
            rest.add(name, hf.get_tensor(name))
    rest_files = rest.close()
    _finalize(hf, partial, out, spec, rest_files, n, force)
    summary = {"method": spec.method, "seconds": round(time.perf_counter() - t_start, 1), "blocks": n,
               "calibration_tokens": int(calib_ids.numel()) if calib_ids is not None else 0}
    write_json(out / "dsq_quant.json", {"source": str(hf.path.resolve()), "spec": asdict(spec), **summary})
    return summary


def calibration_for(hf, spec: QuantSpec) -> torch.Tensor:
    from dsq.quant.calib import calibration_ids

    if spec.calib == "random":
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, hf.config["vocab_size"], (spec.calib_samples, spec.calib_seq_len), generator=g)
    from dsq.runtime.tokenizer import HFTokenizer

    tok = HFTokenizer(hf.path, hf.config)
    render = None
    if tok.chat_template() or spec.calib == "builtin-chat":
        from dsq.runtime.chat_template import pick_template

        arch = {"gemma3_text": "gemma3"}.get(hf.model_type, hf.model_type)
        tmpl = pick_template(tok.chat_template(), arch, tok.has, tok.bos_token, tok.eos_token)
        render = lambda msgs: tmpl.render(msgs, add_generation_prompt=False)  # noqa: E731
    return calibration_ids(spec.calib, lambda t: tok.encode(t, add_bos=False), spec.calib_samples,
                           spec.calib_seq_len, render)


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
    settings = {"method": spec.method, "bits": 8 if spec.method == "fp8" else spec.bits}
    if spec.method == "fp8":
        settings.update(scheme=spec.fp8_scheme, format=spec.fp8_format)
    else:
        settings.update(group_size=spec.group_size, symmetric=spec.sym)
    if spec.method == "gptq":
        settings.update(act_order=spec.act_order, damp=spec.damp)
    if spec.needs_calibration:
        settings.update(calibration=spec.calib, samples=spec.calib_samples, seq_len=spec.calib_seq_len)
    settings["kept 16-bit"] = ", ".join(["lm_head", "embeddings", "norms"] + list(spec.skip))
    settings["size"] = f"{size / 2**20:.1f} MiB"
    lines += [f"| {k} | {v} |" for k, v in settings.items()]
    if evals:
        lines += ["", "## Evaluation (dsq eval, held-out text)", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in evals.items()]
    lines += ["", "Loads in vLLM / SGLang / transformers as its `quantization_config` says, and in dsq's native runtime."]
    return "\n".join(lines) + "\n"
