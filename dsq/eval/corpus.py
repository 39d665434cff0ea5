"""The built-in English text, split once: calibration for the quantizers, held out for `dsq eval`.

Python's own documentation (`pydoc_data.topics`, ~465k characters). The first 70% is calibration
text, the last 20% held-out evaluation text, so `dsq eval` never scores what a quantizer saw.
"""

from __future__ import annotations

CALIB_END = 0.7
EVAL_START = 0.8


def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def calibration_text() -> str:
    t = corpus()
    return t[: int(len(t) * CALIB_END)]


def held_out_text() -> str:
    t = corpus()
    return t[int(len(t) * EVAL_START):]
