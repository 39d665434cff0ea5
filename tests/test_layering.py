"""dsq's imports point one way: a package imports only itself and the packages below it.

    cli, fuzz, serve -> bench -> quant -> eval -> runtime -> convert -> models -> kernels -> formats -> errors, ui

Read from the source with ast (every import, including those inside functions), so a lazy import
that points up fails here as a top-level one would. `dsq/__init__.py` is the lazy public API and
names modules from every layer; `dsq/__main__.py` runs the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORDER = [("cli", "fuzz", "serve"), "bench", "quant", "eval", "runtime", "convert", "models", "kernels", "formats", ("errors", "ui")]
LEVEL = {name: len(ORDER) - i for i, entry in enumerate(ORDER)
         for name in (entry if isinstance(entry, tuple) else (entry,))}
EXEMPT = {"dsq/__init__.py", "dsq/__main__.py"}


def _sources() -> dict[str, Path]:
    """'dsq.<package>.<module>' -> file, kernels/ included as dsq.kernels."""
    files = {}
    for f in (ROOT / "dsq").rglob("*.py"):
        rel = f.relative_to(ROOT).as_posix()
        if rel not in EXEMPT:
            files[".".join(f.relative_to(ROOT).with_suffix("").parts)] = f
    for f in (ROOT / "kernels").rglob("*.py"):
        files["dsq.kernels." + ".".join(f.relative_to(ROOT / "kernels").with_suffix("").parts)] = f
    return files


def _package(module: str) -> str:
    """dsq.<package>... -> <package>; a top-level module (dsq.errors) is its own package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("dsq")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[:-node.level]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "dsq":  # from dsq import X: X is a module or a name of the lazy API
                out += [(node.lineno, f"dsq.{a.name}") for a in node.names if a.name != "__version__"]
            elif target.startswith("dsq."):
                out.append((node.lineno, target))
    return out


def test_every_package_has_a_level():
    pkgs = {_package(m) for m in _sources()}
    assert pkgs <= set(LEVEL), f"packages without a place in ORDER: {sorted(pkgs - set(LEVEL))}"


def test_no_import_points_up():
    bad = []
    for module, path in _sources().items():
        here = LEVEL[_package(module)]
        for line, target in _imports(path, module):
            there = _package(target)
            if there not in LEVEL:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}, which has no place in ORDER")
            elif LEVEL[there] > here:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({_package(module)}) imports {target} ({there})")
    assert not bad, "imports that point up:\n" + "\n".join(bad)


def test_nothing_imports_the_cli():
    """Only the fuzzer, which drives the CLI as a user does, may import it."""
    users = [f"{p.relative_to(ROOT)}:{ln}" for m, p in _sources().items() if _package(m) not in ("cli", "fuzz")
             for ln, t in _imports(p, m) if _package(t) == "cli"]
    assert not users, users


@pytest.mark.parametrize("source,expect", [
    ("from dsq.cli.common import app\n", "cli"),
    ("def f():\n    from dsq.bench import runner\n", "bench"),
    ("import dsq.quant.driver\n", "quant"),
])
def test_the_check_sees_lazy_and_plain_imports(tmp_path, source, expect):
    """The checker itself: an import inside a function counts, as does `import x.y`."""
    f = tmp_path / "m.py"
    f.write_text(source)
    assert [_package(t) for _, t in _imports(f, "dsq.formats.m")] == [expect]
