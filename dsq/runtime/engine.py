"""The public entry points: `load` a model on a backend, `generate` text, build chat prompts.

    import dsq
    m = dsq.load()                      # built-in model, llama.cpp backend
    r = dsq.generate(m, "The history of", max_tokens=32, temperature=0)
    print(r.text, r.stats.decode_tok_s)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsq.errors import DsqError
from dsq.runtime.chat_template import ChatTemplate, pick_template
from dsq.runtime.generate import GenStats, StopMatcher
from dsq.runtime.sampling import SamplingParams

BACKENDS = ("native", "llama.cpp")


def parse_gpu_layers(value: str | int | None) -> int | str:
    """'all' -> -1, 'auto' -> 'auto', 'N' -> N (llama.cpp's --gpu-layers semantics)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    v = str(value).strip().lower()
    if v == "all":
        return -1
    if v == "auto":
        return "auto"
    try:
        n = int(v)
    except ValueError:
        raise DsqError(f"--gpu-layers takes a number, 'all' or 'auto', got {value!r}") from None
    if n < 0:
        raise DsqError(f"--gpu-layers must be >= 0, got {n}", "use 'all' for every layer")
    return n


def resolve_gpu_layers(gpu_layers: int | str, gguf_path: Path, ctx: int) -> int:
    """Turn 'auto' into a layer count from the placement plan and the GPU's free memory."""
    if gpu_layers != "auto":
        return int(gpu_layers)
    from dsq.runtime.llama_cpp_backend import supports_gpu_offload
    from dsq.runtime.placement import detect_gpu, plan_placement

    gpu = detect_gpu()
    if gpu is None or not supports_gpu_offload():
        return 0
    return plan_placement(gguf_path, vram=gpu.free_bytes, ctx=ctx).gpu_layers


def load(model: str | Path | None = None, *, backend: str = "llama.cpp", ctx: int = 4096,
         threads: int | None = None, gpu_layers: int | str = 0, seed: int | None = None,
         console=None, **kwargs):
    """Load MODEL (a .gguf, an HF directory, or None for the built-in model) on a backend.

    backend "llama.cpp" runs GGUF (HF directories are converted once, cached); "native" runs
    both formats in dsq's own torch engine (kwargs: dtype, kv_dtype, cuda_graph).
    """
    from dsq.runtime.model_ref import ensure_gguf, resolve_model

    if backend not in BACKENDS:
        raise DsqError(f"unknown backend {backend!r}", f"choose one of: {', '.join(BACKENDS)}")
    if ctx < 16:
        raise DsqError(f"--ctx must be at least 16, got {ctx}")
    ref = resolve_model(model, console)
    if backend == "native":
        from dsq.runtime.native import NativeModel

        ngl = parse_gpu_layers(gpu_layers)
        if ngl == "auto":
            ngl = resolve_gpu_layers("auto", ref.path, ctx) if ref.kind == "gguf" else -1
        m = NativeModel(ref.path, ref.kind, n_ctx=ctx, gpu_layers=ngl, threads=threads, seed=seed, **kwargs)
    else:
        from dsq.runtime.llama_cpp_backend import LlamaCppModel

        path = ensure_gguf(ref, console)
        ngl = resolve_gpu_layers(parse_gpu_layers(gpu_layers), path, ctx)
        m = LlamaCppModel(path, n_ctx=ctx, n_threads=threads, gpu_layers=ngl, seed=seed, **kwargs)
    m.ref = ref
    return m


def chat_template_for(model) -> ChatTemplate:
    return pick_template(model.chat_template(), model.arch, model.has_token, model.bos_token, model.eos_token)


def encode_prompt(model, text: str, templated: bool = False) -> list[int]:
    """Token ids for a prompt. A rendered template already holds BOS, so none is added."""
    bos = model.bos_token
    add_bos = model.add_bos and not (templated and bos and text.startswith(bos))
    return model.tokenize(text, add_bos=add_bos, special=templated)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenStats
    prompt: str

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt": self.prompt, **self.stats.as_dict()}


def generate(model, prompt: str, *, max_tokens: int = 256, temperature: float = 0.8, top_k: int = 40,
             top_p: float = 0.95, min_p: float = 0.0, repeat_penalty: float = 1.0,
             seed: int | None = None, stop: tuple[str, ...] | list[str] = (), chat: bool = False,
             system: str | None = None, ignore_eos: bool = False,
             on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """Generate a continuation of `prompt` (or a chat reply to it, with chat=True)."""
    if max_tokens < 1:
        raise DsqError(f"--max-tokens must be >= 1, got {max_tokens}")
    sp = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, seed).validate()
    text_in = prompt
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}]
        text_in = chat_template_for(model).render(messages)
    ids = encode_prompt(model, text_in, templated=chat)
    stats = GenStats()
    stopper = StopMatcher(stop)
    parts: list[str] = []
    events = model.stream(ids, sp, max_tokens, stats, ignore_eos=ignore_eos)
    try:
        for ev in events:
            out, stopped = stopper.feed(ev.text)
            if out:
                parts.append(out)
                if on_text:
                    on_text(out)
            if stopped:
                stats.finish_reason = "stop"
                break
    finally:
        events.close()
    rest = stopper.flush() if stats.finish_reason != "stop" else ""
    if rest:
        parts.append(rest)
        if on_text:
            on_text(rest)
    return GenerationResult("".join(parts), list(stats.token_ids), stats, prompt)
