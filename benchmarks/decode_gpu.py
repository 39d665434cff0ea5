"""Batch-1 decode speed of the native runtime on a GPU, against its roofline and transformers.

    python -m benchmarks.decode_gpu --shape llama3-8b --json out.json

A random bf16 model of the given shape is built on the GPU (no download); every variant of the
native decode step and transformers' `generate` run in the same process on the same weights.
Roofline = weight bytes read per token / measured device copy bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                      max_position_embeddings=131072,
                      rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen2-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
                       max_position_embeddings=32768, rope={"rope_type": "default", "rope_theta": 1000000.0},
                       attention_bias=True, tie_word_embeddings=True),
}


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


def random_model(shape: str, dtype=torch.bfloat16):
    from dsq.models.base import ModelArgs, Transformer

    args = ModelArgs(**SHAPES[shape])
    with torch.device("meta"):
        m = Transformer(args).to(dtype)
    m = m.to_empty(device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.05 * torch.randn(p.shape, generator=g, device="cuda"))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g, device="cuda"))
    m.tie_weights()
    return m.eval(), args


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


# -- round-to-nearest into each packed format (benchmarks on random models; not dsq's quantizers) --
def _q4k(w: torch.Tensor, hi: int = 15):
    """Q4_K/Q5_K-style codes: per 32 an asymmetric scale and min, both 6-bit under fp16 per-256 ones."""
    N, K = w.shape
    x = w.float().reshape(N, K // 32, 32)
    mn = (-x.amin(-1)).clamp(min=0)
    s = (x.amax(-1) + mn) / hi
    d = (s.reshape(N, K // 256, 8).amax(-1) / 63).clamp(min=1e-8).half()
    dmin = (mn.reshape(N, K // 256, 8).amax(-1) / 63).clamp(min=1e-8).half()
    sc = (s.reshape(N, -1, 8) / d.float()[..., None]).round().clamp(0, 63).reshape(N, -1)
    m6 = (mn.reshape(N, -1, 8) / dmin.float()[..., None]).round().clamp(0, 63).reshape(N, -1)
    step = (sc.reshape(N, -1, 8) * d.float()[..., None]).reshape(N, -1, 1)
    off = (m6.reshape(N, -1, 8) * dmin.float()[..., None]).reshape(N, -1, 1)
    q = ((x + off) / step.clamp(min=1e-12)).round().clamp(0, hi).reshape(N, K)
    return q, sc.to(torch.uint8), m6.to(torch.uint8), d, dmin


def quantize_packed(w: torch.Tensor, fmt: str, perm: torch.Tensor | None = None):
    """A Packed weight in `fmt` from a float weight (N, K) by round to nearest, on w's device
    (int4-actorder: in the order `perm`, a random one if not given)."""
    from dsq.kernels import intq_ref, packed

    N, K = w.shape
    if fmt in ("int4", "int4-actorder"):
        if fmt == "int4":
            perm = None
        elif perm is None:
            perm = torch.randperm(K, device=w.device)
        x = (w[:, perm] if perm is not None else w).float().reshape(N, K // 128, 128)
        lo, hi = x.amin(-1), x.amax(-1)
        s = ((hi - lo) / 15).clamp(min=1e-8).half()
        z = (-lo / s.float()).round().clamp(0, 15)
        q = (x / s.float()[..., None] + z[..., None]).round().clamp(0, 15).reshape(N, K)
        d = intq_ref.pack(q, s, z, 4, perm)
        return packed.from_int(d["qweight"], d["scales"], d["zeros"], 4, d.get("perm"))
    if fmt == "fp8":
        s = (w.float().abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
        return packed.from_fp8((w.float() / s).to(torch.float8_e4m3fn), s)
    if fmt == "Q4_K":
        q, sc, mn, d, dmin = _q4k(w)
        return packed.Packed(packed.Fmt(sub=32, two_level=True, mins=True), N, K, lo=packed._pairs(q), sc=sc, d=d,
                             mn=mn, dmin=dmin)
    if fmt == "Q6_K":
        x = w.float().reshape(N, K // 16, 16)
        s = x.abs().amax(-1) / 31
        d = (s.reshape(N, K // 256, 16).amax(-1) / 127).clamp(min=1e-8).half()
        sc = (s.reshape(N, -1, 16) / d.float()[..., None]).round().clamp(1, 127)
        step = (sc * d.float()[..., None]).reshape(N, -1, 1)
        q = ((x / step).round() + 32).clamp(0, 63).reshape(N, K)
        return packed.Packed(packed.Fmt(hi_bits=2, sub=16, two_level=True, zero=packed.Z_CONST, offset=32), N, K,
                             lo=packed._pairs(q), hi=packed._plane(q.to(torch.int32), 2),
                             sc=sc.reshape(N, -1).to(torch.int8), d=d)
    raise ValueError(fmt)


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


def _more_bits(i: int, n: int) -> bool:  # llama.cpp's Q4_K_M rule for attn_v / ffn_down
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quantize_model(model, fmt: str) -> None:
    """Replace the decoder Linears (and for Q4_K_M the head) by PackedLinears in `fmt`, in place:
    awq/gptq int4 g128 (gptq with act-order), fp8 per channel, or Q4_K_M's type mix."""
    from dsq.runtime.qmodules import PackedLinear, set_module

    n = len(model.model.layers)
    perms: dict = {}  # act-order: one order per input (q/k/v share one, gate/up another), as GPTQ gives
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, torch.nn.Linear) or (name == "lm_head" and fmt != "q4_k_m"):
            continue
        if fmt == "q4_k_m":
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
            more = name == "lm_head" or (name.endswith(("v_proj", "down_proj")) and _more_bits(layer, n))
            f = "Q6_K" if more else "Q4_K"
        else:
            f = {"awq-int4": "int4", "gptq-int4-actorder": "int4-actorder", "fp8": "fp8"}[fmt]
        perm = None
        if f == "int4-actorder":
            parent, leaf = name.rsplit(".", 1)
            key = (parent, {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(leaf, leaf))
            if key not in perms:
                perms[key] = torch.randperm(mod.in_features, device=mod.weight.device)
            perm = perms[key]
        set_module(model, name, PackedLinear(quantize_packed(mod.weight.data, f, perm), mod.bias, f))
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variants", default="eager,graph,graph+fused,compile+graph+fused")
    ap.add_argument("--transformers", default="eager", help="comma list of eager,static-compile ('' skips)")
    ap.add_argument("--formats", default="awq-int4,gptq-int4-actorder,fp8,q4_k_m",
                    help="quantized models to time after the bf16 variants (graph+fused, Triton kernels)")
    ap.add_argument("--quant-variants", default="graph+fused,compile+graph+fused,compile+graph+fused+fx",
                    help="how the quantized models run: graph+fused, compile+graph+fused (torch.compile around the "
                         "Triton kernels, which stay opaque operators); +fx: float x at M=1 instead of the "
                         "int8-activation GEMV")
    ap.add_argument("--profile", action="store_true",
                    help="kernel-time breakdown of a decode step (compiled bf16 variants, every quantized one)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    from dsq.runtime.native import NativeModel

    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    model, args = random_model(a.shape)
    cfg = {"model_type": "llama"}
    roof_bytes = weight_bytes_per_token(model)
    roofline = bw / roof_bytes
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, args.vocab_size, (a.prompt_tokens,), generator=g).tolist()
    n_ctx = a.prompt_tokens + a.gen_tokens + 8
    rows = []

    hf = None
    if a.transformers:
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

        s = SHAPES[a.shape]
        Config, Cls = (Qwen2Config, Qwen2ForCausalLM) if a.shape.startswith("qwen2") else (LlamaConfig, LlamaForCausalLM)
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
        rows.append({"name": "check", "rel_err": rel, "top1": top1})
        for mode in [m for m in a.transformers.split(",") if m]:
            r = time_transformers(hf, prompt, a.gen_tokens, mode == "static-compile")
            r["name"] = f"transformers {mode}"
            rows.append(r)
            print(r["name"], f"{r['decode_tok_s']:.1f} tok/s", flush=True)
        del hf
        torch.cuda.empty_cache()

    check_ids = torch.tensor([prompt[:64]], device="cuda")
    with torch.inference_mode():
        bf16_logits = model(check_ids).float()
    done_fuse = False
    for v in [v for v in a.variants.split(",") if v]:
        parts = set(v.split("+"))
        if "fused" in parts and not done_fuse:
            model.fuse_projections()
            done_fuse = True
        if "fused" not in parts and done_fuse:
            continue
        t0 = time.perf_counter()
        compile_mode = {"compile": "default", "compile-max": "max-autotune-no-cudagraphs"}
        mode = next((compile_mode[p] for p in parts if p in compile_mode), None)
        if mode == "max-autotune-no-cudagraphs":
            import torch._inductor.config as ic

            ic.coordinate_descent_tuning = True
        nm = NativeModel.from_model(model, cfg, NullTokenizer(), n_ctx=n_ctx, gpu_layers=-1,
                                    cuda_graph="graph" in parts, fuse=False, compile=mode)
        setup_s = time.perf_counter() - t0
        r = time_native(nm, prompt, a.gen_tokens, a.repeat)
        r.update(name=f"native {v}", setup_s=setup_s)
        rows.append(r)
        print(r["name"], f"{r['decode_tok_s']:.1f} tok/s ({r['decode_tok_s'] / roofline:.0%} of roofline),",
              f"TTFT {r['ttft_ms']:.1f} ms, setup {setup_s:.1f}s", flush=True)
        if "graph" in parts:  # the captured step against the eager one, from the same cache state
            with torch.inference_mode():
                tok = torch.tensor([prompt[-1]], device="cuda")
                slot = len(nm.cached)
                eager = model(tok[:, None], torch.tensor([slot], device="cuda"), nm.cache,
                              torch.zeros(1, dtype=torch.long, device="cuda"), kv_len=slot + 1, last_only=True)
                eager = eager[:, -1].float().clone()
                graph = nm._graph(tok[:, None], slot, torch.zeros(1, dtype=torch.long, device="cuda"))[:, -1].float()
                r["graph_vs_eager_rel_err"] = float((graph - eager).norm() / eager.norm())
                print(f"  captured step vs eager: rel err {r['graph_vs_eager_rel_err']:.1e}", flush=True)
        if a.profile and mode is not None:
            profile_step(nm, a.prompt_tokens)
        del nm
        torch.cuda.empty_cache()

    del model
    torch.cuda.empty_cache()
    from dsq.kernels import dispatch, triton_qlinear

    for fmt in [f for f in a.formats.split(",") if f]:
        model, _ = random_model(a.shape)  # the same seeded weights as the bf16 runs
        quantize_model(model, fmt)
        model.fuse_projections()
        nbytes = weight_bytes_per_token(model)
        with torch.inference_mode():
            q_logits = model(check_ids).float()
        rel = float((q_logits - bf16_logits).norm() / bf16_logits.norm())
        for qv in [v for v in a.quant_variants.split(",") if v]:
            dispatch.ACT_Q8 = "fx" not in qv.split("+")  # fx: float x (no int8-activation GEMV)
            t0 = time.perf_counter()
            nm = NativeModel.from_model(model, cfg, NullTokenizer(), n_ctx=n_ctx, gpu_layers=-1, cuda_graph=True,
                                        fuse=False, compile="default" if "compile" in qv.split("+") else False)
            setup_s = time.perf_counter() - t0
            r = time_native(nm, prompt, a.gen_tokens, a.repeat)
            if a.profile:
                profile_step(nm, a.prompt_tokens)
            roof = bw / nbytes
            r.update(name=f"native {fmt} {qv}", setup_s=setup_s, bytes_per_token=nbytes, roofline_tok_s=roof,
                     logits_rel_err_vs_bf16=rel, autotuned=triton_qlinear.autotune_choices())
            rows.append(r)
            del nm
            # quantization error compounds over 32 random layers to O(1) against bf16, so the kernels
            # are checked against their own weights: the same model with every packed weight
            # dequantized into a plain bf16 Linear (cuBLAS)
            r["logits_rel_err_vs_dequantized"] = rel_fake = kernels_vs_dequantized(model, check_ids, q_logits)
            r["layer_rel_err_vs_dequantized"] = lay = layers_vs_dequantized(model, check_ids)
            print(f"{r['name']}: {r['decode_tok_s']:.1f} tok/s = {r['decode_tok_s'] / roof:.0%} of its roofline "
                  f"{roof:.0f} ({nbytes / 1e9:.2f} GB/token), TTFT {r['ttft_ms']:.1f} ms, logits vs its dequantized "
                  f"weights rel err {rel_fake:.1e} (per layer at most {max(lay):.1e}; vs bf16 {rel:.2f}), "
                  f"setup {setup_s:.1f}s", flush=True)
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()

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
    if a.json:
        for r in rows:
            r.pop("tokens", None)
        with open(a.json, "w") as f:
            json.dump({"shape": a.shape, "gpu": torch.cuda.get_device_name(), "copy_bw": bw,
                       "bytes_per_token": roof_bytes, "roofline_tok_s": roofline, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
