"""The fuzzing runs behind `python -m dsq.fuzz`: mutate valid files and feed them to dsq until
something breaks.

    python -m dsq.fuzz --iterations 1000000                       # every in-process target in turn
    python -m dsq.fuzz --iterations 20000 --target gguf --seed 7
    python -m dsq.fuzz --iterations 10000 --target cli            # run / quantize / chat in children
    python -m dsq.fuzz --iterations 2000 --target probe           # llama.cpp's loads, in children
    python -m dsq.fuzz --iterations 5000 --target serve           # HTTP requests at `dsq serve`
    python -m dsq.fuzz --iterations 200000 --target gguf --atheris   # coverage-guided (pip install atheris)
    python -m dsq.fuzz --iterations 1000000 --max-time 600        # stop starting inputs after 10 minutes

Each input is clean (loaded, or refused with dsq's own one-line error) or a finding: a crash, a
hang (past --timeout seconds with at least half of them on a CPU, so that a busy machine starving
the run is not one, or past six times --timeout) or an internal error. Findings are saved under --save
(tests/regressions/ by default) as regression files (dsq/fuzz/regression.py) that
tests/test_hostile_regressions.py replays; the last line printed is the summary (also after
--max-time, Ctrl-C or SIGTERM: it counts the inputs that finished).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IN_PROCESS = ("gguf", "safetensors", "config", "template")


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


class Tally:
    def __init__(self, label: str, save: Path, seed_root: Path):
        self.label, self.save, self.t0 = label, save, time.monotonic()
        self.deadline = float("inf")  # --max-time: no input starts after this (monotonic seconds)
        self.seed_root, self.seeds = seed_root, None
        self.counts: Counter = Counter()
        self.slowest = 0.0

    def add(self, outcome: str, seconds: float, refused: bool = False) -> None:
        self.counts[outcome] += 1
        self.counts["refused"] += refused
        self.slowest = max(self.slowest, seconds)

    def keep(self, target: str, outcome: str, files: dict[str, bytes], detail: str, command=None,
             stdin: bytes = b"") -> Path:
        """Save a finding as a regression file (dsq.fuzz.regression) under --save."""
        from dsq.fuzz import regression

        if self.seeds is None:
            self.seeds = regression.seed_files(self.seed_root)
        digest = hashlib.sha256(b"".join(files[k] for k in sorted(files))).hexdigest()[:12]
        note = {"target": target, "outcome": outcome, "detail": detail[-2000:], "command": command,
                "stdin": stdin.decode("utf-8", "replace")}
        path = regression.save(self.save / f"{target}-{outcome}-{digest}.json", note, files, self.seeds)
        print(f"[{outcome}] {path.name}: {detail.strip().splitlines()[-1][:300] if detail.strip() else ''}", flush=True)
        return path

    def out_of_time(self) -> bool:
        return time.monotonic() >= self.deadline

    def line(self) -> str:
        c = self.counts
        n = sum(c.values())
        n -= c["refused"]
        return (f"dsq.fuzz {self.label}: inputs={n} clean={c['clean']} (refused {c['refused']}) crashes={c['crash']} hangs={c['hang']} "
                f"internal_errors={c['internal']} slowest={self.slowest:.2f}s time={time.monotonic() - self.t0:.0f}s")


def run_in_process(targets: list, iterations: int, seed: int, timeout: float, tally: Tally, work: Path,
                   progress: int) -> None:
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGALRM, _alarm)
    for i in range(iterations):
        if tally.out_of_time():
            break
        target = targets[i % len(targets)]
        data = target.make(rng)
        outcome, detail, refused, seconds, _ = _one(target, data, work, timeout)
        if outcome == "clean" and seconds > timeout:  # once more, timing the CPU too (as zygote.is_hang:
            outcome, detail, refused, seconds, cpu = _one(target, data, work, timeout, cpu=True)
            if outcome == "clean" and seconds > timeout and cpu >= timeout / 2:  # a starved run is not a hang)
                outcome, detail = "hang", f"took {seconds:.1f} s ({cpu:.1f} s on a CPU)"
        tally.add(outcome, seconds, refused)
        if outcome != "clean":
            tally.keep(target.name, outcome, {f"input{target.suffix}": data}, detail)
        if progress and (i + 1) % progress == 0:
            print(tally.line(), flush=True)


def _one(target, data: bytes, work: Path, timeout: float, cpu: bool = False):
    """One input: (outcome, detail, refused, wall seconds, CPU seconds or None). The CPU clock is
    read only when asked: in some sandboxes each read costs a millisecond."""
    from dsq.errors import DsqError

    t0, cpu0 = time.monotonic(), time.process_time() if cpu else 0.0
    outcome, detail, refused = "clean", "", False
    signal.setitimer(signal.ITIMER_REAL, timeout * 6)
    try:
        target.run(data, work)
    except DsqError:
        refused = True
    except _Hang:
        outcome, detail = "hang", f"still running after {timeout * 6:g} s"
    except Exception:  # noqa: BLE001 - the finding this run looks for
        outcome, detail = "internal", traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return outcome, detail, refused, time.monotonic() - t0, time.process_time() - cpu0 if cpu else None


def run_cli(iterations: int, seed: int, timeout: float, tally: Tally, work: Path, progress: int,
            fresh: bool) -> None:
    from dsq.fuzz import cli_target

    cache = work / "cache"
    env = cli_target.cli_env(cache)
    target = cli_target.CliTarget(work / "seeds", cli_target.has_chat_template_flag(env))
    zygote = None if fresh else cli_target.Zygote(env)
    rng = random.Random(seed)
    per = Counter()
    try:
        timeout = cli_limit(target, work / "run", timeout, env, zygote)
        for i in range(iterations):
            if tally.out_of_time():
                break
            inp = target.make(rng)
            run_dir = work / "run"
            outcome, detail, result = _cli_once(inp, run_dir, timeout, env, zygote)
            if outcome == "hang":  # once more, alone: a busy machine can stall a child past the limit
                outcome, detail, result = _cli_once(inp, run_dir, timeout, env, zygote)
            tally.add(outcome, result["seconds"], outcome == "clean" and detail != "ok")
            per[inp.command] += 1
            if outcome != "clean":
                tally.keep(f"cli-{inp.command}", outcome, inp.files, detail, command=inp.argv, stdin=inp.stdin)
            if i % 200 == 0:
                shutil_rmtree(cache)
            if progress and (i + 1) % progress == 0:
                print(tally.line() + " " + " ".join(f"{k}={v}" for k, v in sorted(per.items())), flush=True)
    finally:
        if zygote:
            zygote.close()


# a clean input may take this many times what a valid seed takes through `dsq run` on this machine now
SLOWEST_CLEAN = 4


def cli_limit(target, run_dir: Path, timeout: float, env: dict, zygote) -> float:
    """The CLI's time limit: `timeout`, or more on a machine where a valid seed through `dsq run`
    (the native backend: the slowest start) already takes a large part of it (a loaded machine,
    a cold cache). A real hang outlasts any finite limit, so it is still one."""
    from dsq.fuzz import cli_target

    seed = target.gguf.seeds[0]
    inp = cli_target.CliInput("run-native", ["run", "model.gguf", "-p", "hi", "-b", "native", *cli_target.GEN],
                              {"model.gguf": seed})
    cli_target.materialize(inp, run_dir)
    result = (zygote.run(inp.argv, run_dir, 30 * timeout) if zygote
              else cli_target.spawn(inp.argv, run_dir, 30 * timeout, env))
    return max(timeout, SLOWEST_CLEAN * result["seconds"])


def _cli_once(inp, run_dir: Path, timeout: float, env: dict, zygote):
    from dsq.fuzz import cli_target

    cli_target.materialize(inp, run_dir)
    result = zygote.run(inp.argv, run_dir, timeout) if zygote else cli_target.spawn(inp.argv, run_dir, timeout, env)
    result["limit"] = timeout
    stderr = (run_dir / "stderr").read_text(errors="replace")
    return (*cli_target.classify(result, stderr), result)


def shutil_rmtree(p: Path) -> None:
    import shutil

    shutil.rmtree(p, ignore_errors=True)


def run_atheris(targets: list, iterations: int, tally: Tally, work: Path, progress: int,
                max_time: float | None = None) -> None:
    """Coverage-guided: libFuzzer (atheris) mutates the seed files, guided by dsq's branch coverage.
    libFuzzer ends the process itself after -runs, so the tally prints as the last input finishes."""
    import atheris

    from dsq.errors import DsqError

    target = targets[0]
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for k in range(16):
        (corpus / f"seed{k}").write_bytes(target.make(rng))

    def one(data: bytes) -> None:
        t0 = time.monotonic()
        outcome, detail = "clean", ""
        try:
            target.run(data, work / "scratch")
        except DsqError:
            detail = "refused"
        except Exception:  # noqa: BLE001 - the finding this run looks for
            outcome, detail = "internal", traceback.format_exc()
        tally.add(outcome, time.monotonic() - t0, detail == "refused")
        if outcome != "clean":
            tally.keep(target.name, outcome, {f"input{target.suffix}": data}, detail)
        n = sum(tally.counts[k] for k in ("clean", "crash", "hang", "internal"))
        if n >= iterations or (progress and n % progress == 0):
            print(tally.line(), flush=True)

    (work / "scratch").mkdir(parents=True, exist_ok=True)
    _instrument(atheris, ("dsq.", "jinja2.", "gguf."))
    # --max-time: libFuzzer ends the process itself, so the last --progress line is the tally
    limit = [f"-max_total_time={max(1, int(max_time))}"] if max_time else []
    atheris.Setup([sys.argv[0], f"-runs={iterations}", f"-max_len={1 << 22}", "-rss_limit_mb=8192",
                   f"-timeout={30}", *limit, str(corpus)], one)
    atheris.Fuzz()


def _instrument(atheris, prefixes: tuple[str, ...]) -> None:
    """Coverage for the readers' own code: every function and method of the loaded modules whose
    names start with `prefixes` (instrumenting all of torch would take minutes)."""
    import inspect

    for name, module in list(sys.modules.items()):
        if not name.startswith(prefixes) or module is None:
            continue
        for obj in list(vars(module).values()):
            members = vars(obj).values() if inspect.isclass(obj) else [obj]
            for f in members:
                if inspect.isfunction(f) and f.__module__ == name:
                    try:
                        atheris.instrument_func(f)
                    except Exception:  # noqa: BLE001 - some code objects cannot be instrumented
                        pass


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dsq.fuzz", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--iterations", "-n", type=int, default=10_000, help="inputs to try")
    ap.add_argument("--target", default="all", choices=("all", *IN_PROCESS, "probe", "cli", "serve"),
                    help="all: the in-process targets in turn; probe: GGUFs through the child-process "
                         "check before llama.cpp loads them; cli: through the CLI in child processes; "
                         "serve: mutated HTTP requests at `dsq serve` on a tiny model")
    ap.add_argument("--seed", type=int, default=0, help="seed of the mutator (runs are reproducible)")
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds one input may take")
    ap.add_argument("--save", type=Path, default=ROOT / "tests" / "regressions", help="where findings go")
    ap.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    ap.add_argument("--progress", type=int, default=0, help="print the tally every N inputs")
    ap.add_argument("--max-time", type=float, help="seconds after which no new input starts (then the summary)")
    ap.add_argument("--spawn", action="store_true", help="cli: a fresh interpreter per input (no fork server)")
    ap.add_argument("--atheris", action="store_true", help="coverage-guided with atheris (one in-process target)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dsq-fuzz-") as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        tally = Tally(f"target={a.target} seed={a.seed}", a.save, work / "seeds")
        if a.max_time:
            tally.deadline = tally.t0 + a.max_time
        previous = signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` (or timeout) still prints the summary
        try:
            _dispatch(a, tally, work)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
        print(tally.line(), flush=True)
        bad = tally.counts["crash"] + tally.counts["hang"] + tally.counts["internal"]
    sys.exit(1 if bad else 0)


def _dispatch(a, tally: Tally, work: Path) -> None:
    from dsq.fuzz.targets import TARGETS

    if a.target == "cli":
        return run_cli(a.iterations, a.seed, a.timeout, tally, work, a.progress, a.spawn)
    if a.target == "serve":
        from dsq.fuzz.serve_target import run_serve

        return run_serve(a.iterations, a.seed, a.timeout, tally, work, a.progress)
    names = IN_PROCESS if a.target == "all" else (a.target,)
    targets = [TARGETS[n](work / "seeds") for n in names]
    if a.atheris:
        if len(targets) != 1:
            raise SystemExit("--atheris fuzzes one --target at a time")
        return run_atheris(targets, a.iterations, tally, work, a.progress, a.max_time)
    run_in_process(targets, a.iterations, a.seed, a.timeout, tally, work / "scratch", a.progress)
