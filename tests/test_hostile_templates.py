"""Chat templates from model files render in a sandbox with limits: a template that does not
compile, fails, or exceeds a limit falls back to the architecture's template with one warning
line, on both backends and in `dsq run --chat` and `dsq chat`; it never hangs or crashes."""

from __future__ import annotations

import time

import pytest

from dsq.errors import DsqError
from dsq.runtime.chat_template import ChatTemplate, pick_template
from dsq.runtime.template_sandbox import MAX_RANGE, RENDER_SECONDS, TemplateProblem, render
from hostile import dsq, seed_gguf, template_gguf

MESSAGES = [{"role": "user", "content": "hi"}]
NESTED = "{% for a in range(99999) %}{% for b in range(99999) %}x{% endfor %}{% endfor %}"
# name -> (template, what the warning says)
HOSTILE = {
    "nested-loops": (NESTED, "range"),
    "slow-loops": ("{% for a in range(9999) %}{% for b in range(9999) %}{% endfor %}{% endfor %}", "longer than"),
    "syntax-error": ("{% for m in messages %}{{ m['content'] }", "does not compile"),
    "string-bomb": ("{{ 'a' * 1000000000 }}", "repeats"),
    "doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 "characters"),
    "wide-format": ("{{ '%999999999d' % 1 }}", "wide"),
    "wide-str-format": ("{{ '{:>999999999}'.format(1) }}", "wide"),
    "wide-filter": ("{{ 'x'|center(999999999) }}", "999999999"),
    "integer-bomb": ("{{ 10 ** 100000 }}", "integer"),
    "replace-bomb": ("{% set s = 'a' * 4000 %}{{ s.replace('', s) }}", "replaces"),
    "recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    "python-internals": ("{{ ''.__class__.__mro__ }}", "unsafe"),
    "mutation": ("{% set x = [] %}{{ x.append(1) }}", "unsafe"),
    "undefined": ("{{ messages[9]['content'] }}", "UndefinedError"),
    "division-by-zero": ("{{ 1 // 0 }}", "ZeroDivisionError"),
    "include": ("{% include 'other.jinja' %}", "failed"),
    "deep-nesting": ("{{" + "(" * 3000 + "1" + ")" * 3000 + "}}", "does not compile"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_fallback_with_one_warning(case):
    source, needle = HOSTILE[case]
    warnings = []
    t = pick_template(source, "qwen2", lambda tok: False, "", "", warn=warnings.append)
    t0 = time.perf_counter()
    out = t.render(MESSAGES)
    assert time.perf_counter() - t0 < RENDER_SECONDS + 1.5
    assert "<|im_start|>user\nhi<|im_end|>" in out and t.origin == "fallback:qwen2"
    assert len(warnings) == 1 and "\n" not in warnings[0] and needle in warnings[0], warnings
    t.render(MESSAGES + [{"role": "assistant", "content": "x"}])
    assert len(warnings) == 1  # the fallback stays, without another warning


def test_a_good_template_renders_untouched():
    t = pick_template("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}", "qwen2",
                      lambda tok: False, "", "")
    assert t.render(MESSAGES) == "[user] hi" and t.origin == "model"


def test_limits_allow_what_real_templates_do():
    long = "word " * 100_000  # a long pasted document: well under the output limit
    out = render("{% for m in messages %}{{ m['content'] }}{% endfor %}{% for i in range(n) %}.{% endfor %}",
                 messages=[{"role": "user", "content": long}], n=MAX_RANGE)
    assert len(out) == len(long) + MAX_RANGE


def test_without_a_fallback_a_failure_is_a_user_error():
    with pytest.raises(DsqError, match="does not compile"):
        ChatTemplate("{% for %}", "model").render(MESSAGES)


def test_the_time_limit_stops_a_render():
    t0 = time.perf_counter()
    with pytest.raises(TemplateProblem, match="longer than"):
        render("{% for a in range(9999) %}{% for b in range(9999) %}{% endfor %}{% endfor %}", messages=MESSAGES)
    assert time.perf_counter() - t0 < RENDER_SECONDS + 1


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> bytes:
    return seed_gguf(tmp_path_factory.mktemp("seeds"))


COMMANDS = {
    "chat-llama.cpp": (["chat", "t.gguf", "-n", "2", "--ctx", "256"], "hi\n/exit\n"),
    "chat-native": (["chat", "t.gguf", "-n", "2", "--ctx", "256", "-b", "native"], "hi\n/exit\n"),
    "run-chat-llama.cpp": (["run", "t.gguf", "--chat", "-p", "hi", "-n", "2", "--ctx", "256"], ""),
    "run-chat-native": (["run", "t.gguf", "--chat", "-p", "hi", "-n", "2", "--ctx", "256", "-b", "native"], ""),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("case", ["nested-loops", "syntax-error", "string-bomb"])
def test_cli_falls_back_with_one_warning(case, command, seed, tmp_path):
    """The template inside the GGUF (tokenizer.chat_template), as models ship it."""
    source, needle = HOSTILE[case]
    (tmp_path / "t.gguf").write_bytes(template_gguf(seed, source))
    args, stdin = COMMANDS[command]
    t0 = time.perf_counter()
    p = dsq(args, tmp_path, stdin=stdin, timeout=60)
    assert time.perf_counter() - t0 < 30
    assert p.returncode == 0, p.stderr[-2000:]
    warnings = [ln for ln in p.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and needle in warnings[0], p.stderr
    assert not [ln for ln in p.stderr.splitlines() if ln.startswith("error:") or "internal error" in ln], p.stderr


@pytest.mark.parametrize("backend", ["llama.cpp", "native"])
def test_cli_chat_template_file(backend, seed, tmp_path):
    """dsq chat --chat-template FILE: a hostile file falls back the same way."""
    (tmp_path / "m.gguf").write_bytes(seed)
    (tmp_path / "t.jinja").write_text(NESTED)
    p = dsq(["chat", "m.gguf", "--chat-template", "t.jinja", "-n", "2", "--ctx", "256", "-b", backend], tmp_path,
            stdin="hi\n/exit\n", timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert len([ln for ln in p.stderr.splitlines() if ln.startswith("warning:")]) == 1, p.stderr


def test_cli_chat_template_file_is_used_and_checked(seed, tmp_path):
    """A good --chat-template file replaces the model's template; a missing or empty one is one
    line and exit 1, before the model loads."""
    (tmp_path / "m.gguf").write_bytes(seed)
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    args = ["chat", "m.gguf", "-n", "2", "--ctx", "256", "-b", "native", "--chat-template"]
    p = dsq(args + ["t.jinja"], tmp_path, stdin="hi\n/exit\n", timeout=60)
    assert p.returncode == 0 and "template: file" in p.stderr, p.stderr[-2000:]
    assert not [ln for ln in p.stderr.splitlines() if ln.startswith(("warning:", "error:"))], p.stderr
    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "adir").mkdir()
    (tmp_path / "bin.jinja").write_bytes(b"\xff\xfe{{ x }}")
    (tmp_path / "blank.jinja").write_text(" \n")
    for name, needle in (("nope.jinja", "does not exist"), ("empty.json", "holds no chat_template"),
                         ("adir", "is not a file"), ("bin.jinja", "not UTF-8"),
                         ("blank.jinja", "is empty")):
        p = dsq(args + [name], tmp_path, stdin="hi\n/exit\n", timeout=60)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], p.stderr
