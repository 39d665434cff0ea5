"""The public entry points: `load` a model on a backend, `generate` text, build chat prompts.

    import dsq
    m = dsq.load()                      # built-in model, llama.cpp backend (auto)
    r = dsq.generate(m, "The history of", max_tokens=32, temperature=0)
    print(r.text, r.stats.decode_tok_s)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsq.errors import DsqError
from dsq.runtime.backend import Backend
from dsq.runtime.chat_template import ChatTemplate, pick_template
from dsq.runtime.generate import GenStats, StopMatcher
from dsq.runtime.gpu_layers import GpuLayers, parse_for
from dsq.runtime.model_ref import ModelRef
from dsq.runtime.sampling import SamplingParams

BACKENDS = ("native", "llama.cpp")
AUTO = "auto"  # llama.cpp, or native for weights only it runs (pick_backend)


def native_only_format(ref: ModelRef) -> str | None:
    """The weight format of an HF directory that llama.cpp cannot take (AWQ, GPTQ, FP8, ... as its
    quantization_config names it), or None."""
    if ref.kind != "hf":
        return None
    from dsq.formats.hf import HFModelDir

    qc = HFModelDir(ref.path).config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return str(method or "quantized").upper()


def pick_backend(ref: ModelRef, backend: str | None = AUTO) -> str:
    """The backend that runs `ref`: as asked, or for "auto" (or None) llama.cpp, unless the
    weights are in a format only the native backend runs."""
    fmt = native_only_format(ref)
    if backend in (None, AUTO):
        return "native" if fmt else "llama.cpp"
    if backend not in BACKENDS:
        raise DsqError(f"unknown backend {backend!r}", f"choose one of: {', '.join(BACKENDS)} (or {AUTO})")
    if backend == "llama.cpp" and fmt:
        raise DsqError(f"llama.cpp cannot run {ref.path.name}: its weights are {fmt}, which llama.cpp does not "
                       "read", "pass --backend native (or leave --backend out to pick it)")
    return backend


def load(model: str | Path | ModelRef | None = None, *, backend: str = AUTO, ctx: int = 4096,
         threads: int | None = None, gpu_layers: GpuLayers | int | str = 0, seed: int | None = None,
         console=None, **kwargs) -> Backend:
    """Load MODEL (a .gguf, an HF directory, a resolved ModelRef, or None for the built-in model)
    on a backend.

    backend "llama.cpp" runs GGUF (HF directories are converted once, cached); "native" runs
    both formats in dsq's own torch engine (kwargs: dtype, kv_dtype, cuda_graph); "auto" is
    llama.cpp, or native for AWQ / GPTQ / FP8 directories (pick_backend).
    gpu_layers: a number, "all" or "auto" (GpuLayers.parse). threads: CPU threads (default:
    runtime/threads.py default_threads, the physical cores). experts="cpu"|"gpu"|"auto": where a
    MoE model's routed experts run (runtime/experts.py; cpu is the native backend's).
    """
    from dsq.runtime.model_ref import ensure_gguf, resolve_model
    from dsq.runtime.threads import default_threads

    threads = threads or default_threads()  # one default for both backends
    if ctx < 16:
        raise DsqError(f"--ctx must be at least 16, got {ctx}")
    ref = model if isinstance(model, ModelRef) else resolve_model(model, console)
    backend = pick_backend(ref, backend)
    ngl = parse_for(gpu_layers, ref.path, ctx, backend)
    if "experts" in kwargs:  # MoE models: where the routed experts run (runtime/experts.py)
        from dsq.runtime.experts import check_backend, parse_experts

        kwargs["experts"] = check_backend(parse_experts(kwargs["experts"]), backend)
        if backend != "native":
            kwargs.pop("experts")
    if backend == "native":
        from dsq.runtime.native import NativeModel

        return NativeModel(ref.path, ref.kind, ref=ref, n_ctx=ctx, gpu_layers=ngl, threads=threads, seed=seed,
                           **kwargs)
    from dsq.runtime.llama_cpp_backend import LlamaCppModel

    return LlamaCppModel(ensure_gguf(ref, console), ref=ref, n_ctx=ctx, n_threads=threads, gpu_layers=ngl,
                         seed=seed, **kwargs)


def chat_template_for(model: Backend, source: str | None = None) -> ChatTemplate:
    """The model's chat template, or `source` (a user's --chat-template text) in its place; either
    falls back to the architecture's template when it fails."""
    if source is not None:
        return pick_template(source, model.arch, model.has_token, model.bos_token, model.eos_token, origin="file")
    return pick_template(model.chat_template(), model.arch, model.has_token, model.bos_token, model.eos_token)


def encode_prompt(model: Backend, text: str, templated: bool = False) -> list[int]:
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


def generate(model: Backend, prompt: str, *, max_tokens: int = 256, temperature: float = 0.8, top_k: int = 40,
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
