"""The CLI target: mutated files through `dsq run` (both backends), `dsq quantize` and `dsq chat`
in child processes, each with a time limit. A child that dies by a signal is a crash, one past
the limit a hang, and one whose stderr holds "internal error" (or a traceback, or an exit status
other than 0 or 1, or more than one line with exit 1) an internal error.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dsq.fuzz import mutate, seeds
from dsq.fuzz.targets import ConfigTarget, GGUFTarget, SafetensorsTarget, TemplateTarget

COMMANDS = ("run-llama.cpp", "run-native", "quantize", "chat-llama.cpp", "chat-native")
GEN = ["-n", "2", "--temperature", "0", "--ctx", "128"]
PROMPT = "hi there ü漢 é\t🙂 \x01"  # characters a small vocabulary lacks: byte fallback, unknown pieces


@dataclass
class CliInput:
    command: str
    argv: list[str]
    files: dict[str, bytes]  # name in the work dir -> content ("model/..." for a directory)
    stdin: bytes = b""


def with_template(data: bytes, template: str) -> bytes:
    """A GGUF with one more key, tokenizer.chat_template = template (padded with spaces so the
    inserted bytes keep the tensor data aligned), inserted after its other keys."""
    layout = mutate.gguf_layout(data)
    end_of_keys = layout.fields[next(i for i, f in enumerate(layout.fields) if f.kind == "name_len")].pos
    key = b"tokenizer.chat_template"
    body = template.encode()
    size = 8 + len(key) + 4 + 8 + len(body)
    body += b" " * (-size % 32)
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(body)) + body
    n_kv = struct.unpack_from("<Q", data, 16)[0] + 1
    return data[:16] + struct.pack("<Q", n_kv) + data[24:end_of_keys] + kv + data[end_of_keys:]


class CliTarget:
    name = "cli"

    def __init__(self, root: Path, chat_template_flag: bool):
        self.gguf, self.st, self.cfg = GGUFTarget(root), SafetensorsTarget(root), ConfigTarget(root)
        self.tmpl = TemplateTarget(root)
        self.hf_dir = seeds.hf_seed(root)
        self.flag = chat_template_flag

    def _model(self, rng: random.Random, allow_hf: bool) -> tuple[str, dict[str, bytes]]:
        if allow_hf and rng.random() < 0.3:
            files = {f"model/{f.name}": f.read_bytes() for f in self.hf_dir.iterdir()}
            if rng.random() < 0.5:
                files["model/config.json"] = self.cfg.make(rng)
            else:
                files["model/model.safetensors"] = self.st.make(rng)
            return "model", files
        return "model.gguf", {"model.gguf": self.gguf.make(rng)}

    def make(self, rng: random.Random) -> CliInput:
        command = rng.choice(COMMANDS)
        backend = command.split("-", 1)[1] if "-" in command else None
        if command.startswith("chat"):
            return self._chat(rng, backend)
        model, files = self._model(rng, allow_hf=backend != "llama.cpp")
        if command == "quantize":
            return CliInput(command, ["quantize", model, "--type", "Q8_0", "--out", "out.gguf", "--force"], files)
        return CliInput(command, ["run", model, "-p", PROMPT, "-b", backend, *GEN], files)

    def _chat(self, rng: random.Random, backend: str) -> CliInput:
        """A mutated template: through --chat-template where the CLI has it, else inside the GGUF."""
        template = self.tmpl.make(rng).decode()
        seed = rng.choice(self.gguf.seeds)
        if self.flag and rng.random() < 0.5:
            files = {"model.gguf": seed, "template.jinja": template.encode()}
            argv = ["chat", "model.gguf", "--chat-template", "template.jinja"]
        else:
            files = {"model.gguf": with_template(seed, template)}
            argv = ["chat", "model.gguf"]
        argv += ["-b", backend, *GEN]
        return CliInput(f"chat-{backend}", argv, files, stdin=(PROMPT + "\n/exit\n").encode())


def materialize(inp: CliInput, work: Path) -> None:
    if work.exists():
        shutil.rmtree(work)
    (work / "model").mkdir(parents=True)
    for name, data in inp.files.items():
        (work / name).write_bytes(data)
    (work / "stdin").write_bytes(inp.stdin)


def classify(result: dict, stderr: str) -> tuple[str, str]:
    """(outcome, detail): outcome is clean, crash, hang or internal."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    if result["timed_out"]:
        return "hang", f"past {result.get('limit', 5)} s"
    if result["signal"] is not None:
        return "crash", f"signal {result['signal']}: {' | '.join(lines[-3:])}"
    code = result["code"]
    if "internal error" in stderr or "Traceback" in stderr:
        return "internal", " | ".join(lines[-3:])
    if code == 0:
        return "clean", "ok"
    errors = [ln for ln in lines if ln.startswith("error: ")]
    if code == 1 and len(errors) == 1:
        return "clean", errors[0]
    return "internal", f"exit {code}: {' | '.join(lines[-3:])}"


class Zygote:
    """The fork server (dsq.fuzz.zygote) as a child of this process."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "dsq.fuzz.zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True)

    def run(self, argv: list[str], work: Path, timeout: float) -> dict:
        req = {"argv": argv, "cwd": str(work), "stdin": str(work / "stdin"), "stdout": str(work / "stdout"),
               "stderr": str(work / "stderr"), "timeout": timeout}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fork server ended")
        return json.loads(line)

    def close(self, grace: float = 60.0) -> None:
        """End the server: it exits on the end of its input; one still there after `grace` seconds
        (a machine too busy to let it finish) is killed. No input is running then: not a finding."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def spawn(argv: list[str], work: Path, timeout: float, env: dict) -> dict:
    """One fresh interpreter: python -m dsq ARGS, timed out as the fork server does (zygote.is_hang)."""
    import time

    from dsq.fuzz.zygote import is_hang

    t0 = time.monotonic()
    with open(work / "stdin", "rb") as i, open(work / "stdout", "wb") as o, open(work / "stderr", "wb") as e:
        p = subprocess.Popen([sys.executable, "-m", "dsq", *argv], stdin=i, stdout=o, stderr=e, cwd=work, env=env)
        while p.poll() is None:
            if is_hang(p.pid, time.monotonic() - t0, timeout):
                p.kill()
                p.wait()
                return {"code": None, "signal": None, "timed_out": True, "seconds": round(time.monotonic() - t0, 3)}
            time.sleep(0.02)
    sig = -p.returncode if p.returncode < 0 else None
    return {"code": None if sig else p.returncode, "signal": sig, "timed_out": False,
            "seconds": round(time.monotonic() - t0, 3)}


def cli_env(cache: Path) -> dict:
    env = dict(os.environ, DSQ_QUIET="1", DSQ_CACHE=str(cache), GGML_NO_BACKTRACE="1")  # no gdb on an abort
    env.pop("DSQ_DEBUG", None)
    return env


def has_chat_template_flag(env: dict) -> bool:
    r = subprocess.run([sys.executable, "-m", "dsq", "chat", "--help"], capture_output=True, text=True, env=env)
    return "--chat-template" in r.stdout
