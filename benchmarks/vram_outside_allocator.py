"""Where a process's VRAM outside torch's allocator goes (GPU only): the device's used bytes (above
the CUDA context), torch's reserved and allocated bytes and the context's stack-size limit after
each step: torch's first touch, a first cuBLAS GEMM, loading the model at a split, a prefill, a
decode, emptying torch's cache, and resetting the stack limit (which frees local memory a spilling
kernel grew).

    python -m benchmarks.vram_outside_allocator MODEL.gguf [--gpu-layers 0] [--threads 16]
"""

from __future__ import annotations

import argparse
import ctypes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--gpu-layers", default="0")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()

    import torch

    from dsq.bench.metrics import cuda_context_bytes, gpu_used_bytes

    cuda = ctypes.CDLL("libcuda.so.1")
    stack_limit = 0  # CU_LIMIT_STACK_SIZE

    def stack() -> int | str:
        v = ctypes.c_size_t()
        r = cuda.cuCtxGetLimit(ctypes.byref(v), stack_limit)
        return v.value if r == 0 else f"error {r}"

    mib = lambda b: round(b / 2**20)  # noqa: E731
    context = cuda_context_bytes()
    base = gpu_used_bytes()

    def show(step: str) -> None:
        torch.cuda.synchronize()
        print(f"{step:28s} device {mib(gpu_used_bytes() - base):6d}  reserved {mib(torch.cuda.memory_reserved()):6d}  "
              f"allocated {mib(torch.cuda.memory_allocated()):6d}  stack {stack()}", flush=True)

    print("context MiB", mib(context or 0))
    show("start")
    torch.zeros(1, device="cuda")
    show("torch init")
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (x @ w).sum().item()
    del x, w
    show("cublas matmul")

    from dsq.bench.runner import _generate, bench_prompts
    from dsq.runtime.engine import load
    from dsq.runtime.sampling import SamplingParams

    nm = load(a.model, backend="native", ctx=128, threads=a.threads, gpu_layers=a.gpu_layers)
    show(f"load g={a.gpu_layers}")
    prompts = bench_prompts(nm, 64, 1)
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    nm.reset()
    _generate(nm, prompts, greedy, 1)
    show("prefill + 1 token")
    nm.reset()
    _generate(nm, prompts, greedy, 16)
    show("prefill + 16 tokens")
    torch.cuda.empty_cache()
    show("empty_cache")
    print("stack limit reset to 1024:", cuda.cuCtxSetLimit(stack_limit, ctypes.c_size_t(1024)))
    show("stack reset")


if __name__ == "__main__":
    main()
