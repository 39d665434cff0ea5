"""A fork server for CLI fuzzing: imports dsq's heavy dependencies once, then runs each request
as a forked child that executes `python -m dsq ARGS` (dsq/__main__.py through runpy) with its own
stdin, stdout and stderr files, and reports how the child ended.

    python -m dsq.fuzz.zygote      # reads one JSON request per line on stdin, answers one per line

Request: {"argv": [...], "cwd": dir, "stdin": file, "stdout": file, "stderr": file, "timeout": s}.
Answer: {"code": exit status or null, "signal": number or null, "timed_out": bool, "seconds": s}.
A child past its timeout that spent at least half of it on a CPU (not one a busy machine starved),
or any child past six times the timeout, is killed (SIGKILL) and reported as timed out. Children start in milliseconds where a fresh
interpreter takes 0.3 s (llama.cpp) to 2.5 s (torch); `python -m dsq.fuzz --spawn` runs fresh
interpreters instead.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def preload() -> None:
    """The third-party libraries every dsq command imports, loaded before any fork (no threads are
    started by it). dsq's own modules load in each child, so edits to them are always seen."""
    import jinja2.sandbox  # noqa: F401
    import llama_cpp  # noqa: F401
    import numpy  # noqa: F401
    import rich.console  # noqa: F401
    import safetensors  # noqa: F401
    import tokenizers  # noqa: F401
    import torch
    import typer  # noqa: F401

    with torch.device("meta"):  # torch imports its meta-tensor machinery on first use (~3 s)
        torch.nn.Embedding(4, 4)
    if os.environ.get("DSQ_FUZZ_PRELOAD_DSQ") == "1":  # a long run: dsq's own modules too (edits then
        import dsq.cli  # noqa: F401                      # need a restart of the run)
        import dsq.quant  # noqa: F401
        import dsq.runtime.conversation  # noqa: F401
        import dsq.runtime.llama_cpp_backend  # noqa: F401
        import dsq.runtime.native  # noqa: F401


def _child(req: dict) -> None:
    import runpy

    code = 1
    try:
        os.chdir(req["cwd"])
        for fd, name, mode in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                               (2, "stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            f = os.open(req[name], mode, 0o644)
            os.dup2(f, fd)
            os.close(f)
        sys.argv = ["dsq", *req["argv"]]
        runpy.run_module("dsq", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - what escapes the CLI's own boundary is reported as exit 70
        import traceback

        traceback.print_exc()
        code = 70
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a running process has used so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def is_hang(pid: int, elapsed: float, timeout: float) -> bool:
    """Past `timeout` seconds while it had at least half of them on a CPU (it was running, not
    starved by a busy machine), or stuck past 6 x `timeout` whatever it did."""
    return elapsed > 6 * timeout or (elapsed > timeout and cpu_seconds(pid) >= timeout / 2)


def _wait(pid: int, timeout: float) -> dict:
    t0 = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        elapsed = time.monotonic() - t0
        if done:
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
            return {"code": code, "signal": sig, "timed_out": False, "seconds": round(elapsed, 3)}
        if is_hang(pid, elapsed, timeout):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"code": None, "signal": None, "timed_out": True, "seconds": round(elapsed, 3)}
        time.sleep(0.005 if elapsed < 1 else 0.05)


def main() -> None:
    preload()
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        sys.stdout.write(json.dumps(_wait(pid, float(req["timeout"]))) + "\n")
        sys.stdout.flush()
    os._exit(0)  # the preloaded libraries' teardown takes seconds on a busy machine and checks nothing


if __name__ == "__main__":
    main()
