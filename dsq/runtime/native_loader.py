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
from dsq.models.base import Placement, Transformer, module_device
from dsq.models.registry import arch_for_gguf, build_args
from dsq.runtime.gpu_layers import GpuLayers, head_alone, head_share, last_gpu
from dsq.runtime.host_mapped import map_embedding
from dsq.runtime.qmodules import GGUFEmbedding, GGUFLinear, RowSplitLinear, prepare_kernels, set_module, to_device

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


def _place(model: Transformer, gpu_layers: GpuLayers, gpus: list[torch.device], each=None, head: str = "gpu",
           shares: list[float] | None = None) -> None:
    """Layers on their devices (GpuLayers.devices: llama.cpp's last N layers, over several GPUs in
    contiguous ranges by `shares`). The native runtime puts the output head on the last GPU whenever
    any layer is on a GPU, and with none on the first GPU given (head="gpu"; "cpu": where llama.cpp
    puts it, on the GPU only with every layer there; a share such as "0.6": that share of its rows
    on the GPU at a split, the rest in RAM, qmodules.RowSplitLinear), and keeps the token embedding
    in RAM (one row a token): on the CPU in a split, host-mapped for the first GPU with every layer
    on GPUs (runtime/host_mapped.py). The head is read every token, so it costs the most where
    memory is slowest (docs/benchmarks.md#split-between-gpu-and-cpu). CPU layers of a split model
    compute in float32, the C kernels' dtype. `each(layer)` runs on each layer once it is in place.
    The plan is kept as model.placement: the runtime moves the hidden state by it."""
    cpu = torch.device("cpu")
    per, head_on = gpu_layers.devices(model.args.num_hidden_layers, gpus, shares)
    on_gpu = [d != cpu for d in per]
    last = last_gpu(gpus, shares) if gpus else None
    head_only = head_alone(gpu_layers, gpus, head)
    if head_only:
        last = gpus[0]  # the one GPU the split step captures on
    split = (any(on_gpu) and not all(on_gpu)) or head_only
    share = head_share(head) if split else 0.0  # of the head's rows, on the GPU
    if (any(on_gpu) or head_only) and (share == 1 or not split):
        head_on = last
    for i, (layer, dev, g) in enumerate(zip(model.model.layers, per, on_gpu)):
        layer = model.model.layers[i] = to_device(layer, dev)
        if split and not g:
            _float32_params(layer)
        if each is not None:
            each(layer)
    embed_on = cpu if split else per[0] if per else head_on
    if embed_on.type != "cuda" or not map_embedding(model.model.embed_tokens, embed_on):
        model.model.embed_tokens.to(embed_on)
    if split and hasattr(model.model.embed_tokens, "out_dtype"):  # GGUF rows straight to float32
        model.model.embed_tokens.out_dtype = torch.float32
    # with the head in RAM (--head cpu) the final norm stays with the last layer on the GPU: the
    # hidden state crosses once, normed, into the head's float32
    norm_on = last if split and head_on == cpu else head_on
    model.model.norm.to(norm_on)
    tied = model.args.tie_word_embeddings
    if tied and per and (embed_on != head_on or module_device(model.model.embed_tokens) != head_on):
        import copy  # the output head gets its own copy

        model.lm_head = copy.deepcopy(model.lm_head)
    model.lm_head = to_device(model.lm_head, head_on)
    if 0 < share < 1:  # --head 0.6: that share of its rows in VRAM, the rest in RAM
        model.lm_head = RowSplitLinear.split(model.lm_head, share, last, model.dtype)
    model.placement = Placement(embed_on, tuple(per), norm_on, module_device(model.lm_head) if 0 < share < 1
                                else head_on)


STACK_ON = ("cuda",)  # the devices whose routed experts loading stacks (experts.stack_experts)


def _release_cached_memory(gpus: list[torch.device]) -> None:
    """Hand the GPU memory that loading freed (the file's blocks as the kernels' layouts replaced
    them) back to the driver: torch's allocator would otherwise keep it for itself, ~1 GiB for an
    8B Q4_K_M model (docs/benchmarks.md#split-between-gpu-and-cpu)."""
    if any(g.type == "cuda" for g in gpus):
        torch.cuda.empty_cache()


def _float32_params(module: nn.Module) -> None:
    """16-bit float parameters (norm weights, biases, float weights) as float32; quantized
    modules' buffers (codes, scales) stay as their kernels read them."""
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False):
            if p.dtype in (torch.float16, torch.bfloat16):
                setattr(m, name, nn.Parameter(p.float(), requires_grad=False))


def float32_params(model: nn.Module) -> set[str]:
    """Names of the parameters that stay float32 whatever the model's dtype: those a module lists in
    FLOAT32_PARAMS (a MoE router, which computes in float32: in 16 bits its weight would be copied
    to float32 at every call)."""
    return {f"{n}.{p}" if n else p for n, m in model.named_modules() for p in getattr(m, "FLOAT32_PARAMS", ())}


def load_hf(path: Path, dtype: torch.dtype, gpu_layers: GpuLayers = GpuLayers.NONE,
            gpus: torch.device | list[torch.device] | None = None, experts: str = "gpu", head: str = "gpu",
            shares: list[float] | None = None, shard=None):
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
    keep32 = float32_params(model)
    arch.check_experts(list(tensors), cfg, str(path))
    for name, t in tensors.items():
        if name.endswith("rotary_emb.inv_freq") or not arch.model_tensor(name, cfg):
            continue
        if name == "lm_head.weight" and args.tie_word_embeddings:
            continue
        float_param = name.endswith((".weight", ".bias")) and t.dtype in (torch.float32, torch.float16, torch.bfloat16)
        want = torch.float32 if name in keep32 else dtype
        sd[name] = t.to(want) if float_param and t.dtype != want else t
    _check_shapes(model, sd, str(path))
    model.load_state_dict(sd, strict=False, assign=True)
    if not args.tie_word_embeddings and "lm_head.weight" not in sd:
        raise BadModelFile(f"{path} lacks lm_head.weight and does not tie embeddings", "fix tie_word_embeddings")
    model.tie_weights()
    if shard is not None:  # a rank's share of each layer (runtime/tp.py), before anything is placed
        shard(model)
    # HF experts in RAM: refused (not GGUF blocks)
    _place_experts_and_layers(model, experts, gpu_layers, _gpu_list(gpus), head, shares)
    return model.eval(), cfg


def _gpu_list(gpus) -> list[torch.device]:
    """The loaders' `gpus` (None, one device, or a list) as a list."""
    return [] if gpus is None else list(gpus) if isinstance(gpus, (list, tuple)) else [gpus]


def _place_experts_and_layers(model: nn.Module, experts: str, gpu_layers, gpus: list[torch.device],
                              head: str = "gpu", shares: list[float] | None = None) -> None:
    """Routed experts into RAM (--experts cpu), the layers onto the GPU, every quantized module into
    its kernels' layout, each layer's experts on a GPU stacked for the grouped GEMV as soon as it is
    converted (experts.stack_experts)."""
    from dsq.runtime.experts import experts_to_cpu, experts_to_gpu, stack_experts

    if experts == "cpu":
        experts_to_cpu(model)

    def convert(layer):  # a layer's file blocks on the GPU only until its kernels' layout is made
        prepare_kernels(layer)
        if experts != "cpu":
            stack_experts(layer, STACK_ON)
        _release_cached_memory(gpus)

    _place(model, gpu_layers, gpus, convert, head, shares)
    prepare_kernels(model)  # the head, norm and embedding
    if experts != "cpu":
        experts_to_gpu(model, STACK_ON)
    _release_cached_memory(gpus)


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


def load_gguf(path: Path, dtype: torch.dtype, gpu_layers: GpuLayers = GpuLayers.NONE,
              gpus: torch.device | list[torch.device] | None = None, experts: str = "gpu", head: str = "gpu",
              shares: list[float] | None = None, shard=None):
    from dsq.convert.gguf_to_hf import gguf_plan, hf_config_from_gguf
    from dsq.formats.gguf_file import GGUFFile

    g = GGUFFile(path)
    arch = arch_for_gguf(g.arch)
    cfg = hf_config_from_gguf(g, arch, str(dtype).replace("torch.", ""))
    _, args = build_args(cfg, f"{path.name} (GGUF metadata)")
    with torch.device("meta"):
        model: Transformer = arch.Model(args)
    tensors = _GGUFTensors(g, model, dtype)
    for made in gguf_plan(g, arch, cfg):
        tensors.add(made)
    sd, shown = tensors.sd, tensors.shown
    # its map of the model's modules as they were would keep each MoE layer's routed experts alive
    # after placing stacks them: on a GPU, the experts twice at the load's peak
    del tensors
    if args.tie_word_embeddings and "model.embed_tokens.weight" in sd:
        sd.pop("lm_head.weight", None)
    _check_shapes(model, sd, path.name, shown)
    model.load_state_dict(sd, strict=False, assign=True)
    embed_float = "model.embed_tokens.weight" in sd
    del sd  # the model holds what it needs; the float copies of layers going to the GPU can go
    if embed_float:
        model.tie_weights()
    if shard is not None:  # a rank's share of each layer (runtime/tp.py), before anything is placed
        shard(model)
    _place_experts_and_layers(model, experts, gpu_layers, _gpu_list(gpus), head, shares)
    return model.eval(), cfg


class _GGUFTensors:
    """A GGUF's tensors as the model's state dict: quantized Linear weights (an expert's: its slice
    of the stacked tensor) and the token embedding stay as raw blocks in GGUFLinear /
    GGUFEmbedding modules swapped in; everything else as float (buffers in float32, the rest in
    the model's dtype), dequantized once where dsq has no kernel for its type."""

    def __init__(self, g, model: Transformer, dtype: torch.dtype):
        self.g, self.model, self.dtype = g, model, dtype
        self.modules = dict(model.named_modules())
        self.buffers = {n for n, _ in model.named_buffers()}
        self.keep32 = float32_params(model)
        self.entries = {t.name: t for t in g.tensors}
        self.sd: dict[str, torch.Tensor] = {}
        self.shown: dict[str, str] = {}  # HF name -> the GGUF tensor it comes from, for errors
        self._last: dict[str, torch.Tensor] = {}  # the last tensor dequantized whole (a stacked one serves each expert)

    def add(self, made) -> None:
        from dsq.kernels.gguf_ref import SUPPORTED

        t = self.entries[made.sources[0]]
        self.shown[made.name] = t.name
        if (len(made.sources) == 1 and t.type_name in SUPPORTED and t.type_name not in FLOAT_GGUF
                and self._add_blocks(made, t)):
            return
        w = made.build([self._float(s) for s in made.sources])
        self.sd[made.name] = (w if made.name in self.buffers else w.float() if made.name in self.keep32
                              else w.to(self.dtype))

    def _rows(self, t) -> torch.Tensor:
        """A quantized tensor's raw blocks, (..., rows, row bytes)."""
        from dsq.kernels.gguf_ref import row_bytes

        raw, _, shape = self.g.raw(t.name)
        return torch.from_numpy(raw).reshape(*shape[:-1], row_bytes(t.type_name, shape[-1]))

    def _add_blocks(self, made, t) -> bool:
        """Keep a Linear's weight or the token embedding as blocks; False for anything else."""
        hname, where = made.name, self.g.path.name
        mname = hname.rsplit(".", 1)[0]
        old, args = self.modules.get(mname), self.model.args
        rows = made.build([self._rows(t)])
        if rows.dim() != 2:
            return False
        shape = (rows.shape[0], t.shape[-1])
        if isinstance(old, nn.Linear):
            expected = (old.out_features, old.in_features)
            if shape != expected:
                raise BadModelFile(f"{where}: tensor {t.name} has shape {shape}, the metadata implies {expected}",
                                   "the file is damaged or does not match its metadata")
            with torch.device("meta"):
                set_module(self.model, mname, GGUFLinear(t.type_name, shape[1], shape[0], old.bias is not None,
                                                         dtype=self.dtype))
            self.sd[f"{mname}.raw"] = rows
            return True
        if hname != "model.embed_tokens.weight":
            return False
        if shape != (args.vocab_size, args.hidden_size):
            raise BadModelFile(f"{where}: token_embd has shape {shape}, expected {(args.vocab_size, args.hidden_size)}",
                               "the file is damaged")
        with torch.device("meta"):
            set_module(self.model, "model.embed_tokens",
                       GGUFEmbedding(t.type_name, shape[0], shape[1], dtype=self.dtype))
            if args.tie_word_embeddings:
                set_module(self.model, "lm_head", GGUFLinear(t.type_name, shape[1], shape[0], dtype=self.dtype))
        self.sd["model.embed_tokens.raw"] = rows
        if args.tie_word_embeddings:
            self.sd["lm_head.raw"] = rows
        return True

    def _float(self, name: str) -> torch.Tensor:
        if name not in self._last:
            self._last.clear()
            raw, _, shape = self.g.raw(name)
            kind = self.entries[name].type_name
            if kind in FLOAT_GGUF:
                self._last[name] = torch.from_numpy(raw).view(FLOAT_GGUF[kind]).reshape(shape).float()
            else:  # a type without a kernel yet: dequantized once, here
                self._last[name] = torch.from_numpy(self.g.dequantize(name).copy())
        return self._last[name]
