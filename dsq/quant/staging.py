"""Where a layer-by-layer run keeps its work until the artifact is complete: OUT.partial.

    OUT.partial/
      state.json                the record: settings key, phase, finished blocks, activations file
      hidden-NNNNN.safetensors  the calibration activations entering block NNNNN
      blocks/block-NNNNN.safetensors   each finished block
      rest/                     the tensors outside the blocks (embeddings, final norm, head)
      stage/                    the artifact being assembled: shards hard-linked to blocks/ and
                                rest/ (copied where links fail), index, config, tokenizer files,
                                dsq_quant.json, model card
      replaced/                 with --force, the old OUT, moved aside just before stage/ takes its place

Phases: "blocks" (`done` blocks finished) -> "staged" (stage/ complete, not evaluated) ->
"ready" (evaluated, card written) -> published (stage/ renamed to OUT in one os.replace, then
OUT.partial removed). The record is rewritten only after the files it describes are complete, so
whatever instant a run dies the next one trusts only finished work: what does not check out is
rebuilt from the blocks, or the run starts clean.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from dsq.errors import OutputExists
from dsq.quant import faults
from dsq.quant.space import disk_bytes, human, remove, remove_record_last

SAVE_EVERY_S = 30.0  # large activation sets (GBs for an 8B model) are saved at most this often
SMALL_BYTES = 256 << 20
STAGE_FILES = ("model.safetensors.index.json", "config.json", "dsq_quant.json", "README.md")


class Run:
    """The state of one run into `out`, read from OUT.partial (nothing is written until `begin`).
    `calibrated`: each unfinished block needs the activations entering it."""

    def __init__(self, out: Path, key: str, n_blocks: int, calibrated: bool):
        self.out, self.key, self.n, self.calibrated = out, key, n_blocks, calibrated
        self.dir = out.with_name(out.name + ".partial")
        self.stage = self.dir / "stage"
        self.copies = False  # the stage holds copies, not links, of the shards
        self.clock = time.perf_counter()
        self.last_save = self.clock
        self.state = self._load()

    # -- reading the record ---------------------------------------------------------------------
    def block_file(self, i: int) -> Path:
        return self.dir / "blocks" / f"block-{i:05d}.safetensors"

    @property
    def phase(self) -> str:
        return self.state["phase"] if self.state else "blocks"

    @property
    def done(self) -> int:
        return self.state["done"] if self.state else 0

    def _load(self) -> dict | None:
        """The record, if it is for these settings and the files it describes check out."""
        try:
            st = json.loads((self.dir / "state.json").read_text())
            return self._checked(st) if st.get("key") == self.key else None
        except Exception:  # missing, damaged or from another layout: start clean
            return None

    def _checked(self, st: dict) -> dict | None:
        if st["phase"] in ("staged", "ready") and (self._stage_complete() or self._published(st)):
            return st
        if st["phase"] != "blocks":  # the stage is damaged: assemble it again from the blocks
            st.update(phase="blocks", done=self.n, hidden=None)
        if not all(_readable(self.block_file(i)) for i in range(st["done"])):
            return None
        if st["done"] < self.n and self.calibrated and not (st["hidden"] and _readable(self.dir / st["hidden"])):
            return None
        return st

    def _stage_complete(self) -> bool:
        try:
            index = json.loads((self.stage / STAGE_FILES[0]).read_text())
            shards = set(index["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return all((self.stage / f).is_file() for f in (*STAGE_FILES, *shards))

    def _published(self, st: dict) -> bool:
        return st["phase"] == "ready" and not self.stage.exists() and self.out.exists()

    def published(self) -> bool:
        """The last run renamed its stage into place and was stopped before removing OUT.partial."""
        return self.state is not None and self._published(self.state)

    def bytes(self) -> int:
        return disk_bytes(self.dir)

    # -- writing ----------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start clean, or keep the finished work and drop the rest."""
        if self.state is None:
            remove(self.dir)
            self.state = {"key": self.key, "phase": "blocks", "done": 0, "hidden": None, "seconds": 0.0,
                          "calibration_tokens": 0, "eval_tokens": None}
        self._sweep()
        (self.dir / "blocks").mkdir(parents=True, exist_ok=True)
        self.record()

    def _sweep(self) -> None:
        """Remove temp files, and in the blocks phase what comes after the recorded work."""
        for f in self.dir.rglob("*.tmp") if self.dir.exists() else []:
            remove(f)
        if self.phase != "blocks":
            return
        remove(self.stage)
        remove(self.dir / "rest")
        remove(self.dir / "replaced")
        for i in range(self.done, self.n):
            remove(self.block_file(i))
        for f in self.dir.glob("hidden-*.safetensors"):
            if f.name != self.state["hidden"]:
                remove(f)

    def record(self, **changes) -> None:
        self.state.update(changes)
        write_atomic(self.dir / "state.json", json.dumps(self.state))

    def load_hidden(self):
        from safetensors.torch import load_file

        return load_file(str(self.dir / self.state["hidden"]))["hidden"]

    def save_block(self, i: int, hidden, calibration_tokens: int) -> None:
        """Record block i as finished, with `hidden` the activations entering block i + 1 (None
        when nothing needs them). Large activation sets are written at most every SAVE_EVERY_S:
        a resumed run then redoes a few blocks."""
        now = time.perf_counter()
        if hidden is not None and hidden.numel() * hidden.element_size() > SMALL_BYTES \
                and now - self.last_save < SAVE_EVERY_S:
            return
        name = None
        if hidden is not None:
            from safetensors.torch import save_file

            name = f"hidden-{i + 1:05d}.safetensors"
            save_file({"hidden": hidden.contiguous().cpu()}, str(self.dir / (name + ".tmp")))
            os.replace(self.dir / (name + ".tmp"), self.dir / name)
        self.last_save = now
        self.record(done=i + 1, hidden=name, calibration_tokens=calibration_tokens,
                    seconds=round(self.state["seconds"] + now - self.clock, 1))
        self.clock = now
        for f in self.dir.glob("hidden-*.safetensors"):
            if f.name != name:
                remove(f)

    def tidy(self) -> str | None:
        """After a failure: drop what a rerun cannot use. Says what is kept (None: nothing, and
        OUT.partial is gone)."""
        if self.state is None or (self.phase == "blocks" and self.done == 0):
            remove(self.dir)
            return None
        self._sweep()
        done = f"{self.done} of {self.n} blocks" if self.phase == "blocks" else "every block"
        return f"kept {self.dir.name} ({human(self.bytes())}, {done} done) to resume from"

    def publish(self, force: bool) -> dict:
        """stage/ becomes OUT in one rename (an old OUT moved aside first); then OUT.partial goes.
        Returns the artifact's dsq_quant.json."""
        faults.point("finalize:rename")
        if self.out.exists() or self.out.is_symlink():
            if not force:
                raise OutputExists(f"{self.out} already exists", "pass --force")
            remove(self.dir / "replaced")
            os.replace(self.out, self.dir / "replaced")
        os.replace(self.stage, self.out)
        faults.point("finalize:cleanup")
        return self.close()

    def close(self) -> dict:
        remove_record_last(self.dir)
        try:
            return json.loads((self.out / "dsq_quant.json").read_text())
        except (OSError, ValueError):
            return {}


def _readable(f: Path) -> bool:
    """A complete safetensors file (its header parses and covers the whole file)."""
    from safetensors import safe_open

    try:
        with safe_open(f, framework="pt"):
            return True
    except Exception:
        return False


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def place_shards(run: Run, files: list[Path]) -> tuple[dict[str, str], int]:
    """Hard-link each finished file into stage/ under its shard name (copy where links fail).
    Returns (the index's weight map, the shards' total size)."""
    from safetensors import safe_open

    weight_map, size = {}, 0
    for k, f in enumerate(files):
        final = run.stage / f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        _link_or_copy(run, f, final)
        if k == 0:
            faults.point("finalize:link")
        with safe_open(f, framework="pt") as st:
            weight_map.update({name: final.name for name in st.keys()})
        size += f.stat().st_size
    return weight_map, size


def _link_or_copy(run: Run, src: Path, dst: Path) -> None:
    if not run.copies:
        try:
            os.link(src, dst)
            return
        except OSError:
            run.copies = True
    shutil.copyfile(src, dst)
