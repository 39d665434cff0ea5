"""AWQ (Lin et al., 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"): per input channel scales s = mean|x|^a / mean|w|^(1-a), searched over a in [0, 1)
to minimize the output error of the quantized layers, folded into the operation before them
(norm weights, or the previous Linear's rows) so the model computes the same function; then a
per-group clipping search. Follows AutoAWQ's search (duo scaling, 20-point grids).

Shapes: x (T, K) calibration inputs of a group of Linears that share them; W (N, K).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from dsq.errors import DsqError
from dsq.formats import awq_gptq
from dsq.quant.blocks import Capture, input_groups, phase
from dsq.quant.moe import calibrates
from dsq.quant.rtn import IntMethod, IntQuant, group_params, quantize_codes, rtn

if TYPE_CHECKING:
    from dsq.quant.blocks import Block
    from dsq.quant.spec import QuantSpec

N_GRID = 20


def fake_quant(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Asymmetric group-wise round-to-nearest, dequantized (AWQ's quantizer)."""
    N, K = w.shape
    g = K if group == -1 else group
    wg = w.float().reshape(-1, g)
    scale, zero = group_params(wg, bits, sym=False)
    q = quantize_codes(wg, scale[:, None], zero[:, None], bits)
    return (scale[:, None] * (q - zero[:, None])).reshape(N, K).to(w.dtype)


@dataclass
class ScaleGroup:
    """Linears that read the same input, the op whose output they read, and how to score a scale.
    `name`: the captured input the search runs on; `inputs`: the captured inputs the scale divides
    (an MoE layer's experts each read their routed share of the one input); `router`: a float
    module reading that input too (an MoE router), whose columns take the scale so it routes as
    before."""

    name: str
    prev: nn.Module  # an RMSNorm (weight, offset) or an nn.Linear whose output rows feed the group
    linears: list[nn.Linear]
    inspect: Callable[[torch.Tensor], torch.Tensor]  # x -> the output whose error is minimized
    inputs: tuple[str, ...] = ()  # default: (name,)
    router: nn.Module | None = None


def _weight_mean(linears: list[nn.Linear], gsize: int) -> torch.Tensor:
    """Mean over the group's rows of |w| normalized by its quant group's max, per input channel,
    one Linear at a time (an MoE layer's experts together are most of the block)."""
    total, rows = 0.0, 0
    for lin in linears:
        w = lin.weight.float().abs()
        g = w.shape[1] if gsize == -1 else gsize
        total = total + (w.reshape(-1, g) / w.reshape(-1, g).amax(1, keepdim=True).clamp(min=1e-10)).reshape(w.shape).sum(0)
        rows += w.shape[0]
    return total / rows


def search_scale(group: ScaleGroup, x: torch.Tensor, bits: int, gsize: int) -> torch.Tensor:
    """The best per-channel scale (K,) for one group, by output MSE over the grid."""
    x = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        ref = group.inspect(x)
        x_mean = x.abs().float().mean(0)
        w_mean = _weight_mean(group.linears, gsize)
        originals = [lin.weight.data for lin in group.linears]  # replaced below, never changed in place
        best, best_err = None, float("inf")
        for i in range(N_GRID):
            a = i / N_GRID
            s = (x_mean.pow(a) / (w_mean.pow(1 - a) + 1e-4)).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            for lin, w0 in zip(group.linears, originals):
                lin.weight.data = (fake_quant(w0.float() * s, bits, gsize) / s).to(w0.dtype)
            err = (group.inspect(x) - ref).float().pow(2).mean().item()
            if err < best_err:
                best_err, best = err, s.clone()
        for lin, w0 in zip(group.linears, originals):
            lin.weight.data = w0
    return best


def apply_scale(group: ScaleGroup, s: torch.Tensor) -> None:
    """W <- W * s for the group; the previous op's output <- output / s (same function)."""
    with torch.no_grad():
        for lin in group.linears + ([group.router] if group.router is not None else []):
            lin.weight.mul_(s.to(lin.weight.dtype))
        prev = group.prev
        if isinstance(prev, nn.Linear):
            prev.weight.div_(s.to(prev.weight.dtype)[:, None])
            if prev.bias is not None:
                prev.bias.div_(s.to(prev.bias.dtype))
        else:  # RMSNorm computing x_hat * (offset + w)
            off = getattr(prev, "offset", 0.0)
            prev.weight.copy_(((off + prev.weight.float()) / s - off).to(prev.weight.dtype))


def search_clip(lin: nn.Linear, x: torch.Tensor, bits: int, gsize: int, n_tokens: int = 512,
                max_shrink: float = 0.5, oc_batch: int = 256) -> torch.Tensor:
    """Per (output row, group) clipping of |W| that minimizes the group's partial-output error."""
    w = lin.weight.float()
    N, K = w.shape
    g = K if gsize == -1 else gsize
    x = x.reshape(-1, K).float()
    x = x[torch.linspace(0, x.shape[0] - 1, min(n_tokens, x.shape[0])).long().to(x.device)]
    xg = x.reshape(x.shape[0], K // g, g)  # (T, G, g)
    best_all = []
    for b in range(0, N, oc_batch):
        wb = w[b:b + oc_batch].reshape(-1, K // g, g)  # (oc, G, g)
        org_max = wb.abs().amax(dim=-1, keepdim=True)  # (oc, G, 1)
        best = org_max.clone()
        min_err = torch.full_like(org_max, float("inf"))
        org_out = torch.einsum("tgk,ogk->otg", xg, wb)  # each group's share of each output
        for i in range(int(max_shrink * N_GRID)):
            mx = org_max * (1 - i / N_GRID)
            q = fake_quant(torch.clamp(wb, -mx, mx).reshape(-1, K), bits, gsize).reshape(wb.shape)
            err = (torch.einsum("tgk,ogk->otg", xg, q) - org_out).pow(2).mean(1)[..., None]  # (oc, G, 1)
            better = err < min_err
            min_err = torch.where(better, err, min_err)
            best = torch.where(better, mx, best)
        best_all.append(best)
    return torch.cat(best_all)  # (N, G, 1)


def apply_clip(lin: nn.Linear, max_val: torch.Tensor, gsize: int) -> None:
    with torch.no_grad():
        N, K = lin.weight.shape
        g = K if gsize == -1 else gsize
        w = lin.weight.float().reshape(N, K // g, g)
        lin.weight.copy_(torch.clamp(w, -max_val, max_val).reshape(N, K).to(lin.weight.dtype))


def awq_groups(layer, lins) -> list[ScaleGroup]:
    """The scale groups of a decoder layer: (op before, Linears after, what to score)."""
    return _attention_groups(layer, lins) + _mlp_groups(layer, lins)


def _attention_groups(layer, lins) -> list[ScaleGroup]:
    """Llama-style q/k/v after the input norm and o_proj after v_proj; DeepSeek's latent
    attention: q_a (or q) + kv_a after the input norm, q_b after q_a's norm, kv_b after kv_a's
    norm (the latent cache then holds c / s, which kv_b * s reads back the same on both paths)."""
    at = layer.self_attn
    if hasattr(at, "kv_a_proj_with_mqa"):
        first = "self_attn.q_a_proj" if "q_a_proj" in at._modules else "self_attn.q_proj"
        groups = [_group(first, layer.input_layernorm, lins, [first, "self_attn.kv_a_proj_with_mqa"])]
        if "q_a_proj" in at._modules:
            groups.append(_group("self_attn.q_b_proj", at.q_a_layernorm, lins, ["self_attn.q_b_proj"]))
        groups.append(_group("self_attn.kv_b_proj", at.kv_a_layernorm, lins, ["self_attn.kv_b_proj"]))
        return [g for g in groups if g is not None]
    groups = [_group("self_attn.q_proj", layer.input_layernorm, lins,
                     ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])]
    if "self_attn.o_proj" in lins and at.v_proj.out_features == at.o_proj.in_features and "self_attn.v_proj" in lins:
        groups.append(ScaleGroup("self_attn.o_proj", at.v_proj, [at.o_proj], lambda x: at.o_proj(x)))
    return [g for g in groups if g is not None]


def _group(name: str, prev: nn.Module, lins, names: list[str]) -> ScaleGroup | None:
    """Linears `names` after `prev`, scored on their outputs together; None unless all are quantized."""
    if not all(n in lins for n in names):
        return None
    mods = [lins[n] for n in names]
    return ScaleGroup(name, prev, mods, lambda x: torch.cat([m(x) for m in mods], dim=-1))


def _mlp_groups(layer, lins) -> list[ScaleGroup]:
    mlp = layer.mlp
    norm = layer.pre_feedforward_layernorm if getattr(layer, "sandwich", False) else layer.post_attention_layernorm
    if hasattr(mlp, "experts"):
        return _moe_groups(mlp, norm, lins)
    groups = []
    if "mlp.gate_proj" in lins and "mlp.up_proj" in lins:
        groups.append(ScaleGroup("mlp.gate_proj", norm, [mlp.gate_proj, mlp.up_proj], lambda x: mlp(x)))
    groups += _down_group("mlp", mlp, lins)
    return groups


def _moe_groups(moe, norm, lins) -> list[ScaleGroup]:
    """Every expert reads the one normalized input, so their gate/up (and the shared experts')
    share one scale, scored on the MoE layer's output with routing included and folded into the
    router's columns too; each expert's down_proj then gets its own scale from its up_proj."""
    experts = [(f"mlp.experts.{e}", ex) for e, ex in enumerate(moe.experts)]
    if moe.shared_experts is not None:
        experts.append(("mlp.shared_experts", moe.shared_experts))
    firsts = [f"{p}.gate_proj" for p, _ in experts]
    ins = [lins.get(f"{p}.{k}") for p, _ in experts for k in ("gate_proj", "up_proj")]
    groups = []
    if all(ins):
        groups.append(ScaleGroup("mlp", norm, ins, lambda x: moe(x), inputs=("mlp", *firsts), router=moe.gate))
    for p, ex in experts:
        groups += _down_group(p, ex, lins)
    return groups


def _down_group(prefix: str, mlp: nn.Module, lins) -> list[ScaleGroup]:
    if f"{prefix}.down_proj" in lins and f"{prefix}.up_proj" in lins:
        return [ScaleGroup(f"{prefix}.down_proj", mlp.up_proj, [mlp.down_proj], lambda x: mlp.down_proj(x))]
    return []


class InputSample:
    """About `keep` evenly spaced input rows of a Linear over `batches` forward batches."""

    def __init__(self, keep: int, batches: int):
        self.keep, self.batches = keep, batches
        self.rows: list[torch.Tensor] = []
        self.n = 0  # rows seen, sampled or not

    def add(self, x: torch.Tensor) -> None:
        step = max(1, x.shape[0] * self.batches // self.keep)
        self.rows.append(x[::step].float())
        self.n += x.shape[0]

    def sample(self, device) -> torch.Tensor | None:
        return torch.cat(self.rows).to(device) if self.rows else None


class AWQ(IntMethod):
    name = "awq"
    default_sym = False
    needs_calibration = True

    def check_bits(self, spec: "QuantSpec") -> None:
        if spec.bits != 4 or spec.sym:
            raise DsqError("AWQ (GEMM format) is 4-bit asymmetric only", "use --bits 4 without --sym, or gptq")

    def quantization_config(self, spec: "QuantSpec", kept=None) -> dict:
        return awq_gptq.awq_config(spec.group_size, self.kept(spec, kept))

    def tensors(self, iq: IntQuant, spec: "QuantSpec") -> dict[str, torch.Tensor]:
        return awq_gptq.awq_tensors(iq.q, iq.scales, iq.zeros)

    def quantize_block(self, block: "Block", spec: "QuantSpec") -> dict:
        xs = self._inputs(block, spec)
        self._scale(block, xs, spec)
        self._clip(block, xs, spec)
        out: dict[str, torch.Tensor] = {}
        for n, lin in block.linears.items():
            self.emit(out, n, lin, rtn(lin.weight.data.float(), 4, spec.group_size, sym=False).cpu(), spec)  # rounded where it lives
        return out

    @staticmethod
    def _inputs(block: "Block", spec: "QuantSpec") -> dict[str, torch.Tensor]:
        """One capture of every group's inputs (an MoE layer's: its own input, and each expert's
        routed share). The search sees a sample of the tokens (AutoAWQ's 64k would take minutes
        per block on a CPU). An expert with too few tokens is left out: it is only rounded."""
        keep = 16384 if block.device.type == "cuda" else 4096
        batches = max(1, -(-block.hidden.shape[0] // block.batch))
        mods = {g[0]: block.linears[g[0]] for g in input_groups(block.linears)}
        if hasattr(block.layer.mlp, "experts"):
            mods["mlp"] = block.layer.mlp
        with Capture(mods, lambda m: InputSample(keep, batches)) as cap:
            with phase("awq: calibration forward"):
                block.run()
        return {n: v.sample(block.device) for n, v in cap.data.items()
                if calibrates(block, n, v.n, spec) and v.n}

    @staticmethod
    def _scale(block: "Block", xs: dict[str, torch.Tensor], spec: "QuantSpec") -> None:
        """Search and fold each group's scales; `xs` then holds the scaled inputs."""
        layer = block.layer
        layer.awq_output_scales = {}  # Linear -> s folded into its output rows (it now computes y / s)
        for sg in awq_groups(layer, block.linears):
            if sg.name not in xs:  # an expert that falls back to RTN
                continue
            x = xs[sg.name].to(sg.linears[0].weight.dtype)
            with phase("awq: scale search"):
                s = search_scale(sg, x, spec.bits, spec.group_size)
            apply_scale(sg, s)
            for name in sg.inputs or (sg.name,):
                if name in xs:
                    xs[name] = xs[name].to(x.dtype) / s.to(x.dtype)
            if isinstance(sg.prev, nn.Linear):
                layer.awq_output_scales[next(n for n, m in layer.named_modules() if m is sg.prev)] = s

    @staticmethod
    def _clip(block: "Block", xs: dict[str, torch.Tensor], spec: "QuantSpec") -> None:
        """Each Linear's clipping on its own (scaled) inputs; not for those whose outputs are
        queries or keys (attention scores, not outputs, are what they feed)."""
        lins = block.linears
        for group in input_groups(lins):
            for n in group:
                if n.rpartition(".")[2] not in NO_CLIP and group[0] in xs:
                    with phase("awq: clip search"):
                        apply_clip(lins[n], search_clip(lins[n], xs[group[0]], spec.bits, spec.group_size),
                                   spec.group_size)


NO_CLIP = ("q_proj", "k_proj", "q_a_proj", "q_b_proj")
