"""--experts cpu|gpu|auto: where a MoE model's routed experts run on the native backend.

- gpu: with the rest of their layer (on the layer's device); on a GPU each layer's experts are
  stacked into one packed weight per projection (GPUStackedExperts, `experts_to_gpu`), so a
  decode step routes its tokens with the expert ids on the device, without a host sync, and is
  captured as one CUDA graph;
- cpu: every layer's routed experts stay in RAM as the GGUF file's stacked blocks and run through
  one C call per layer (CPURoutedExperts), while attention, the router, the shared experts, the
  dense layers, the norms and the head run where --gpu-layers puts them;
- auto: with a GPU, what the placement plan predicts faster among the placements that fit its free
  memory (runtime/placement.py); without one, gpu (the experts run with their layers on the CPU).
Dense models ignore the flag."""

from __future__ import annotations

from pathlib import Path

from dsq.errors import DsqError, UnsupportedModel
from dsq.runtime.placement import EXPERTS, MiB


def parse_experts(value: str | None) -> str:
    v = (value or "auto").strip().lower()
    if v not in EXPERTS:
        raise DsqError(f"--experts takes cpu, gpu or auto, got {value!r}",
                       "cpu keeps the routed experts in RAM, gpu keeps them with their layers")
    return v


def check_backend(value: str, backend: str) -> str:
    """`value` if `backend` can place the experts so: llama.cpp (through dsq) keeps them with their
    layers."""
    if value == "cpu" and backend != "native":
        raise DsqError("--experts cpu is the native backend's placement",
                       "pass --backend native (llama.cpp's own tools take -ot exps=CPU)")
    return value


def is_moe(model: Path | None) -> bool:
    """Whether the GGUF file or HF directory `model` has routed experts (its metadata or
    config.json; no tensor is read)."""
    if model is None:
        return False
    p = Path(model)
    if p.is_dir():
        from dsq.formats.hf import HFModelDir

        return bool(HFModelDir(p).config.get("n_routed_experts"))
    from dsq.formats.gguf_file import GGUFFile

    return bool(GGUFFile(p).arch_field("expert_count", 0))


def cpu_runnable(model: Path) -> bool:
    """Whether `model` is a GGUF whose routed experts are in types the C kernels run."""
    from dsq.kernels.cpu import GGML_TYPES

    if Path(model).is_dir():
        return False
    from dsq.formats.gguf_file import GGUFFile

    return all(t.type_name in GGML_TYPES for t in GGUFFile(model).tensors if "_exps." in t.name)


def resolve_experts(value: str, model: Path | None, ctx: int, gpu, gpu_layers) -> str:
    """"cpu" or "gpu" for `value` (parse_experts) on this machine (`gpu`: a torch device or None).
    An explicit gpu whose placement (the resolved `gpu_layers`) cannot fit the GPU's free memory
    raises a one-line error that says what to do."""
    if not is_moe(model):
        return "gpu"
    if value == "cpu" or gpu is None or (value == "auto" and not cpu_runnable(model)):
        return "cpu" if value == "cpu" else "gpu"
    from dsq.runtime.machine import machine_bandwidths
    from dsq.runtime.placement import detect_gpu, plan_placement

    info = detect_gpu()
    if info is None:
        return "cpu" if value == "cpu" else "gpu"
    plan = plan_placement(model, vram=info.free_bytes, ctx=ctx, backend="native", gpu_layers=gpu_layers,
                          bandwidths=machine_bandwidths(info, measure=False), experts=value)
    if value == "gpu" and not gpu_layers.auto and plan.gpu_total_bytes > info.free_bytes:
        raise DsqError(f"the model's layers with their routed experts need ~{plan.gpu_total_bytes / MiB:.0f} MiB of "
                       f"GPU memory, {info.free_bytes / MiB:.0f} MiB is free",
                       "pass --experts cpu to keep the routed experts in RAM (or --experts auto, or fewer "
                       "--gpu-layers)")
    return plan.experts


def experts_to_cpu(model) -> int:
    """Replace every MoE layer's routed experts by CPURoutedExperts over the GGUF file's stacked
    blocks (views, not copies, where the experts are views into one tensor, as the loader makes
    them). Call before the layers are placed. Returns how many layers changed."""
    import torch

    from dsq.kernels.cpu import GGML_TYPES, available
    from dsq.models.deepseek_model import CPURoutedExperts, MoE
    from dsq.runtime.qmodules import GGUFLinear

    n = 0
    for layer in model.model.layers:
        moe = layer.mlp
        if not isinstance(moe, MoE) or isinstance(moe.experts, CPURoutedExperts):
            continue
        if not available():
            raise UnsupportedModel("--experts cpu needs dsq's compiled CPU kernels, and none were built",
                                   "reinstall dsq with a C compiler, or pass --experts gpu")
        parts, qtypes = [], []
        for proj in ("gate_proj", "up_proj", "down_proj"):
            mods = [getattr(e, proj) for e in moe.experts]
            if not all(type(m) is GGUFLinear and m.qtype == mods[0].qtype and m.bias is None for m in mods) \
                    or mods[0].qtype not in GGML_TYPES:
                kind = mods[0].qtype if type(mods[0]) is GGUFLinear else type(mods[0]).__name__
                raise UnsupportedModel(f"--experts cpu runs GGUF experts in {', '.join(GGML_TYPES)}, this model's "
                                       f"are {kind}", "run a quantized GGUF of it (dsq quantize MODEL --format "
                                       "gguf), or pass --experts gpu")
            parts.append(_stacked([m.raw for m in mods]))
            qtypes.append(mods[0].qtype)
        if moe.experts[0].act is not torch.nn.functional.silu:
            raise UnsupportedModel("--experts cpu runs SiLU experts only", "pass --experts gpu")
        moe.experts = CPURoutedExperts(*parts, qtypes)
        n += 1
    return n


def experts_to_gpu(model, on: tuple[str, ...] = ("cuda",)) -> int:
    """Replace every MoE layer's routed experts that run on a GPU through the Triton kernels (each
    projection a PackedLinear, prepare_kernels' output, of one format, no bias or act-order) by
    GPUStackedExperts over their stacked planes (stack_experts). `on`: the device types whose
    experts are stacked (the tests stack CPU tensors too). Returns how many layers changed."""
    return sum(stack_experts(layer, on) for layer in model.model.layers)


def stack_experts(layer, on: tuple[str, ...] = ("cuda",)) -> bool:
    """experts_to_gpu for one layer, after prepare_kernels(layer): its per-expert weights are freed
    as its stack is made (nothing else may hold the old experts module:
    tests/test_deepseek_experts_gpu.py checks it). The loader stacks each layer as soon as it is
    converted, so the next layer's per-expert weights (the same sizes) can reuse the blocks this
    layer's free. Returns whether it changed."""
    import torch

    from dsq.models.deepseek_model import GPUStackedExperts, MoE, RoutedExperts
    from dsq.runtime.qmodules import PackedLinear

    moe = layer.mlp
    if not isinstance(moe, MoE) or not isinstance(moe.experts, RoutedExperts):
        return False
    mods = {proj: [getattr(e, proj, None) for e in moe.experts] for proj in ("gate_proj", "up_proj", "down_proj")}
    if not all(_stackable(ms, PackedLinear) and ms[0].lo.device.type in on for ms in mods.values()):
        return False
    E = len(moe.experts)
    gate, up, down = ([m.packed for m in mods[proj]] for proj in ("gate_proj", "up_proj", "down_proj"))
    act, source = moe.experts[0].act, mods["gate_proj"][0].source
    if gate[0].fmt == up[0].fmt and gate[0].K == up[0].K and gate[0].fmt.sc_rows == 1:
        gate_up, gate, up = _stack(gate, up), None, None  # per expert: its gate rows, then its up rows
    else:
        gate_up, gate, up = None, _stack(gate), _stack(up)
    moe.experts = GPUStackedExperts(gate_up, gate, up, _stack(down), E, act, source)
    del mods, gate, up, down, gate_up  # the per-expert weights go with the old module
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return True


def _stackable(mods: list, kind) -> bool:
    """Whether one expert's weights of one projection stack: one module kind and format, no bias or
    act-order, one shape and device, and whole row blocks of scales (FP8 128-row blocks)."""
    m0 = mods[0]
    return all(type(m) is kind and m.bias is None and m.perm is None and m.fmt == m0.fmt and m.in_features ==
               m0.in_features and m.out_features == m0.out_features and m.lo.device == m0.lo.device
               and m.out_features % m.fmt.sc_rows == 0 for m in mods)


def _stack(*parts: list):
    """One Packed over E experts' weights (lists of E Packed of one format): expert e's rows are
    those of parts[0][e], parts[1][e], ... in turn."""
    import torch

    from dsq.kernels.packed import Packed

    p0 = parts[0][0]
    E = len(parts[0])
    rows = sum(ps[0].N for ps in parts)
    kw = {k: torch.cat([torch.stack([getattr(p, k) for p in ps]) for ps in parts], dim=1).reshape(E * rows, -1)
          for k in p0.tensors()}
    return Packed(p0.fmt, E * rows, p0.K, **kw)


def _stacked(raws: list):
    """(E, rows, row bytes) over the experts' blocks: a strided view when they are evenly spaced in
    one storage (the file's stacked tensor), else a copy."""
    import torch

    r0 = raws[0]
    step = raws[1].data_ptr() - r0.data_ptr() if len(raws) > 1 else r0.numel()
    same = all(r.is_contiguous() and r.shape == r0.shape and r.untyped_storage().data_ptr() ==
               r0.untyped_storage().data_ptr() and r.data_ptr() == r0.data_ptr() + i * step
               for i, r in enumerate(raws))
    if same and step >= r0.numel():
        return r0.as_strided((len(raws), *r0.shape), (step, r0.shape[1], 1))
    return torch.stack(raws)
