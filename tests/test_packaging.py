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
