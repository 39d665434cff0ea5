"""Chat templates come from model files: render them in a sandbox with limits.

jinja2's ImmutableSandboxedEnvironment keeps a template from reaching Python internals or
mutating what it is given; the limits here keep it from taking the process down:

- `range` yields at most MAX_RANGE items per call;
- no string or list a template builds exceeds MAX_SIZE characters or items, nor an integer
  MAX_INT_BITS bits (`+ * ** % //`, `~`, str.format, every call and filter are checked, and
  integer arguments above MAX_SIZE are refused before a call runs);
- the output stops at MAX_SIZE characters;
- compiling and rendering stop after RENDER_SECONDS of wall time (a trace function checks the
  clock while template code and the Python it calls run).

Every failure, a limit or an error in the template, raises `TemplateProblem`.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

MAX_RANGE = 10_000
MAX_SIZE = 4_000_000  # a long chat's prompt is well under this many characters
MAX_SOURCE = 1_000_000  # characters of template text
MAX_INT_BITS = 4096
RENDER_SECONDS = 2.0
_CHECK_EVERY = 256  # trace events between clock reads


class TemplateProblem(Exception):
    """A template that does not compile, fails while rendering, or exceeds a limit."""


class _Deadline:
    """A trace function that raises TemplateProblem once the wall-clock budget is spent."""

    def __init__(self, seconds: float):
        self.end, self.events = time.monotonic() + seconds, 0

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise TemplateProblem(f"took longer than {RENDER_SECONDS:g} s")

    def trace(self, frame, event, arg):
        self.events += 1
        if self.events % _CHECK_EVERY == 0:
            self.check()
        return self.trace

    def __enter__(self):
        self.previous = sys.gettrace()
        sys.settrace(self.trace)
        return self

    def __exit__(self, *exc):
        sys.settrace(self.previous)


def _size(value: Any) -> int:
    if isinstance(value, (str, bytes, list, tuple, dict, set)):
        return len(value)
    return 0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _checked(value: Any) -> Any:
    if _size(value) > MAX_SIZE:
        raise TemplateProblem(f"built a value of more than {MAX_SIZE:,} characters or items")
    if _is_int(value) and value.bit_length() > MAX_INT_BITS:
        raise TemplateProblem(f"built an integer of more than {MAX_INT_BITS} bits")
    return value


def _check_args(args, kwargs) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_SIZE:
            raise TemplateProblem(f"passed {a} to a function (the limit is {MAX_SIZE:,})")


def _check_binop(op: str, left: Any, right: Any) -> None:
    if op == "*":
        n = right if _is_int(right) else left if _is_int(left) else None
        other = left if n is right else right
        if n is not None and _size(other) * max(n, 0) > MAX_SIZE:
            raise TemplateProblem(f"repeats a value {n} times (the limit is {MAX_SIZE:,} characters)")
    if _is_int(left) and _is_int(right):
        bits = (left.bit_length() * max(right, 0) if op == "**" else
                left.bit_length() + right.bit_length() if op == "*" else 0)
        if bits > MAX_INT_BITS:
            raise TemplateProblem(f"computes an integer of about {bits:,} bits (the limit is {MAX_INT_BITS})")
    elif op == "+":
        if _size(left) + _size(right) > MAX_SIZE:
            raise TemplateProblem(f"built a value of more than {MAX_SIZE:,} characters or items")
    elif op == "%" and isinstance(left, str):
        _check_format(left, right)


def _check_format(fmt: str, args: Any) -> None:
    """printf-style and str.format widths: no field wider than MAX_SIZE."""
    import re

    for digits in re.findall(r"\d+", fmt):
        if len(digits) > 7 or int(digits) > MAX_SIZE:
            raise TemplateProblem(f"formats a field {digits} wide")
    _check_args(args if isinstance(args, tuple) else (args,), {})


def _check_replace(args) -> None:
    """s.replace(old, new) / s|replace(old, new): the result's length, before it is built."""
    strs = [a for a in args[:3] if isinstance(a, str)]
    if len(strs) == 3:
        text, old, new = strs
        n = len(text) + 1 if not old else text.count(old)
        if len(text) + n * (len(new) - len(old)) > MAX_SIZE:
            raise TemplateProblem(f"replaces into a value of more than {MAX_SIZE:,} characters")


class _LimitedNamespace(Namespace):
    """namespace(): attribute assignment from a template is size-checked too."""

    def __setitem__(self, name, value):
        super().__setitem__(name, _checked(value))


class _LimitedCodeGenerator(CodeGenerator):
    def visit_Concat(self, node, frame) -> None:  # `a ~ b`: joined by the environment, size-checked
        self.write("environment.limited_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class LimitedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"+", "*", "**", "%", "//"})
    code_generator_class = _LimitedCodeGenerator

    def call_binop(self, context, operator, left, right):
        _check_binop(operator, left, right)
        return _checked(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's own signature
        _check_args(args, kwargs)
        if getattr(__obj, "__name__", None) == "replace" and isinstance(getattr(__obj, "__self__", None), str):
            _check_replace((__obj.__self__, *args))
        return _checked(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value):
        """str.format / format_map reached from a template: the format string is checked first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format(value.__self__, ())
        return wrapped

    @staticmethod
    def limited_concat(items) -> str:
        parts = [str(x) for x in items]
        if sum(len(p) for p in parts) > MAX_SIZE:
            raise TemplateProblem(f"built a value of more than {MAX_SIZE:,} characters")
        return "".join(parts)


def _limited_range(*args):
    _check_args(args, {})
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise TemplateProblem(f"asked for a range of {len(r):,} items (the limit is {MAX_RANGE:,})")
    return r


def _limited_filter(name: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        _check_args(args, kwargs)
        if name == "replace":
            _check_replace([a for a in args if isinstance(a, str)])
        return _checked(fn(*args, **kwargs))

    return run


def _raise(msg):
    raise TemplateProblem(f"raised an error: {msg}")


def _environment() -> LimitedEnvironment:
    env = LimitedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.filters = {k: _limited_filter(k, f) for k, f in env.filters.items()}
    env.globals.update(range=_limited_range, namespace=_LimitedNamespace, raise_exception=_raise,
                       strftime_now=lambda fmt: datetime.now().strftime(str(fmt)[:256]))
    return env


@lru_cache(maxsize=16)
def _compiled(source: str):
    return _environment().from_string(source)


def compile_template(source: str):
    """A compiled template, or TemplateProblem (syntax errors, oversize or slow-to-compile text)."""
    if not isinstance(source, str):
        raise TemplateProblem("is not text")
    if len(source) > MAX_SOURCE:
        raise TemplateProblem(f"is {len(source):,} characters long (the limit is {MAX_SOURCE:,})")
    try:
        with _Deadline(RENDER_SECONDS):
            return _compiled(source)
    except TemplateProblem:
        raise
    except Exception as e:  # TemplateSyntaxError, RecursionError on deep nesting, ...
        raise TemplateProblem(f"does not compile ({_describe(e)})") from None


def render(source: str, **context) -> str:
    """Render `source` with `context` inside the limits; TemplateProblem on any failure."""
    template = compile_template(source)
    out, n = [], 0
    try:
        with _Deadline(RENDER_SECONDS) as deadline:
            for piece in template.generate(**context):
                n += len(piece)
                if n > MAX_SIZE:
                    raise TemplateProblem(f"wrote more than {MAX_SIZE:,} characters")
                out.append(piece)
                deadline.check()
    except TemplateProblem:
        raise
    except Exception as e:  # whatever the template's own code raised
        raise TemplateProblem(f"failed to render ({_describe(e)})") from None
    return "".join(out)


def _describe(e: BaseException) -> str:
    text = str(e).splitlines()[0][:160] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
