"""A CPU decoder layer's decode step in one C call (kernels/csrc/layer_cpu.inc dsq_layer_decode).

The eager decode step of a CPU layer otherwise makes ~20 calls (norms, GEMVs, the attention step,
residual adds, the activation) with torch's small ops and Python between them: ~0.3 ms a layer
on the H200 host (docs/benchmarks.md "Split between GPU and CPU"). `attach(model)` builds, once at
load, a descriptor per covered layer (pointers to the GGUF blocks, norm weights, shapes, eps,
window) and a `FusedDecode` that `Transformer.forward_layers` hands each decode step to: one C
call per covered layer, nothing in between. The same kernels run inside (dsq_gguf_gemm,
dsq_rms_norm, dsq_attn_step), so the hidden state equals the op-by-op path's up to the last bit
of the activation (C's expf / tanhf against torch's vectorized ones).

Coverage (`uncovered`, the one predicate): a plain `DecoderLayer` (llama, qwen2, gemma3 and
anything built from them) on the CPU in float32, with every projection a `GGUFLinear` of a type the
C kernels read (q/k/v fused, q/k fused + v, or separate; gate/up fused or separate; biases
allowed), rope over the whole head (HF's rotate-half), SiLU or GELU-tanh, no attention logit
softcap, equal q/k norm eps; sliding-window layers included (their window and local rope). Per
step: one new token per row (T = 1), a plain `KVCache` in float32 on the CPU, inference mode,
eager (not under torch.compile), the C kernels not turned off (DSQ_KERNELS=reference). Anything
else (DeepSeek's MLA and MoE layers, AWQ/GPTQ/FP8 or float weights, prefill) runs op by op.
DSQ_FUSED_LAYER=0 turns it off.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref

import torch

from dsq.kernels import cpu, dispatch
from dsq.models.base import MLP, Attention, DecoderLayer, KVCache
from dsq.runtime.qmodules import GGUFLinear


def uncovered(model, i: int) -> str | None:
    """Why layer i of `model` cannot decode through dsq_layer_decode, or None when it can."""
    a = model.args
    layer = model.model.layers[i]
    if model.placement is not None and model.placement.layers[i] != torch.device("cpu"):
        return "placed on a GPU"
    if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention or type(layer.mlp) is not MLP:
        return "not a plain decoder layer"
    if (a.rotary_dim and a.rotary_dim != a.head_dim) or a.head_dim % 2:
        return "rope over part of the head"
    if a.attn_logit_softcapping:
        return "attention logit softcap"
    if a.hidden_act not in cpu.ACTS:
        return f"activation {a.hidden_act}"
    attn, mlp = layer.self_attn, layer.mlp
    if attn.qk_norm and attn.q_norm.eps != attn.k_norm.eps:
        return "q and k norms with different eps"
    for name, m in [*_qkv(attn), ("o_proj", attn.o_proj), *_gate_up(mlp), ("down_proj", mlp.down_proj)]:
        if type(m) is not GGUFLinear or m.qtype not in cpu.GGML_TYPES:
            what = f"{type(m).__name__}{f' {m.qtype}' if hasattr(m, 'qtype') else ''}"
            return f"{name} is {what}, not GGUF blocks the C kernels read"
        if not m.raw.is_cpu or not m.raw.is_contiguous():
            return f"{name} is not contiguous on the CPU"
        if m.bias is not None and (m.bias.dtype != torch.float32 or not m.bias.is_cpu or not m.bias.is_contiguous()):
            return f"{name}'s bias is not float32 on the CPU"
    for n in _norms(layer):
        if n.weight.dtype != torch.float32 or not n.weight.is_cpu:
            return "norms not in float32 on the CPU"
    return None


def _qkv(attn) -> list[tuple[str, torch.nn.Module]]:
    names = [n for n in (("qkv_proj",), ("qk_proj", "v_proj"), ("q_proj", "k_proj", "v_proj"))
             if all(x in attn._modules for x in n)][0]
    return [(n, attn._modules[n]) for n in names]


def _gate_up(mlp) -> list[tuple[str, torch.nn.Module]]:
    names = ("gate_up_proj",) if "gate_up_proj" in mlp._modules else ("gate_proj", "up_proj")
    return [(n, mlp._modules[n]) for n in names]


def _norms(layer) -> list:
    ns = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.sandwich:
        ns += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    if layer.self_attn.qk_norm:
        ns += [layer.self_attn.q_norm, layer.self_attn.k_norm]
    return ns


class FusedLayer:
    """Layer i's descriptor (cpu.LayerDesc) and the tensors its pointers point into."""

    def __init__(self, model, i: int):
        a, layer = model.args, model.model.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        keep = []

        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach().contiguous()
            keep.append(t)
            return t.data_ptr()

        def proj(m) -> cpu.Proj:
            return cpu.Proj(ptr(m.raw), cpu.GGML_TYPES[m.qtype], m.out_features, m.in_features, ptr(m.bias))

        def weight(norm) -> int:  # what the op-by-op path multiplies by (Gemma: 1 + w)
            with torch.no_grad():
                return ptr(norm.scale_weight())

        qkv, gu = [m for _, m in _qkv(attn)], [m for _, m in _gate_up(mlp)]
        d = cpu.LayerDesc(hidden=a.hidden_size, n_head=attn.n_head, n_kv=attn.n_kv, head_dim=attn.head_dim,
                          ffn=mlp.down_proj.in_features, window=a.sliding_window if a.is_sliding(i) else 0,
                          act=cpu.ACTS[a.hidden_act], sandwich=int(layer.sandwich), n_qkv=len(qkv), n_gu=len(gu),
                          eps=layer.input_layernorm.eps, qk_eps=attn.q_norm.eps if attn.qk_norm else 0.0,
                          scale=attn.scale)
        d.attn_norm = weight(layer.input_layernorm)
        if layer.sandwich:
            d.attn_out_norm = weight(layer.post_attention_layernorm)
            d.ffn_norm = weight(layer.pre_feedforward_layernorm)
            d.ffn_out_norm = weight(layer.post_feedforward_layernorm)
        else:
            d.ffn_norm = weight(layer.post_attention_layernorm)
        if attn.qk_norm:
            d.q_norm, d.k_norm = weight(attn.q_norm), weight(attn.k_norm)
        for j, m in enumerate(qkv):
            d.qkv[j] = proj(m)
        d.o = proj(attn.o_proj)
        for j, m in enumerate(gu):
            d.gu[j] = proj(m)
        d.down = proj(mlp.down_proj)
        self.desc, self.keep, self.addr = d, keep, ctypes.addressof(d)
        self.rope = "local" if a.is_sliding(i) and a.rope_local else "full"
        self.head_dim = attn.head_dim


class FusedDecode:
    """The covered layers of one model (`layers[i]`: a FusedLayer or None) and the scratch their
    calls share (one per OS thread, grown to the largest batch and cache seen, never per token)."""

    def __init__(self, model, layers: list[FusedLayer | None]):
        self.args, self.layers = model.args, layers
        self.lib = cpu.library()[0]
        self._local, self._need = threading.local(), {}
        self._caches = weakref.WeakKeyDictionary()  # cache -> per-layer (k ptr, v ptr, strides) or None

    def begin(self, x: torch.Tensor, slots: torch.Tensor, cache, pad: torch.Tensor | None,
              kv_len: int | None) -> "_Step | None":
        """A decode step's context for x (B, 1, hidden), or None when the step is not one this covers."""
        if (type(cache) is not KVCache or x.shape[1] != 1 or slots.numel() != 1 or torch.is_grad_enabled()
                or not dispatch._cpu_kernels() or cache.batch != x.shape[0]):
            return None
        B, L = x.shape[0], cache.length
        key = (B, L)
        if key not in self._need:
            self._need[key] = max(cpu.layer_scratch(f.desc, B, L, self.lib) for f in self.layers if f is not None)
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.numel() < self._need[key]:
            scratch = self._local.scratch = torch.empty(self._need[key])
        pad = torch.zeros(B, dtype=torch.int64) if pad is None else pad.to("cpu", torch.int64).contiguous()
        slot = int(slots[0])
        S = kv_len if kv_len is not None else L
        if not 0 <= slot < S <= L:
            return None
        return _Step(self, cache, B, slot, pad, S, scratch)

    def cache_ptrs(self, cache) -> list:
        got = self._caches.get(cache)
        if got is None:
            got = [self._ptrs(cache, i, f) if f is not None else None for i, f in enumerate(self.layers)]
            self._caches[cache] = got
        return got

    @staticmethod
    def _ptrs(cache, i: int, f: FusedLayer):
        kc, vc = cache.k[i], cache.v[i]
        D = f.head_dim
        if (kc.dtype != torch.float32 or not kc.is_cpu or kc.stride(-1) != 1 or kc.stride(-2) != D
                or vc.stride() != kc.stride() or vc.dtype != torch.float32 or not vc.is_cpu):
            return None
        cos, sin = cache.rope_on(f.rope, torch.device("cpu"))
        return (kc.data_ptr(), vc.data_ptr(), kc.stride(0), kc.stride(1), cos.data_ptr(), sin.data_ptr(),
                cos.shape[0])


class _Step:
    """One decode step's calls: `run(i, x)` runs layer i on x in one C call, or returns None for a
    layer it does not cover (the caller then runs it op by op)."""

    def __init__(self, fd: FusedDecode, cache, B: int, slot: int, pad: torch.Tensor, S: int, scratch: torch.Tensor):
        self.fd, self.B, self.slot, self.pad, self.S, self.scratch = fd, B, slot, pad, S, scratch
        self.ptrs = fd.cache_ptrs(cache)
        self.fn = fd.lib.dsq_layer_decode
        self.threads = torch.get_num_threads()
        self.x = None  # the hidden state this step owns (updated in place by each call)

    def run(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        f, p = self.fd.layers[i], self.ptrs[i]
        if f is None or p is None:
            return None
        if x is not self.x:  # the caller's tensor stays as it was: work on a copy
            self.x = x.to("cpu", torch.float32, copy=True).contiguous()
        s = self.scratch
        if self.fn(f.addr, self.x.data_ptr(), self.B, p[0], p[1], p[2], p[3], self.slot, self.pad.data_ptr(), self.S,
                   p[4], p[5], p[6], s.data_ptr(), s.numel(), self.threads):
            raise ValueError(f"dsq_layer_decode refused layer {i} at slot {self.slot} (out of memory?)")
        return self.x


def enabled() -> bool:
    """The one-call layer is built and not turned off (DSQ_FUSED_LAYER=0)."""
    return os.environ.get("DSQ_FUSED_LAYER", "1") != "0" and cpu.has("dsq_layer_decode")


def covers_all(model) -> bool:
    """Whether attach would give every layer of `model` the one-call decode."""
    return enabled() and all(uncovered(model, i) is None for i in range(len(model.model.layers)))


def attach(model) -> int:
    """Give `model` the one-call decode of each covered CPU layer (model._fused_decode); returns
    how many layers are covered (0: none, nothing attached). Call it once the layers' tensors are
    final: the descriptors point into them (and keep them alive), so a tensor replaced afterwards
    (pinned, moved) would be read from its old copy."""
    model._fused_decode = None
    if not enabled():
        return 0
    layers = [FusedLayer(model, i) if uncovered(model, i) is None else None for i in range(len(model.model.layers))]
    n = sum(f is not None for f in layers)
    if n:
        model._fused_decode = FusedDecode(model, layers)
    return n
