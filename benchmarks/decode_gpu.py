"""Batch-1 decode speed of the native runtime on a GPU, against its roofline and transformers.

    python -m benchmarks.decode_gpu --shape llama3-8b --json out.json

A random bf16 model of the given shape is built on the GPU (no download); every variant of the
native decode step and transformers' `generate` run in the same process on the same weights.
Roofline = weight bytes read per token / measured device copy bandwidth.

The quantized models (--formats) come from the same weights through dsq's own quantizers and the
runtime's packing: awq-int4 (asymmetric, g128) and gptq-int4-actorder (symmetric, g128, a random
column order shared by the Linears of one input) by round to nearest, fp8 per channel. q4_k_m is
llama.cpp's type mix (dsq.bench.random_gguf.tensor_type) of random blocks: the same bytes and
kernels as a quantized model, not its weights, so its logits are compared with its own
dequantized weights only. Every format is checked that way, per layer too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from dsq.bench.random_models import SHAPES, random_transformer


class NullTokenizer:
    """Benchmarks generate a fixed number of tokens: nothing ends them, nothing is printed."""

    bos_token = eos_token = ""
    add_bos = False

    def is_eog(self, t):
        return False

    def stream(self):
        class S:
            def push(self, t):
                return ""

            def flush(self):
                return ""

        return S()


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, counting read + write (METHOD.md)."""
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del x, y
    return 2 * (4 << 30) / min(times)


def weight_bytes_per_token(model) -> int:
    """Every Linear weight is read once per decoded token (the embedding only one row)."""
    from dsq.runtime.qmodules import PackedLinear

    seen, n = set(), 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and id(mod.weight) not in seen:
            seen.add(id(mod.weight))
            n += mod.weight.numel() * mod.weight.element_size()
        elif isinstance(mod, PackedLinear):
            n += mod.packed.nbytes()
    return n


@contextlib.contextmanager
def _dequantized(root: torch.nn.Module, dtype: torch.dtype):
    """Inside: every PackedLinear under `root` swapped for a Linear of its dequantized weight in
    `dtype` (cuBLAS on a GPU); put back on the way out, so the model leaves as it came."""
    from dsq.runtime.qmodules import PackedLinear, set_module

    packed = [(name, mod) for name, mod in root.named_modules() if isinstance(mod, PackedLinear)]
    try:
        for name, mod in packed:
            lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
            lin.weight = torch.nn.Parameter(mod.weight_float().to(mod.lo.device, dtype), requires_grad=False)
            lin.bias = mod.bias
            set_module(root, name, lin)
        yield
    finally:
        for name, mod in packed:
            set_module(root, name, mod)


def kernels_vs_dequantized(model, ids: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Relative error of `q_logits` (the model through the packed kernels) against the same model
    with every PackedLinear swapped for a Linear of its dequantized weight (in the model's
    activation dtype)."""
    with _dequantized(model, model.dtype), torch.inference_mode():
        ref = model(ids).float()
    return float((q_logits - ref).norm() / ref.norm())


def layers_vs_dequantized(model, ids: torch.Tensor) -> list[float]:
    """Per decoder layer (and the head, when it is packed): the relative error of its output through
    the packed kernels against the same layer with its PackedLinears swapped for Linears of their
    dequantized weights, both fed the same input (what the packed model gave that layer). Unlike
    the logits check this does not compound over layers: a wrong kernel shows in the layer it runs
    in. The model leaves as it came."""
    from dsq.runtime.qmodules import PackedLinear

    layers = list(model.model.layers)
    seen: list = [None] * len(layers)
    hooks = [layer.register_forward_hook(
        lambda mod, args, out, i=i: seen.__setitem__(i, ([a.clone() if torch.is_tensor(a) else a for a in args],
                                                         out.clone())))
        for i, layer in enumerate(layers)]
    head_in: list = []
    head = model.lm_head
    if isinstance(head, PackedLinear):
        hooks.append(head.register_forward_hook(lambda mod, args, out: head_in.append((args[0].clone(), out.clone()))))
    try:
        with torch.inference_mode():
            model(ids)
    finally:
        for h in hooks:
            h.remove()

    errs = []
    for i, layer in enumerate(layers):
        args, out = seen[i]
        with _dequantized(layer, model.dtype), torch.inference_mode():
            ref = layer(*args).float()
        errs.append(float((out.float() - ref).norm() / ref.norm()))
    if head_in:
        x, out = head_in[0]
        with torch.inference_mode():
            ref = torch.nn.functional.linear(x, head.weight_float().to(x.device, x.dtype), head.bias).float()
        errs.append(float((out.float() - ref).norm() / ref.norm()))
    return errs


# -- the quantized models: dsq's own quantizers and packing, or random GGUF blocks --
FORMATS = ("awq-int4", "gptq-int4-actorder", "fp8", "q4_k_m")
RANDOM_FORMATS = {"q4_k_m"}  # random blocks, no float weight behind them: checked only against themselves
_SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # Linears fed the same x


def int4_weight(w: torch.Tensor, sym: bool, perm: torch.Tensor | None = None):
    """A Packed int4 g128 weight from a float weight (N, K) by dsq's round to nearest, on w's
    device; with `perm` (act-order) the columns are quantized in that order, as GPTQ does, and
    the order is kept for the kernels. Packed as the runtime packs an AWQ/GPTQ checkpoint."""
    from dsq.kernels import intq_ref, packed
    from dsq.quant.rtn import rtn

    iq = rtn(w if perm is None else w[:, perm], 4, 128, sym)
    d = intq_ref.pack(iq.q, iq.scales.t(), iq.zeros.t(), 4, perm)
    return packed.from_int(d["qweight"], d["scales"], d["zeros"], 4, d.get("perm"))


def _int4_maker(act_order: bool):
    """(name, w) -> (Packed, source): AWQ-like (asymmetric), or GPTQ with act-order (symmetric,
    dsq's GPTQ default) in a random order shared by the Linears of one input, so they fuse."""
    orders: dict = {}

    def make(name: str, w: torch.Tensor):
        if not act_order:
            return int4_weight(w, sym=False), "int4"
        parent, leaf = name.rsplit(".", 1)
        key = (parent, _SHARED_INPUT.get(leaf, leaf))
        if key not in orders:
            orders[key] = torch.randperm(w.shape[1], device=w.device)
        return int4_weight(w, sym=True, perm=orders[key]), "int4-actorder"

    return make


def _fp8(name: str, w: torch.Tensor):
    from dsq.kernels import packed
    from dsq.quant.fp8 import fp8_quantize

    return packed.from_fp8(*fp8_quantize(w, "channel")), "fp8"


def _q4_k_m_maker(n_layers: int, seed: int = 0):
    """(name, w) -> (Packed, block type): random blocks of the type llama.cpp's Q4_K_M gives the
    tensor (random_gguf.tensor_type), in w's shape and on its device; w's values are not used."""
    import numpy as np

    from dsq.bench import random_gguf
    from dsq.kernels import packed
    from dsq.models.registry import arch_for_model_type

    names = arch_for_model_type("llama")
    rng = np.random.default_rng(seed)

    def make(name: str, w: torch.Tensor):
        qtype = random_gguf.tensor_type("Q4_K_M", names.hf_to_gguf_name(name + ".weight"), n_layers)
        N, K = w.shape
        raw = torch.from_numpy(random_gguf.random_blocks(qtype, N, K, rng)).to(w.device)
        return packed.from_gguf(raw, qtype, K), qtype

    return make


def to_format(model, fmt: str) -> None:
    """Replace the decoder Linears (and for q4_k_m the head) by PackedLinears in `fmt`, in place.
    awq-int4, gptq-int4-actorder (g128) and fp8 (per channel) quantize the model's own weights;
    q4_k_m is llama.cpp's type mix of random blocks (RANDOM_FORMATS), the same bytes and kernels
    as a quantized model but not its weights."""
    from dsq.runtime.qmodules import PackedLinear, set_module

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    make = {"awq-int4": lambda: _int4_maker(False), "gptq-int4-actorder": lambda: _int4_maker(True),
            "fp8": lambda: _fp8, "q4_k_m": lambda: _q4_k_m_maker(len(model.model.layers))}[fmt]()
    for name, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and (name != "lm_head" or fmt == "q4_k_m"):
            p, source = make(name, mod.weight.data)
            set_module(model, name, PackedLinear(p, mod.bias, source))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_native(nm, prompt: list[int], gen: int, repeat: int) -> dict:
    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    greedy = SamplingParams(temperature=0)
    runs = []
    for _ in range(repeat + 1):  # the first run warms up
        nm.reset()
        st = GenStats()
        for _ in nm.stream(prompt, greedy, gen, st, ignore_eos=True):
            pass
        runs.append(st)
    runs = runs[1:]
    return {"ttft_ms": statistics.median(r.ttft_s * 1000 for r in runs),
            "decode_tok_s": statistics.median(r.decode_tok_s for r in runs),
            "tokens": runs[0].token_ids}


def time_transformers(hf, prompt, gen: int, compile_static: bool) -> dict:
    ids = torch.tensor([prompt], device="cuda")
    kw = dict(do_sample=False, pad_token_id=0)
    if compile_static:  # transformers compiles the decode step itself when the cache is static
        hf.generation_config.cache_implementation = "static"
    for _ in range(2):
        hf.generate(ids, max_new_tokens=gen, min_new_tokens=gen, **kw)  # warm-up (and compile)
    torch.cuda.synchronize()
    t = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    torch.cuda.synchronize()
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=gen, min_new_tokens=gen, **kw)
    torch.cuda.synchronize()
    tn = time.perf_counter() - t
    return {"ttft_ms": t1 * 1000, "decode_tok_s": (gen - 1) / (tn - t1), "tokens": out[0, len(prompt):].tolist()}


def profile_step(nm, slot: int, steps: int = 5) -> None:
    """Print where the GPU time of one decode step goes (torch profiler, kernels by total time)."""
    from torch.profiler import ProfilerActivity, profile

    step = nm._step
    pad = torch.zeros(1, dtype=torch.long, device="cuda")
    tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    sl = torch.tensor([slot], device="cuda")
    with torch.inference_mode():
        for _ in range(3):
            step(tok, sl, nm.cache, pad, last_only=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step(tok, sl, nm.cache, pad, last_only=True)
            torch.cuda.synchronize()
    print(f"(totals over {steps} steps)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variants", default="eager,graph,graph+fused,compile+graph+fused")
    ap.add_argument("--transformers", default="eager", help="comma list of eager,static-compile ('' skips)")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help="quantized models to time after the bf16 variants (graph+fused, Triton kernels)")
    ap.add_argument("--quant-variants", default="graph+fused,compile+graph+fused,compile+graph+fused+fx",
                    help="how the quantized models run: graph+fused, compile+graph+fused (torch.compile around the "
                         "Triton kernels, which stay opaque operators); +fx: float x at M=1 instead of the "
                         "int8-activation GEMV")
    ap.add_argument("--profile", action="store_true",
                    help="kernel-time breakdown of a decode step (compiled bf16 variants, every quantized one)")
    ap.add_argument("--json")
    return ap


def _split(s: str) -> list[str]:
    return [v for v in s.split(",") if v]


def transformers_rows(model, shape: str, prompt: list[int], modes: list[str], gen: int) -> list[dict]:
    """transformers' model of `shape` loaded with `model`'s weights: its logits against ours (a
    "check" row), then its `generate` timed in each mode."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    s = SHAPES[shape]
    Config, Cls = (Qwen2Config, Qwen2ForCausalLM) if shape.startswith("qwen2") else (LlamaConfig, LlamaForCausalLM)
    hcfg = Config(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                  num_hidden_layers=s["num_hidden_layers"], num_attention_heads=s["num_attention_heads"],
                  num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"],
                  rms_norm_eps=s["rms_norm_eps"], max_position_embeddings=s["max_position_embeddings"],
                  rope_parameters=s["rope"], tie_word_embeddings=s.get("tie_word_embeddings", False))
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = Cls(hcfg)
    torch.set_default_dtype(torch.float32)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k or k == "lm_head.weight" for k in missing), (missing, unexpected)
    hf.tie_weights()
    hf = hf.eval()
    # correctness on the GPU: the same weights through both implementations
    x = torch.tensor([prompt[:64]], device="cuda")
    with torch.inference_mode():
        ref = hf(x).logits.float()
        ours = model(x).float()
    rel = float((ours - ref).norm() / ref.norm())
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"logits vs transformers (bf16, 64 tokens): rel err {rel:.2e}, top-1 {top1:.3f}", flush=True)
    rows = [{"name": "check", "rel_err": rel, "top1": top1}]
    for mode in modes:
        r = time_transformers(hf, prompt, gen, mode == "static-compile")
        r["name"] = f"transformers {mode}"
        rows.append(r)
        print(r["name"], f"{r['decode_tok_s']:.1f} tok/s", flush=True)
    del hf
    torch.cuda.empty_cache()
    return rows


def _compile_mode(parts: set[str]) -> str | None:
    compile_mode = {"compile": "default", "compile-max": "max-autotune-no-cudagraphs"}
    mode = next((compile_mode[p] for p in parts if p in compile_mode), None)
    if mode == "max-autotune-no-cudagraphs":
        import torch._inductor.config as ic

        ic.coordinate_descent_tuning = True
    return mode


def graph_vs_eager(model, nm, prompt: list[int]) -> float:
    """The captured step against the eager one, from the same cache state (relative error)."""
    with torch.inference_mode():
        tok = torch.tensor([prompt[-1]], device="cuda")
        slot = len(nm.cached)
        eager = model(tok[:, None], torch.tensor([slot], device="cuda"), nm.cache,
                      torch.zeros(1, dtype=torch.long, device="cuda"), kv_len=slot + 1, last_only=True)
        eager = eager[:, -1].float().clone()
        graph = nm._graph(tok[:, None], slot, torch.zeros(1, dtype=torch.long, device="cuda"))[:, -1].float()
    return float((graph - eager).norm() / eager.norm())


def bf16_rows(model, a, prompt: list[int], roofline: float) -> list[dict]:
    """Every native variant of `a.variants` on the bf16 model (fused ones after the unfused)."""
    from dsq.runtime.native import NativeModel

    rows, done_fuse = [], False
    for v in _split(a.variants):
        parts = set(v.split("+"))
        if "fused" in parts and not done_fuse:
            model.fuse_projections()
            done_fuse = True
        if "fused" not in parts and done_fuse:
            continue
        t0 = time.perf_counter()
        mode = _compile_mode(parts)
        nm = NativeModel.from_model(model, {"model_type": "llama"}, NullTokenizer(), n_ctx=_n_ctx(a), gpu_layers=-1,
                                    cuda_graph="graph" in parts, fuse=False, compile=mode)
        setup_s = time.perf_counter() - t0
        r = time_native(nm, prompt, a.gen_tokens, a.repeat)
        r.update(name=f"native {v}", setup_s=setup_s)
        rows.append(r)
        print(r["name"], f"{r['decode_tok_s']:.1f} tok/s ({r['decode_tok_s'] / roofline:.0%} of roofline),",
              f"TTFT {r['ttft_ms']:.1f} ms, setup {setup_s:.1f}s", flush=True)
        if "graph" in parts:
            r["graph_vs_eager_rel_err"] = graph_vs_eager(model, nm, prompt)
            print(f"  captured step vs eager: rel err {r['graph_vs_eager_rel_err']:.1e}", flush=True)
        if a.profile and mode is not None:
            profile_step(nm, a.prompt_tokens)
        del nm
        torch.cuda.empty_cache()
    return rows


def _n_ctx(a) -> int:
    return a.prompt_tokens + a.gen_tokens + 8


def format_rows(fmt: str, a, prompt: list[int], bw: float, bf16_logits: torch.Tensor) -> list[dict]:
    """The model of `a.shape` in `fmt`, timed in every one of `a.quant_variants`, with its logits
    and each layer checked against its own dequantized weights."""
    from dsq.kernels import dispatch, triton_common
    from dsq.runtime.native import NativeModel

    model, _ = random_transformer(a.shape)  # the same seeded weights as the bf16 runs
    to_format(model, fmt)
    model.fuse_projections()
    nbytes = weight_bytes_per_token(model)
    check_ids = torch.tensor([prompt[:64]], device="cuda")
    with torch.inference_mode():
        q_logits = model(check_ids).float()
    vs_bf16 = {} if fmt in RANDOM_FORMATS else {
        "logits_rel_err_vs_bf16": float((q_logits - bf16_logits).norm() / bf16_logits.norm())}
    rows = []
    for qv in _split(a.quant_variants):
        dispatch.ACT_Q8 = "fx" not in qv.split("+")  # fx: float x (no int8-activation GEMV)
        t0 = time.perf_counter()
        nm = NativeModel.from_model(model, {"model_type": "llama"}, NullTokenizer(), n_ctx=_n_ctx(a), gpu_layers=-1,
                                    cuda_graph=True, fuse=False,
                                    compile="default" if "compile" in qv.split("+") else False)
        setup_s = time.perf_counter() - t0
        r = time_native(nm, prompt, a.gen_tokens, a.repeat)
        if a.profile:
            profile_step(nm, a.prompt_tokens)
        r.update(name=f"native {fmt} {qv}", setup_s=setup_s, bytes_per_token=nbytes, roofline_tok_s=bw / nbytes,
                 **vs_bf16, autotuned=triton_common.autotune_choices())
        rows.append(r)
        del nm
        # quantization error compounds over 32 random layers to O(1) against bf16, so the kernels
        # are checked against their own weights: the same model with every packed weight
        # dequantized into a plain bf16 Linear (cuBLAS)
        r["logits_rel_err_vs_dequantized"] = kernels_vs_dequantized(model, check_ids, q_logits)
        r["layer_rel_err_vs_dequantized"] = layers_vs_dequantized(model, check_ids)
        _print_format_row(r, setup_s)
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    return rows


def _print_format_row(r: dict, setup_s: float) -> None:
    roof, nbytes = r["roofline_tok_s"], r["bytes_per_token"]
    vs_bf16 = f"; vs bf16 {r['logits_rel_err_vs_bf16']:.2f}" if "logits_rel_err_vs_bf16" in r else ""
    print(f"{r['name']}: {r['decode_tok_s']:.1f} tok/s = {r['decode_tok_s'] / roof:.0%} of its roofline "
          f"{roof:.0f} ({nbytes / 1e9:.2f} GB/token), TTFT {r['ttft_ms']:.1f} ms, logits vs its dequantized "
          f"weights rel err {r['logits_rel_err_vs_dequantized']:.1e} (per layer at most "
          f"{max(r['layer_rel_err_vs_dequantized']):.1e}{vs_bf16}), setup {setup_s:.1f}s", flush=True)


def print_table(a, rows: list[dict], bw: float, roof_bytes: int) -> None:
    roofline = bw / roof_bytes
    ref_tokens = next((r["tokens"] for r in rows if r.get("name", "").startswith("native eager")), None)
    print(f"\n{a.shape}, batch 1, {a.prompt_tokens}-token prompt, {a.gen_tokens} generated; "
          f"{torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s; "
          f"{roof_bytes / 1e9:.2f} GB read per token -> roofline {roofline:.0f} tok/s")
    print(f"{'variant':36} {'decode tok/s':>12} {'% roofline':>10} {'TTFT ms':>9} {'same tokens':>11}")
    for r in rows:
        if "decode_tok_s" not in r:
            continue
        same = "" if ref_tokens is None else ("yes" if r["tokens"][:32] == ref_tokens[:32] else "no")
        roof = r.get("roofline_tok_s", roofline)
        print(f"{r['name']:36} {r['decode_tok_s']:12.1f} {r['decode_tok_s'] / roof:10.0%} "
              f"{r['ttft_ms']:9.1f} {same:>11}")


def main(argv=None) -> None:
    a = _parser().parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    model, args = random_transformer(a.shape)
    roof_bytes = weight_bytes_per_token(model)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, args.vocab_size, (a.prompt_tokens,), generator=g).tolist()
    rows = []
    if a.transformers:
        rows += transformers_rows(model, a.shape, prompt, _split(a.transformers), a.gen_tokens)
    with torch.inference_mode():
        bf16_logits = model(torch.tensor([prompt[:64]], device="cuda")).float()
    rows += bf16_rows(model, a, prompt, bw / roof_bytes)
    del model
    torch.cuda.empty_cache()
    for fmt in _split(a.formats):
        rows += format_rows(fmt, a, prompt, bw, bf16_logits)
    print_table(a, rows, bw, roof_bytes)
    if a.json:
        for r in rows:
            r.pop("tokens", None)
        with open(a.json, "w") as f:
            json.dump({"shape": a.shape, "gpu": torch.cuda.get_device_name(), "copy_bw": bw,
                       "bytes_per_token": roof_bytes, "roofline_tok_s": bw / roof_bytes, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
