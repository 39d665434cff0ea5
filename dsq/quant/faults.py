"""Named fault points for the crash tests, a no-op unless the environment asks for one.

DSQ_FAULT=NAME kills the process (SIGKILL) at point NAME; DSQ_FAULT=enospc:NAME raises the
OSError a full disk gives there; DSQ_FAULT=fill:NAME fills the disk holding the file that
DSQ_FAULT_FILL names, so that the writes after the point really fail. Points: `calib`,
`block:I`, `finalize:STEP`, `eval` (layer methods); `gguf:imatrix`, `gguf:convert`,
`gguf:quantize`, `gguf:rename`, `gguf:cleanup`.
"""

from __future__ import annotations

import errno
import os
import signal

_ENV = "DSQ_FAULT"


def point(name: str) -> None:
    """Act out the fault DSQ_FAULT names when it names this point."""
    fault = os.environ.get(_ENV)
    if fault is None or not fault.endswith(name):
        return
    if fault == name:
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == f"enospc:{name}":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({_ENV}={fault})")
    elif fault == f"fill:{name}":
        _fill(os.environ["DSQ_FAULT_FILL"])


def _fill(path: str) -> None:
    """Write zeros to `path` until its disk has no room left."""
    with open(path, "ab", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(bytes(chunk))
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
