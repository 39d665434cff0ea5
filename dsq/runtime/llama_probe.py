"""A GGUF goes to llama.cpp in this process only after a child process survived the same calls.

llama.cpp ends the whole process on some damaged files (GGML_ASSERT aborts, an uncaught
std::bad_alloc, a segfault) where dsq's own checks (formats/gguf_check.py) passed them: checking
every field llama.cpp reads is a race a file can always win. So before a load here,

    python -m dsq.runtime.llama_probe REQUEST

loads the file the same way (LlamaCppModel with the same arguments, vocabulary only where that is
what the caller loads) and uses its vocabulary as dsq does (tokenize, pieces, end-of-generation
flags); for the quantizer it runs llama_model_quantize as a dry run (the same loader and type
choices, nothing written). A child that dies by a signal becomes one BackendError naming the file
and the last line llama.cpp printed; a child that ends otherwise (loaded, or refused with an error)
lets the load go ahead, where the same refusal then happens in-process with dsq's message.

The verdict is kept in dsq's cache (probed/), keyed by the file's resolved path, size and mtime,
what was probed and the llama.cpp version, so a file is probed once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from dsq.errors import BackendError

CACHE = "probed"
# signals that a file makes llama.cpp raise (its verdict is kept); any other (an interrupt, the OOM
# killer) says nothing about the file
CRASHES = {signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTRAP}
# text with what a vocabulary must handle: byte fallback, pieces a small vocabulary lacks, specials
SAMPLE = "Hello world ü漢 é\t🙂 \x01 <s></s><|im_start|><start_of_turn>\n"
PIECES = 512  # vocabulary entries turned into pieces (the first ones: specials and bytes live there)


def _llama_cpp_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama_cpp_python")
    except PackageNotFoundError:
        return "unknown"


def _verdict_path(path: Path, what: dict) -> tuple[Path, dict]:
    real = path.resolve()
    st = real.stat()
    key = {"path": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "what": what,
           "llama_cpp": os.environ.get("LLAMA_CPP_LIB_PATH") or _llama_cpp_version()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    from dsq.runtime.builtin import cache_dir

    return cache_dir() / CACHE / f"{digest}.json", key


def _read_verdict(vpath: Path, key: dict) -> dict | None:
    try:
        v = json.loads(vpath.read_text())
    except (OSError, ValueError):
        return None
    return v if isinstance(v, dict) and v.get("key") == key and isinstance(v.get("ok"), bool) else None


def _write_verdict(vpath: Path, key: dict, ok: bool, detail: str) -> None:
    from dsq.formats.hf import atomic_output_file

    try:
        with atomic_output_file(vpath, force=True) as tmp:
            tmp.write_text(json.dumps({"key": key, "ok": ok, "detail": detail}) + "\n")
    except OSError:  # a read-only cache: the next run probes again
        pass


def _crash_error(path: Path, detail: str) -> BackendError:
    return BackendError(f"llama.cpp crashed on {path.name} ({detail}); dsq did not load it",
                        "the file is damaged or made for another llama.cpp version: re-download or re-convert it")


def last_line(stderr: str) -> str:
    """The last line a crashed child printed that says something (the assertion, the exception),
    a source path shortened to its file name."""
    lines = [re.sub(r"^\S*/(?=[^/\s]+:\d+: )", "", ln.strip()) for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "GGML_ASSERT" in ln or "what():" in ln or "terminate called" in ln or "error" in ln.lower():
            return ln[-300:]
    return lines[-1][-300:] if lines else ""


def check_loads(path: str | Path, what: dict) -> None:
    """Raise BackendError if llama.cpp dies on `path` doing `what` (see _child) in a child process."""
    path = Path(path)
    if os.environ.get("DSQ_LLAMA_PROBE") == "0":
        return
    vpath, key = _verdict_path(path, what)
    v = _read_verdict(vpath, key)
    if v is None:
        req = json.dumps({"path": str(path), "what": what})
        env = dict(os.environ, GGML_NO_BACKTRACE="1", DSQ_LLAMA_PROBE="0")  # no gdb attach on an abort
        env.pop("DSQ_DEBUG", None)
        p = subprocess.run([sys.executable, "-m", "dsq.runtime.llama_probe", req], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        stderr = p.stderr.decode("utf-8", "replace")
        if p.returncode < 0:
            sig = signal.Signals(-p.returncode)
            detail = "; ".join(x for x in (last_line(stderr), f"killed by {sig.name}") if x)
            if sig not in CRASHES:
                if sig == signal.SIGINT:
                    raise KeyboardInterrupt
                raise BackendError(f"checking {path.name} with llama.cpp ended by {sig.name}",
                                   "is the machine short of memory? run it again")
            v = {"ok": False, "detail": detail}
        else:
            v = {"ok": True, "detail": f"exit {p.returncode}"}
        _write_verdict(vpath, key, v["ok"], v["detail"])
    if not v["ok"]:
        raise _crash_error(path, v["detail"])


def _exercise(m) -> None:
    """Use the vocabulary as dsq does: encode with and without specials, pieces, flags."""
    for add_bos, special in ((True, True), (False, False)):
        ids = m.tokenize(SAMPLE, add_bos=add_bos, special=special)
        m.detokenize(ids, special=special)
        for t in ids:
            m.is_eog(t)
    m.bos_token, m.eos_token, m.add_bos  # noqa: B018 - each reads the vocabulary
    n = m.llm.n_vocab()
    for t in [*range(min(n, PIECES)), n - 1]:
        m.piece(t, special=True)
        m.piece(t)


def _child(req: dict) -> None:
    what = req["what"]
    if what["call"] == "quantize":
        import tempfile

        from dsq.formats.gguf_types import FTYPES
        from dsq.runtime.llama_cpp_backend import import_llama_cpp

        llama_cpp = import_llama_cpp()
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[what["qtype"]]
        params.dry_run = True
        with tempfile.TemporaryDirectory() as d:
            llama_cpp.llama_model_quantize(req["path"].encode(), os.path.join(d, "out.gguf").encode(), params)
        return
    from dsq.runtime.llama_cpp_backend import LlamaCppModel

    _exercise(LlamaCppModel(req["path"], **what["load"], verbose=True))  # stderr open while it loads


if __name__ == "__main__":
    try:
        _child(json.loads(sys.argv[1]))
    except Exception as e:  # noqa: BLE001 - a refusal, not a crash: the in-process load says it properly
        sys.stderr.write(f"{type(e).__name__}: {e}\n")
        sys.exit(1)
