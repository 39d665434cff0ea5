"""Build a native model from an HF directory or a GGUF file.

The model is built on the meta device and filled with `load_state_dict(assign=True)` from
memory-mapped tensors, so weights are never copied twice: a tensor is copied only when its dtype
must change. GGUF weights in a supported quant type stay as raw blocks inside GGUFLinear /
GGUFEmbedding; other GGUF types are dequantized once at load.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dsq.errors import BadModelFile
from dsq.models.base import Transformer, module_device
from dsq.models.registry import arch_for_gguf, build_args
from dsq.runtime.gpu_layers import GpuLayers
from dsq.runtime.qmodules import GGUFEmbedding, GGUFLinear, prepare_kernels, set_module

FLOAT_GGUF = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _check_shapes(model: nn.Module, sd: dict[str, torch.Tensor], where: str, shown: dict | None = None) -> None:
    """Every tensor present with the shape the config implies; `shown` names tensors as the file does."""
    shown = shown or {}
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    missing = [n for n in expected if n not in sd and not n.startswith("lm_head.")]
    if missing:
        raise BadModelFile(f"{where} lacks tensor {missing[0]} (and {len(missing) - 1} more)" if len(missing) > 1
                           else f"{where} lacks tensor {missing[0]}", "the file does not match its config")
    for n, t in sd.items():
        if n not in expected:
            raise BadModelFile(f"{where} has tensor {n} the model does not use", "is the config right?")
        if tuple(t.shape) != tuple(expected[n].shape):
            raise BadModelFile(f"{where}: tensor {shown.get(n, n)} has shape {tuple(t.shape)}, the config implies "
                               f"{tuple(expected[n].shape)}", "the file is damaged or does not match its config")


def _place(model: Transformer, gpu_layers: GpuLayers, gpu: torch.device | None) -> None:
    """Layers on their devices (GpuLayers.devices: llama.cpp's last N layers). The native runtime
    puts the output head on the GPU whenever any layer is there, and keeps the token embedding on
    the CPU in a split (one row a token): the head is read every token, so it costs the most where
    memory is slowest (docs/benchmarks.md#split-between-gpu-and-cpu). CPU layers of a split model
    compute in float32, the C kernels' dtype."""
    per, head = gpu_layers.devices(model.args.num_hidden_layers, gpu)
    split = gpu is not None and gpu in per and torch.device("cpu") in per
    if gpu is not None and gpu in per:
        head = gpu
    for layer, dev in zip(model.model.layers, per):
        layer.to(dev)
        if split and dev.type == "cpu":
            _float32_params(layer)
    model.model.embed_tokens.to(torch.device("cpu") if split else per[0] if per else head)
    if split and hasattr(model.model.embed_tokens, "out_dtype"):  # GGUF rows straight to float32
        model.model.embed_tokens.out_dtype = torch.float32
    model.model.norm.to(head)
    tied = model.args.tie_word_embeddings
    if tied and per and module_device(model.model.embed_tokens) != head:  # the output head gets its own copy
        import copy

        model.lm_head = copy.deepcopy(model.lm_head)
    model.lm_head.to(head)


def _release_cached_memory(gpu: torch.device | None) -> None:
    """Hand the GPU memory that loading freed (the file's blocks as the kernels' layouts replaced
    them) back to the driver: torch's allocator would otherwise keep it for itself, ~1 GiB for an
    8B Q4_K_M model (docs/benchmarks.md#split-between-gpu-and-cpu)."""
    if gpu is not None:
        torch.cuda.empty_cache()


def _float32_params(module: nn.Module) -> None:
    """16-bit float parameters (norm weights, biases, float weights) as float32; quantized
    modules' buffers (codes, scales) stay as their kernels read them."""
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False):
            if p.dtype in (torch.float16, torch.bfloat16):
                setattr(m, name, nn.Parameter(p.float(), requires_grad=False))


def load_hf(path: Path, dtype: torch.dtype, gpu_layers: GpuLayers = GpuLayers.NONE, gpu: torch.device | None = None):
    from dsq.formats.hf import HFModelDir

    hf = HFModelDir(path)
    cfg = hf.config
    arch, args = build_args(cfg, f"{path}/config.json")
    with torch.device("meta"):
        model: Transformer = arch.Model(args)
    tensors = hf.mmap_tensors()
    if cfg.get("quantization_config"):
        _swap_quantized(model, cfg["quantization_config"], tensors, dtype)
    sd = {}
    for name, t in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and args.tie_word_embeddings:
            continue
        float_param = name.endswith((".weight", ".bias")) and t.dtype in (torch.float32, torch.float16, torch.bfloat16)
        sd[name] = t.to(dtype) if float_param and t.dtype != dtype else t
    _check_shapes(model, sd, str(path))
    model.load_state_dict(sd, strict=False, assign=True)
    if not args.tie_word_embeddings and "lm_head.weight" not in sd:
        raise BadModelFile(f"{path} lacks lm_head.weight and does not tie embeddings", "fix tie_word_embeddings")
    model.tie_weights()
    _place(model, gpu_layers, gpu)
    prepare_kernels(model)
    _release_cached_memory(gpu)
    return model.eval(), cfg


def _swap_quantized(model: nn.Module, qc: dict, tensors: dict[str, torch.Tensor], dtype) -> None:
    """Replace Linears whose checkpoint tensors are quantized by modules of that format."""
    from dsq.runtime.qmodules import AWQLinear, FP8Linear, GPTQLinear

    method = qc.get("quant_method")
    if method not in ("awq", "gptq", "compressed-tensors", "fp8"):
        raise BadModelFile(f"quantization method {method!r} is not supported by the native runtime",
                           "supported: awq, gptq, compressed-tensors (fp8), fp8")
    group = int(qc.get("group_size", 128) or -1)
    if method == "compressed-tensors":
        if qc.get("format") != "float-quantized":
            raise BadModelFile(f"compressed-tensors format {qc.get('format')!r} is not supported", "dsq reads FP8 weights")
    for name, m in list(model.named_modules()):
        if not isinstance(m, nn.Linear):
            continue
        bias = m.bias is not None
        with torch.device("meta"):
            if f"{name}.qweight" in tensors and method == "awq":
                new = AWQLinear(m.in_features, m.out_features, bias, group, dtype)
            elif f"{name}.qweight" in tensors:
                new = GPTQLinear(m.in_features, m.out_features, bias, int(qc["bits"]), group,
                                 qc.get("checkpoint_format", "gptq") == "gptq", dtype)
            elif tensors.get(f"{name}.weight") is not None and tensors[f"{name}.weight"].dtype == torch.float8_e4m3fn:
                sname = "weight_scale_inv" if f"{name}.weight_scale_inv" in tensors else "weight_scale"
                new = FP8Linear(m.in_features, m.out_features, bias, tuple(tensors[f"{name}.{sname}"].shape), sname, dtype)
            else:
                continue
        set_module(model, name, new)


def load_gguf(path: Path, dtype: torch.dtype, gpu_layers: GpuLayers = GpuLayers.NONE, gpu: torch.device | None = None):
    from dsq.formats.gguf_file import GGUFFile
    from dsq.convert.gguf_to_hf import hf_config_from_gguf
    from dsq.kernels.gguf_ref import SUPPORTED, row_bytes

    g = GGUFFile(path)
    arch = arch_for_gguf(g.arch)
    cfg = hf_config_from_gguf(g, arch, str(dtype).replace("torch.", ""))
    _, args = build_args(cfg, f"{path.name} (GGUF metadata)")
    with torch.device("meta"):
        model: Transformer = arch.Model(args)
    modules = dict(model.named_modules())
    sd: dict[str, torch.Tensor] = {}
    shown: dict[str, str] = {}
    entries = {t.name: t for t in g.tensors}
    nq, nkv = args.num_attention_heads, args.num_key_value_heads
    for gname, hname in arch.gguf_plan(list(entries), path.name):
        t = entries[gname]
        raw, qtype, shape = g.raw(t.name)
        raw_t = torch.from_numpy(raw)
        shown[hname] = t.name
        mname = hname.rsplit(".", 1)[0]
        is_q = False
        if t.type_name in SUPPORTED and t.type_name not in FLOAT_GGUF and len(shape) == 2:
            is_q = True
            rows = arch.from_gguf(hname, raw_t.reshape(shape[0], row_bytes(t.type_name, shape[1])), nq, nkv)
            old = modules.get(mname)
            if isinstance(old, nn.Linear):
                expected = (old.out_features, old.in_features)
                if tuple(shape) != expected:
                    raise BadModelFile(f"{path.name}: tensor {t.name} has shape {tuple(shape)}, the metadata "
                                       f"implies {expected}", "the file is damaged or does not match its metadata")
                with torch.device("meta"):
                    set_module(model, mname, GGUFLinear(t.type_name, shape[1], shape[0], old.bias is not None,
                                                        dtype=dtype))
                sd[f"{mname}.raw"] = rows
            elif hname == "model.embed_tokens.weight":
                if tuple(shape) != (args.vocab_size, args.hidden_size):
                    raise BadModelFile(f"{path.name}: token_embd has shape {tuple(shape)}, expected "
                                       f"{(args.vocab_size, args.hidden_size)}", "the file is damaged")
                with torch.device("meta"):
                    set_module(model, "model.embed_tokens", GGUFEmbedding(t.type_name, shape[0], shape[1], dtype=dtype))
                sd["model.embed_tokens.raw"] = rows
                if args.tie_word_embeddings:
                    with torch.device("meta"):
                        set_module(model, "lm_head", GGUFLinear(t.type_name, shape[1], shape[0], dtype=dtype))
                    sd["lm_head.raw"] = rows
        if not is_q:
            if t.type_name in FLOAT_GGUF:
                w = raw_t.view(FLOAT_GGUF[t.type_name]).reshape(shape).float()
            else:  # a type without a kernel yet: dequantized once, here
                w = torch.from_numpy(g.dequantize(t.name).copy())
            sd[hname] = arch.from_gguf(hname, w, nq, nkv).to(dtype)
    if args.tie_word_embeddings and "model.embed_tokens.weight" in sd:
        sd.pop("lm_head.weight", None)
    _check_shapes(model, sd, path.name, shown)
    model.load_state_dict(sd, strict=False, assign=True)
    if "model.embed_tokens.weight" in sd:
        model.tie_weights()
    _place(model, gpu_layers, gpu)
    prepare_kernels(model)
    _release_cached_memory(gpu)
    return model.eval(), cfg
