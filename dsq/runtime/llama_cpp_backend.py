"""The llama.cpp backend (llama-cpp-python): load safely, tokenize, stream tokens with timings.

Safety: llama.cpp's CPU AMX path crashes on some machines (SIGSEGV in ggml_backend_amx_mul_mat).
When the installed build has AMX compiled in, models load with `use_extra_bufts = False`, which
keeps weights out of the AMX buffer type; install.sh builds without AMX in the first place.

Flash attention: llama-cpp-python turns it off unless asked, where llama.cpp's own tools default to
"auto" (on where the KV cache sits on a GPU that has it). Models with layers on a GPU load with it
on, as llama.cpp's users get it; DSQ_LLAMA_FLASH_ATTN=0 or 1 overrides.
"""

from __future__ import annotations

import atexit
import codecs
import ctypes
import weakref
import os
import sys
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from dsq.errors import BackendError, DsqError, MissingDependency
from dsq.runtime.generate import GenStats, TokenEvent
from dsq.runtime.gpu_layers import GpuLayers
from dsq.runtime.model_ref import ModelRef
from dsq.runtime.sampling import SamplingParams
from dsq.runtime.threads import default_threads  # noqa: F401 - also this module's name for it (quant.gguf)

if TYPE_CHECKING:
    from dsq.formats.gguf_file import GGUFFile


_LIVE: "weakref.WeakSet[LlamaCppModel]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Free llama.cpp models before interpreter teardown (their __del__ fails once llama_cpp's
    module globals are gone, printing a traceback at exit)."""
    for m in list(_LIVE):
        try:
            m.llm.close()
        except Exception:
            pass


_LOG: deque[str] = deque(maxlen=20)  # llama.cpp's recent warnings/errors, for error messages
_log_cb = None


def _install_logger(llama_cpp) -> None:
    """Route llama.cpp's log into a small buffer (printed only with DSQ_DEBUG=1)."""
    global _log_cb
    if _log_cb is not None:
        return
    debug = bool(os.environ.get("DSQ_DEBUG"))

    @llama_cpp.llama_log_callback
    def cb(level, text, user_data):
        msg = text.decode("utf-8", "replace")
        if debug:
            sys.stderr.write(msg)
        elif level in (2, 3) and msg.strip():
            _LOG.append(msg.strip())

    _log_cb = cb
    llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))


def _layout_problem(g: "GGUFFile") -> DsqError | None:
    """Why a GGUF of an architecture dsq reads does not hold the tensors its metadata implies
    (an expert count that its stacked tensors do not have, ...), or None: what llama.cpp says
    when it refuses such a file does not reach its log."""
    from dsq.convert.gguf_to_hf import gguf_plan, hf_config_from_gguf
    from dsq.models.arch import Arch
    from dsq.models.registry import find_gguf

    arch = find_gguf(g.arch)
    if not isinstance(arch, Arch):
        return None
    try:
        gguf_plan(g, arch, hf_config_from_gguf(g, arch, "float32"))
    except DsqError as e:
        return e
    except (KeyError, TypeError, ValueError):  # metadata dsq cannot read either: llama.cpp's words stand
        return None
    return None


def last_log(n: int = 3) -> str:
    return " | ".join(list(_LOG)[-n:])


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise MissingDependency(
            "llama-cpp-python is not installed",
            "run ./install.sh, or: pip install llama-cpp-python",
        ) from e
    except OSError as e:  # the shared library failed to load
        raise MissingDependency(f"llama-cpp-python is installed but its library fails to load ({e})",
                                "reinstall it with ./install.sh") from e
    _install_logger(llama_cpp)
    return llama_cpp


# std::ostream::_M_insert<long>: libstdc++ code a shared library should take from libstdc++ itself
_CXX_PROBE = "_ZNSo9_M_insertIlEERSoT_"
REBUILD_HINT = ("rebuild llama-cpp-python: CMAKE_ARGS='-DGGML_CUDA=on -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL' "
                "pip install --force-reinstall --no-cache-dir llama-cpp-python (./install.sh builds it so)")


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def defines_symbol(path: str | Path, symbol: str) -> bool:
    """Whether the shared library at `path` itself defines and exports `symbol` (not one of the
    libraries it needs): dlsym through its handle, then dladdr names the object holding it."""
    try:
        lib = ctypes.CDLL(str(path))
        addr = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
        dladdr = ctypes.CDLL(None).dladdr
    except (OSError, AttributeError):
        return False
    info = _DlInfo()
    if not addr or not dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) or not info.dli_fname:
        return False
    return os.path.realpath(info.dli_fname.decode()) == os.path.realpath(str(path))


_cxx_clash: bool | None = None


def exports_cxx_runtime(llama_cpp) -> bool:
    """Whether this llama.cpp build's CUDA library exports its own copy of libstdc++'s stream code.
    Seen on an H200 machine (llama-cpp-python 0.3.36 built against CUDA 13.0): with PyTorch
    loaded first, every model load segfaulted in llama_model::print_info (an ostream call bound
    to that copy), and torch aborted (free(): invalid pointer) after a model had loaded first.
    Linking with -Wl,--exclude-libs,ALL keeps the copy private and both then work in one process."""
    global _cxx_clash
    if _cxx_clash is None:
        cuda_lib = next(iter(sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-cuda.so*"))), None)
        _cxx_clash = cuda_lib is not None and defines_symbol(cuda_lib, _CXX_PROBE)
    return _cxx_clash


def system_info() -> str:
    return import_llama_cpp().llama_print_system_info().decode("utf-8", "replace")


def amx_compiled() -> bool:
    return "AMX" in system_info()


def supports_gpu_offload() -> bool:
    return bool(import_llama_cpp().llama_supports_gpu_offload())


@contextmanager
def _model_params(**fields):
    """Set llama_model_params fields that Llama.__init__ does not expose."""
    import llama_cpp.llama_cpp as C

    orig = C.llama_model_default_params

    def patched():
        p = orig()
        for k, v in fields.items():
            if hasattr(p, k):
                setattr(p, k, v)
        return p

    C.llama_model_default_params = patched
    try:
        yield
    finally:
        C.llama_model_default_params = orig


class _UnusedChatFormatter:
    """Stands in for llama-cpp-python's Jinja2ChatFormatter while a model loads: that class compiles
    every tokenizer.chat_template* string in the file outside any limits (a hostile template hangs or
    fails there). dsq renders templates itself, in its sandbox (runtime/template_sandbox.py)."""

    def __init__(self, *args, **kwargs):
        pass

    def to_chat_handler(self):
        def refuse(*args, **kwargs):
            raise BackendError("llama-cpp-python's chat handler is not used by dsq", "render with dsq.generate")

        return refuse


@contextmanager
def _no_chat_formatter():
    import llama_cpp.llama as L

    orig = L.llama_chat_format.Jinja2ChatFormatter
    L.llama_chat_format.Jinja2ChatFormatter = _UnusedChatFormatter
    try:
        yield
    finally:
        L.llama_chat_format.Jinja2ChatFormatter = orig


def flash_attn_for(gpu_layers: GpuLayers) -> bool:
    """Flash attention for a model with `gpu_layers` offloaded: on with a GPU build and layers on
    the GPU, unless DSQ_LLAMA_FLASH_ATTN says 0 or 1."""
    env = os.environ.get("DSQ_LLAMA_FLASH_ATTN", "").strip()
    if env in ("0", "1"):
        return env == "1"
    return gpu_layers.n_gpu_layers != 0 and supports_gpu_offload()


def _kv_types(kv_dtype: str | None) -> dict:
    """llama.cpp's KV cache types (ggml type ids) for --kv-dtype; none: its default."""
    if not kv_dtype:
        return {}
    ggml = {"f32": 0, "fp32": 0, "float32": 0, "f16": 1, "fp16": 1, "float16": 1, "bf16": 30, "bfloat16": 30}
    if kv_dtype.lower() not in ggml:
        raise DsqError(f"unknown --kv-dtype {kv_dtype!r}", "use bf16, fp16 or fp32")
    return {"type_k": ggml[kv_dtype.lower()], "type_v": ggml[kv_dtype.lower()]}


class LlamaCppModel:
    """One loaded GGUF in llama.cpp with one context (sequence)."""

    backend = "llama.cpp"

    def __init__(self, path: str | Path, *, ref: ModelRef | None = None, n_ctx: int = 4096,
                 n_threads: int | None = None, gpu_layers: GpuLayers | int | str = 0, seed: int | None = None,
                 logits_all: bool = False, f32_kv: bool = False, vocab_only: bool = False,
                 kv_dtype: str | None = None, verbose: bool = False, tensor_split: list[float] | None = None):
        """verbose: llama-cpp-python's own prints; off, it also silences this process's stdout and
        stderr while the model loads (what llama.cpp prints before an abort goes with them).
        tensor_split: each GPU's share of the GPU layers (--tensor-split), split by layers."""
        from dsq.formats.gguf_file import GGUFFile

        self.path = Path(path)
        self.ref = ref or ModelRef("gguf", self.path)
        self.gguf = GGUFFile(self.path)  # validates (truncation, magic) before llama.cpp sees it
        llama_cpp = import_llama_cpp()
        self.n_threads = n_threads or default_threads()
        self.gpu_layers = GpuLayers.parse(gpu_layers).resolve(self.path, n_ctx, backend="llama.cpp",
                                                              tensor_split=tensor_split)
        kwargs = dict(n_ctx=n_ctx, n_threads=self.n_threads, n_threads_batch=self.n_threads,
                      n_gpu_layers=self.gpu_layers.n_gpu_layers, logits_all=logits_all, verbose=verbose,
                      vocab_only=vocab_only, n_batch=min(512, n_ctx), n_ubatch=min(512, n_ctx),
                      swa_full=True)  # full-size SWA cache: chat turns can reuse the cached prefix
        if seed is not None:
            kwargs["seed"] = seed
        self.tensor_split = tensor_split
        if tensor_split is not None:
            kwargs.update(tensor_split=list(tensor_split), split_mode=llama_cpp.LLAMA_SPLIT_MODE_LAYER)
        kwargs.update(_kv_types("f32" if f32_kv else kv_dtype))
        if not vocab_only and "torch" in sys.modules and exports_cxx_runtime(llama_cpp):
            raise BackendError("this llama-cpp-python build crashes loading a model in a process that has "
                               "loaded PyTorch (its CUDA library exports its own C++ runtime)", REBUILD_HINT)
        kwargs["flash_attn"] = flash_attn_for(self.gpu_layers)
        from dsq.runtime.llama_probe import check_loads

        check_loads(self.path, {"call": "load", "load": dict(
            n_ctx=n_ctx, gpu_layers=self.gpu_layers.n_gpu_layers, logits_all=logits_all, f32_kv=f32_kv,
            vocab_only=vocab_only, kv_dtype=kv_dtype)})
        safe = {"use_extra_bufts": False} if amx_compiled() else {}
        try:
            with _model_params(**safe), _no_chat_formatter():
                self.llm = llama_cpp.Llama(model_path=str(self.path), **kwargs)
        except (ValueError, RuntimeError) as e:
            layout = _layout_problem(self.gguf)
            if layout is not None:
                raise layout from e
            detail = last_log() or str(e)
            raise BackendError(
                f"llama.cpp could not load {self.path.name} ({detail})",
                f"is {self.gguf.arch!r} an architecture this llama.cpp build supports, and the file complete?",
            ) from e
        self.n_ctx = min(self.llm.n_ctx(), n_ctx)  # llama.cpp may round up; llama-cpp-python sizes its buffers by n_ctx
        self._token_set: set[str] | None = None
        _LIVE.add(self)
        self._vocab = self.llm._model.vocab
        self._llama_cpp = llama_cpp

    # -- tokens ---------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def piece(self, token: int, special: bool = False) -> bytes:
        C = self._llama_cpp
        buf = ctypes.create_string_buffer(256)
        n = C.llama_token_to_piece(self._vocab, token, buf, 256, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        return b"".join(self.piece(t, special) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(self._llama_cpp.llama_vocab_is_eog(self._vocab, token))

    @property
    def bos_token(self) -> str:
        t = self.llm.token_bos()
        return self.piece(t, special=True).decode("utf-8", "replace") if t >= 0 else ""

    @property
    def eos_token(self) -> str:
        t = self.llm.token_eos()
        return self.piece(t, special=True).decode("utf-8", "replace") if t >= 0 else ""

    @property
    def add_bos(self) -> bool:
        return bool(self._llama_cpp.llama_vocab_get_add_bos(self._vocab))

    def chat_template(self) -> str | None:
        return self.gguf.field("tokenizer.chat_template")

    def has_token(self, text: str) -> bool:
        if self._token_set is None:
            self._token_set = set(self.gguf.field("tokenizer.ggml.tokens") or [])
        return text in self._token_set

    def longest_token_bytes(self) -> int:
        """The UTF-8 length of the vocabulary's longest token text (no token stands for more)."""
        if self._token_set is None:
            self._token_set = set(self.gguf.field("tokenizer.ggml.tokens") or [])
        return max((len(t.encode("utf-8", "surrogatepass")) for t in self._token_set), default=1)

    @property
    def arch(self) -> str:
        return self.gguf.arch

    # -- compute --------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the cached prefix: the next request prefills its whole prompt."""
        self.llm.reset()

    def logits(self, tokens: list[int]):
        """Logits for every position (needs logits_all=True). numpy (n_tokens, n_vocab)."""
        self.llm.reset()
        self.llm.eval(tokens)
        return self.llm.scores[: len(tokens)].copy()

    def stream(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
               stats: GenStats | None = None, ignore_eos: bool = False) -> Iterator[TokenEvent]:
        """Generate up to max_tokens after prompt_ids, yielding text as it becomes valid UTF-8.

        The KV cache keeps the longest common prefix with the previous call (chat turns reuse it).
        """
        stats = stats if stats is not None else GenStats()
        if len(prompt_ids) >= self.n_ctx:
            raise DsqError(f"the prompt is {len(prompt_ids)} tokens, the context holds {self.n_ctx}",
                           "pass a larger --ctx or a shorter prompt")
        llm = self.llm
        if sampling.seed is not None:
            llm.set_seed(sampling.seed)
        budget = min(max_tokens, self.n_ctx - len(prompt_ids))
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        stats.start(len(prompt_ids))
        gen = llm.generate(prompt_ids, top_k=sampling.top_k if sampling.top_k > 0 else 0,
                           top_p=sampling.top_p, min_p=sampling.min_p, temp=sampling.temperature,
                           repeat_penalty=sampling.repeat_penalty, reset=True)
        try:
            for tok in gen:
                if not stats.take(tok, not ignore_eos and self.is_eog(tok)):
                    break
                text = decoder.decode(self.piece(tok))
                if text:
                    yield TokenEvent(tok, text)
                if stats.generated_tokens >= budget:
                    break
        finally:
            gen.close()
            stats.finish()
        tail = decoder.decode(b"", final=True)
        if tail:
            yield TokenEvent(-1, tail)
