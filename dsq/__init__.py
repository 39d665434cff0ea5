"""dsq: quantize DeepSeek-family LLMs and run them locally, fast, on any mix of GPU and CPU.

The public API mirrors the CLI; every name is imported lazily so `import dsq` stays instant.
"""

from __future__ import annotations

__version__ = "0.1.0"

from dsq.runtime.threads import quiet_openmp as _quiet_openmp  # noqa: E402

_quiet_openmp()  # before anything imports torch: OpenMP read its wait policy when it loads

# torch's CUDA allocator (read when CUDA starts) grows its segments in place instead of caching
# fixed ones, unless the user configured it: with fixed segments an 8B Q4_K_M load peaked 0.3-1.4 GB
# higher on the device, at 8 layers to all (docs/benchmarks.md#split-between-gpu-and-cpu)
__import__("os").environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

_API = {
    "resolve_model": "dsq.runtime.model_ref",
    "builtin_model_path": "dsq.runtime.builtin",
    "load": "dsq.runtime.engine",
    "GpuLayers": "dsq.runtime.gpu_layers",
    "generate": "dsq.runtime.engine",
    "hf_to_gguf": "dsq.convert.hf_to_gguf",
    "gguf_to_hf": "dsq.convert.gguf_to_hf",
    "quantize": "dsq.quant",
    "QuantSpec": "dsq.quant.spec",
    "GGUFSpec": "dsq.quant.spec",
    "CalibSpec": "dsq.quant.spec",
    "quantize_gguf": "dsq.quant.gguf",
    "plan_placement": "dsq.runtime.placement",
    "run_bench": "dsq.bench.runner",
    "DsqError": "dsq.errors",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'dsq' has no attribute {name!r}")
