"""An HF model directory of another's first N decoder layers (its embeddings, final norm and head
kept): a draft model for `dsq serve --draft` that shares the target's vocabulary, when no smaller
sibling is at hand (tests/test_serve_draft.py's disagreeing draft; docs/benchmarks.md#dsq-serve).

    python -m benchmarks.draft_layers SRC_HF_DIR OUT_DIR --layers 17
    python -m benchmarks.draft_layers builtin /tmp/draft17 --layers 17   # the built-in model's bf16 export
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path


def write_first_layers(src: Path, out: Path, layers: int) -> Path:
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    cfg = json.loads((src / "config.json").read_text())
    if not 1 <= layers <= cfg["num_hidden_layers"]:
        raise SystemExit(f"--layers must be 1..{cfg['num_hidden_layers']}, got {layers}")
    cfg["num_hidden_layers"] = layers
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copyfile(f, out / f.name)
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(load_file(f))
    kept = {k: v for k, v in weights.items() if not (m := re.search(r"\.layers\.(\d+)\.", k)) or int(m[1]) < layers}
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", help="an HF model directory, or 'builtin' (the built-in model's bf16 export)")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, required=True)
    a = ap.parse_args(argv)
    src = a.src
    if src == "builtin":
        from dsq.runtime.builtin import builtin_hf_export

        src = builtin_hf_export()
    print(write_first_layers(Path(src), Path(a.out), a.layers))


if __name__ == "__main__":
    main()
