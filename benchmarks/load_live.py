"""What a GGUF load keeps alive as it goes, on the CPU: the model loaded in the GPU's layout (packed
weights, each MoE layer's experts stacked as on a GPU), and after each layer's conversion and
each stack the bytes of every tensor still reachable (through the garbage collector; the file's
own mapped blocks not counted). A load that frees what it replaces grows to the final model's
size; one that holds replaced weights climbs past it. No GPU needed; on one,
`benchmarks/load_vram.py` measures the allocator's peak instead.

    python -m benchmarks.load_live MODEL.gguf
"""

from __future__ import annotations

import argparse
import gc
import os


def _file_ranges(path: str) -> list[tuple[int, int]]:
    """The address ranges where the process maps `path` (its blocks are read in place)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(path):
                a, b = line.split()[0].split("-")
                out.append((int(a, 16), int(b, 16)))
    return out


def live_mib(path: str) -> tuple[float, int]:
    """(MiB, storages) of the CPU tensors reachable now, less those in `path`'s mapping."""
    import torch

    ranges, seen = _file_ranges(path), {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu" and not o.is_meta:
            st = o.untyped_storage()
            p = st.data_ptr()
            if p and not any(a <= p < b for a, b in ranges):
                seen[p] = st.nbytes()
    return sum(seen.values()) / 2**20, len(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    a = ap.parse_args()
    path = os.path.realpath(a.model)

    from dsq.kernels import dispatch
    from dsq.runtime import experts, native_loader, qmodules
    from dsq.runtime.native import NativeModel

    dispatch.use_triton = lambda device: True  # the GPU's packed layout, on CPU tensors
    native_loader.STACK_ON = ("cuda", "cpu")  # experts stacked as on a GPU
    convert, stack = qmodules.prepare_kernels, experts.stack_experts
    step = [0]

    def report(what: str) -> None:
        mib, n = live_mib(path)
        print(f"{what:<28} {mib:9.1f} MiB live in {n} tensors", flush=True)

    def converting(module):
        convert(module)
        report(f"layer {step[0]} converted" if hasattr(module, "mlp") else "head and embedding converted")

    def stacking(layer, on=("cuda",)):
        done = stack(layer, on)
        if done:
            report(f"layer {step[0]} stacked")
        step[0] += 1
        return done

    native_loader.prepare_kernels, experts.stack_experts = converting, stacking
    model = NativeModel(path, "gguf", n_ctx=64, dtype="bf16", cuda_graph=False)
    gc.collect()
    report("loaded")
    del model


if __name__ == "__main__":
    main()
