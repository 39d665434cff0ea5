"""Disk space for a quantization: the check before any work, and a full disk met mid-run told
as one line (how much more is needed, what was kept for a rerun)."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from dsq.errors import DiskFull

# what a full disk looks like from the writers dsq uses: OSError (Python), SafetensorError
# (safetensors' Rust writer), numpy's tofile (a short write), llama.cpp's log
_FULL_DISK = re.compile(r"No space left on device|Not enough free space|StorageFull|Disk quota exceeded"
                        r"|\d+ requested and \d+ written")
MARGIN = 1 << 20  # headers, json files, filesystem blocks


def human(n: int) -> str:
    n = max(int(n), 0)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def is_disk_full(e: BaseException | str) -> bool:
    if isinstance(e, DiskFull):
        return True
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return _FULL_DISK.search(str(e)) is not None


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or would, once its folders exist)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def disk_bytes(path: Path) -> int:
    """Bytes of the files under `path`, each file counted once however many links it has."""
    if not path.exists():
        return 0
    seen: dict[tuple[int, int], int] = {}
    for f in [path] if path.is_file() else path.rglob("*"):
        if f.is_file() and not f.is_symlink():
            st = f.stat()
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def check_free(out: Path, need: int) -> None:
    """Refuse, before any work, a run that needs more than the free space beside `out`."""
    need += MARGIN
    free = free_bytes(out.parent)
    if need > free:
        raise DiskFull(f"not enough disk space for {out}: it needs about {human(need)}, {human(free)} free",
                       "free up space or choose an --out on a disk with room")


def full_disk_error(out: Path, need: int, kept: str | None) -> DiskFull:
    """The error for a disk that filled up mid-run; `kept` says what stays for a rerun (None:
    the partial files were removed)."""
    what = kept or "removed the partial files, which a rerun could not use"
    return DiskFull(f"the disk filled up writing {out}: it needs about {human(need + MARGIN)} more "
                    f"({human(free_bytes(out.parent))} free); {what}",
                    "free up space and rerun the same command" + (" to resume" if kept else ""))


def remove(path: Path) -> None:
    """Remove a file or a folder tree, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        os.unlink(path)


def remove_record_last(folder: Path) -> None:
    """Remove a work folder, its state.json last: a run stopped halfway through still finds the
    record that says the folder only has to go."""
    if folder.is_dir():
        for f in folder.iterdir():
            if f.name != "state.json":
                remove(f)
    remove(folder)
