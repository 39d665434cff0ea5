"""dsq's compute kernels, installed as `dsq.kernels` (this folder is the repository's kernels/).

Each weight format has a plain torch reference (the oracle and the fallback); the dispatcher in
`dispatch` is what the runtime's quantized modules call, so faster kernels slot in there.
"""

if __name__ == "kernels":
    # Imported as a top-level `kernels`: that happens only where the repository root is on sys.path
    # (`python -m pytest` or `python -m benchmarks.NAME` run from it). The name belongs to PyPI's
    # `kernels`, which transformers imports; this folder is dsq.kernels. Load PyPI's package in this
    # one's place. Without it, stand in a module that says it is absent: transformers finds this
    # folder by name, imports it when no distribution names it, and takes a module with neither a
    # version nor a file for no package; any name taken from it raises ModuleNotFoundError, as
    # `import kernels` would without this folder (tests/test_packaging.py).
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys
    import types as _types

    _root = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
    _elsewhere = [p for p in _sys.path if isinstance(p, str) and _os.path.realpath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec(__name__, _elsewhere)
    if _spec is None or _spec.loader is None:
        def _absent(name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            raise ModuleNotFoundError(f"No module named {__name__!r} (the repository's kernels/ is dsq.kernels)",
                                      name=__name__)

        _module = _types.ModuleType(__name__, "PyPI's kernels is not installed; this repository's kernels/ is dsq.kernels")
        _module.__spec__ = __spec__  # importlib.util.find_spec reads it from sys.modules
        _module.__getattr__ = _absent
        _sys.modules[__name__] = _module
    else:
        _module = _util.module_from_spec(_spec)
        _sys.modules[__name__] = _module  # the import statement returns what sys.modules holds after this runs
        _spec.loader.exec_module(_module)
