"""pyproject lists packages explicitly (kernels/ installs as dsq.kernels): keep the list whole."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "dsq").rglob("__init__.py")}
    assert found <= listed, found - listed
    assert cfg["package-dir"]["dsq.kernels"] == "kernels" and "dsq.kernels" in listed
    assert (ROOT / "kernels" / "__init__.py").is_file()


def test_kernels_import_as_dsq_kernels():
    import dsq.kernels.dispatch as d

    assert Path(d.__file__).parent == ROOT / "kernels"


def _from_the_root(code: str) -> str:
    """What `python -c code` prints when run from the repository root (which puts the root, and so
    this kernels/ folder, first on sys.path, as `python -m pytest` does)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_import_kernels_from_the_root_is_pypis():
    """From the repository root, `import kernels` is PyPI's package (transformers imports it), not
    this kernels/ folder, which stays dsq.kernels."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("PyPI's kernels is not installed (the next test covers its absence)")
    pypi = Path(dist.locate_file("kernels/__init__.py")).resolve()
    out = _from_the_root("import sys, kernels, dsq.kernels.dispatch as d\n"
                         "print(kernels.__file__); print(sys.modules['kernels'].__file__); print(d.__file__)")
    assert out.splitlines() == [str(pypi), str(pypi), str(ROOT / "kernels" / "dispatch.py")]


def test_transformers_imports_from_the_root():
    pytest.importorskip("transformers")
    assert _from_the_root("from transformers import LlamaForCausalLM; print('imported')") == "imported"


def test_import_kernels_from_the_root_without_pypis_reads_as_absent():
    """Without PyPI's kernels, what `import kernels` gives from the root is what transformers takes
    for no package (its _is_package_available: no version, no file, once no distribution names it),
    and a name taken from it fails as `import kernels` would without this folder."""
    out = _from_the_root("import importlib.util, sys\n"
                         "sys.path = [p for p in sys.path if 'site-packages' not in p and 'dist-packages' not in p]\n"
                         "import kernels\n"
                         "print(importlib.util.find_spec('kernels') is not None, getattr(kernels, '__version__', 'N/A'),\n"
                         "      getattr(kernels, '__file__', None))\n"
                         "try:\n    from kernels import get_kernel\nexcept ModuleNotFoundError as e:\n"
                         "    print(e.name, 'dsq.kernels' in str(e))")
    assert out.splitlines() == ["True N/A None", "kernels True"]


def test_wheel_holds_no_probes_or_device_plans(tmp_path):
    """What the wheel installs (setuptools' build_py, the step that copies packages into it) holds
    the product only: benchmarks/ (probes, device scripts) and shell scripts stay in the repo."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path / "lib")], cwd=ROOT,
                   check=True, capture_output=True)
    files = [p.relative_to(tmp_path / "lib").as_posix() for p in (tmp_path / "lib").rglob("*") if p.is_file()]
    assert "dsq/bench/runner.py" in files and "dsq/eval/quality.py" in files  # the product is there
    probes = {p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh")} - {"__init__.py"}
    assert probes, "benchmarks/ holds the probes"
    leaked = [f for f in files if f.startswith("benchmarks/") or f.endswith(".sh") or f.rsplit("/", 1)[-1] in probes]
    assert not leaked, leaked
