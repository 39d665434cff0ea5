"""pyproject lists packages explicitly (kernels/ installs as dsq.kernels): keep the list whole."""

from __future__ import annotations

import tomllib
from pathlib import Path

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
