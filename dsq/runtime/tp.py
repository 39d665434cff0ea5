"""Tensor parallelism: a model's layers split over N ranks (`dsq serve --tp N`), rank r holding its
share of every layer; dsq/serve/tp.py runs the ranks.

Megatron's split, per decoder layer:
- attention: rank r holds H/N query heads and Hk/N key/value heads (q/k/v output rows by head,
  o_proj's input columns), and its KV cache holds only its key/value heads. DeepSeek's MLA: q_b
  (or q) and kv_b output rows by head, o_proj's columns; the latent projections (q_a, kv_a) and
  the latent cache stay whole on every rank (one latent row serves every head);
- MLP: gate/up output rows and down's input columns, F/N each; DeepSeek's shared experts alike.
  Its routed experts are placed whole, expert e on rank e % N (expert parallel): the router,
  whole on every rank, weighs the other ranks' experts 0 there;
- one all-reduce (a sum) after the attention and one after the MLP (a MoE: its routed and shared
  experts in one sum). o_proj's and down's biases are added on rank 0 only.
The token embedding, the norms and the output head are whole on every rank (replicated).

GGUF blocks run along a row (32 or 256 values), so splitting rows is free, while splitting
o_proj's or down's columns needs each rank's columns to be whole blocks. Where they are not, each
rank's columns are dequantized to the compute dtype (a float Linear, `notes` says which). AWQ,
GPTQ and FP8 weights are dequantized per shard the same way.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dsq.errors import DsqError
from dsq.models.base import MLP, Attention
from dsq.runtime.qmodules import GGUFLinear, _linear_rows


def sizes(args) -> list[int]:
    """The rank counts `args` (a ModelArgs) splits over evenly: query and key/value heads, MLP
    columns (dense and shared experts) and, with routed experts, at least one expert a rank."""
    n_heads = args.num_attention_heads
    latent = hasattr(args, "kv_lora_rank")  # DeepSeek's MLA: no key/value heads of its own
    widths = [args.intermediate_size]
    if getattr(args, "n_shared_experts", 0):
        widths.append(args.moe_intermediate_size * args.n_shared_experts)
    experts = getattr(args, "n_routed_experts", 0)
    return [n for n in range(1, n_heads + 1)
            if n_heads % n == 0 and (latent or args.num_key_value_heads % n == 0)
            and all(w % n == 0 for w in widths) and (not experts or n <= experts)]


def check(n: int, args) -> None:
    """Refuse a rank count the model does not split over evenly, naming those it does."""
    if n < 1:
        raise DsqError(f"--tp must be at least 1, got {n}", "pass --tp 2 or more to split the model over ranks")
    ok = sizes(args)
    if n not in ok:
        latent = hasattr(args, "kv_lora_rank")
        kv = args.num_key_value_heads
        what = f"{args.num_attention_heads} attention heads"
        if not latent:
            what += f", {kv} key/value head{'s' if kv != 1 else ''}"
        hint = f"pass --tp {' or '.join(map(str, ok))}" if len(ok) > 1 else "it runs on one rank: leave --tp out"
        raise DsqError(f"--tp {n} does not split this model's {what} and {args.intermediate_size}-wide MLP evenly",
                       hint)


def shard(model, rank: int, world: int, notes: list[str] | None = None) -> None:
    """Keep rank `rank`'s share of every layer of `model` (loaded, not yet placed nor fused), and
    sum each attention's and MLP's output over the ranks (module docstring). `notes` gets a line
    for each kind of weight dequantized to split."""
    if world == 1:
        return
    check(world, model.args)
    notes = notes if notes is not None else []
    dtype = model.dtype
    from dsq.models.deepseek_model import MLAttention, MoE

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if isinstance(attn, MLAttention):
            _shard_mla(attn, rank, world, dtype, notes)
        elif isinstance(attn, Attention):
            _shard_attention(attn, rank, world, dtype, notes)
        else:
            raise DsqError(f"--tp cannot split a {type(attn).__name__} yet", "leave --tp out")
        if isinstance(mlp, MoE):
            _shard_moe(mlp, rank, world, dtype, notes)
        elif isinstance(mlp, MLP):
            _shard_mlp(mlp, rank, world, dtype, notes)
        else:
            raise DsqError(f"--tp cannot split a {type(mlp).__name__} yet", "leave --tp out")
        attn.__class__, mlp.__class__ = summed(type(attn)), summed(type(mlp))
    a = model.args
    model.args = dataclasses.replace(a, num_attention_heads=a.num_attention_heads // world,
                                     num_key_value_heads=max(1, a.num_key_value_heads // world),
                                     intermediate_size=a.intermediate_size // world)


def all_reduce(y: torch.Tensor) -> torch.Tensor:
    """y summed over the ranks (in place)."""
    import torch.distributed as dist

    dist.all_reduce(y)
    return y


_SUMMED: dict[type, type] = {}


def summed(cls: type) -> type:
    """`cls` whose output is summed over the ranks (one all-reduce a call). A subclass, so what
    tests the module's kind still sees it, while the CPU's one-call decode layer (which checks the
    exact class) leaves it to its own forward."""
    if cls.__name__.startswith("Summed"):
        return cls
    if cls not in _SUMMED:
        # adds_residual off: each rank adding the layer's residual would put it in the sum world times
        _SUMMED[cls] = type(f"Summed{cls.__name__}", (cls,),
                            {"forward": lambda self, *a, **k: all_reduce(cls.forward(self, *a, **k)),
                             "adds_residual": False})
    return _SUMMED[cls]


def _part(n: int, rank: int, world: int) -> tuple[int, int]:
    return rank * n // world, (rank + 1) * n // world


def _shard_attention(attn, rank: int, world: int, dtype, notes) -> None:
    d = attn.head_dim
    hq, hk = _part(attn.n_head, rank, world), _part(attn.n_kv, rank, world)
    attn.q_proj = rows(attn.q_proj, hq[0] * d, hq[1] * d, dtype, notes)
    attn.k_proj = rows(attn.k_proj, hk[0] * d, hk[1] * d, dtype, notes)
    attn.v_proj = rows(attn.v_proj, hk[0] * d, hk[1] * d, dtype, notes)
    attn.o_proj = columns(attn.o_proj, hq[0] * d, hq[1] * d, rank == 0, dtype, notes)
    attn.n_head, attn.n_kv = hq[1] - hq[0], hk[1] - hk[0]


def _shard_mla(attn, rank: int, world: int, dtype, notes) -> None:
    h0, h1 = _part(attn.n_head, rank, world)
    qk, kv = attn.nope + attn.rope, attn.nope + attn.v_dim
    name = "q_proj" if "q_proj" in attn._modules else "q_b_proj"
    setattr(attn, name, rows(getattr(attn, name), h0 * qk, h1 * qk, dtype, notes))
    attn.kv_b_proj = rows(attn.kv_b_proj, h0 * kv, h1 * kv, dtype, notes)
    attn.o_proj = columns(attn.o_proj, h0 * attn.v_dim, h1 * attn.v_dim, rank == 0, dtype, notes)
    attn.n_head = h1 - h0
    attn._absorb_weights = None


def _shard_mlp(mlp, rank: int, world: int, dtype, notes) -> None:
    f0, f1 = _part(mlp.gate_proj.out_features, rank, world)
    mlp.gate_proj = rows(mlp.gate_proj, f0, f1, dtype, notes)
    mlp.up_proj = rows(mlp.up_proj, f0, f1, dtype, notes)
    mlp.down_proj = columns(mlp.down_proj, f0, f1, rank == 0, dtype, notes)


def _shard_moe(moe, rank: int, world: int, dtype, notes) -> None:
    from dsq.models.deepseek_model import RoutedExperts

    n = len(moe.experts)
    mine = [e for e in range(n) if e % world == rank]
    kept = RoutedExperts.__new__(RoutedExperts)
    nn.ModuleList.__init__(kept, [moe.experts[e] for e in mine])
    moe.experts = kept
    moe.gate = LocalRouter(moe.gate, mine, n)
    if moe.shared_experts is not None:
        _shard_mlp(moe.shared_experts, rank, world, dtype, notes)


class LocalRouter(nn.Module):
    """A router whose choices are this rank's experts (expert parallel): the whole router's
    choice, each chosen expert's id as this rank's index of it, and weight 0 for an expert held
    elsewhere (its pair runs this rank's first expert, weighed 0: every pair kernel keeps its shape)."""

    def __init__(self, router: nn.Module, mine: list[int], n_expert: int):
        super().__init__()
        self.router = router
        lookup = torch.full((n_expert,), -1, dtype=torch.long)
        lookup[mine] = torch.arange(len(mine))
        self.register_buffer("lookup", lookup)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.router(x)
        local = self.lookup[ids.long()]
        held = local >= 0
        return weights * held, local.clamp_min(0).to(ids.dtype)


def rows(m: nn.Module, start: int, stop: int, dtype, notes: list[str]) -> nn.Module:
    """Output rows start..stop of a Linear (bias included), as a module of its own."""
    if isinstance(m, GGUFLinear):
        return m.rows(start, stop)
    if type(m) is nn.Linear:
        return _linear_rows(m, start, stop)
    return _float_linear(_float_weight(m, notes)[start:stop], None if m.bias is None else m.bias[start:stop], dtype)


def columns(m: nn.Module, start: int, stop: int, bias: bool, dtype, notes: list[str]) -> nn.Module:
    """Input columns start..stop of a Linear, with its bias where `bias` (one rank adds it)."""
    b = m.bias.detach().clone() if bias and m.bias is not None else None
    if isinstance(m, GGUFLinear):
        from dsq.kernels.gguf_ref import BLOCKS

        per, nbytes = BLOCKS[m.qtype]
        if start % per == 0 and stop % per == 0:
            part = GGUFLinear(m.qtype, stop - start, m.out_features, bias=False, device="meta")
            part.raw = m.raw[:, start // per * nbytes:stop // per * nbytes].contiguous()
            if b is not None:
                part.bias = nn.Parameter(b, requires_grad=False)
            return part
        note = (f"{m.qtype} rows of {m.in_features} split into {stop - start} columns a rank, not whole "
                f"{per}-value blocks: those shards are dequantized to {str(dtype).removeprefix('torch.')}")
        if note not in notes:
            notes.append(note)
        from dsq.kernels.gguf_ref import dequantize

        return _float_linear(dequantize(m.raw, m.qtype, m.in_features)[:, start:stop], b, dtype)
    if type(m) is nn.Linear:
        return _float_linear(m.weight[:, start:stop], b, m.weight.dtype)
    return _float_linear(_float_weight(m, notes)[:, start:stop], b, dtype)


def _float_weight(m: nn.Module, notes: list[str]) -> torch.Tensor:
    note = f"{type(m).__name__} weights are dequantized to split"
    if note not in notes:
        notes.append(note)
    return m.weight_float()


def _float_linear(w: torch.Tensor, bias: torch.Tensor | None, dtype) -> nn.Linear:
    out = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    out.weight = nn.Parameter(w.to(dtype).contiguous(), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return out
