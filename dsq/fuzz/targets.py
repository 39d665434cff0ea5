"""In-process targets: one mutated input through dsq's readers and loaders, as the CLI would use them.

Each target makes inputs (`make(rng)`: the mutated bytes or text) and runs one (`run(data, work)`):
returning normally or raising a DsqError is clean; any other exception is an internal error.
llama.cpp is not called in this process (a file it aborts on would end it): the probe target
hands each file to dsq.runtime.llama_probe, which loads it in a child process, and cli_target.py
runs the CLI's paths in child processes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

from dsq.fuzz import mutate, seeds

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}]


class GGUFTarget:
    name, suffix = "gguf", ".gguf"

    def __init__(self, root: Path):
        self.seeds = [p.read_bytes() for p in seeds.gguf_seeds(root)]
        self.layouts = [mutate.gguf_layout(s) for s in self.seeds]

    def make(self, rng: random.Random) -> bytes:
        i = rng.randrange(len(self.seeds))
        data = self.seeds[i]
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            data = mutate.gguf_mutation(rng, data, self.layouts[i]) if len(data) > 24 else data
        return data

    def run(self, data: bytes, work: Path) -> None:
        p = work / "input.gguf"
        p.write_bytes(data)
        exercise_gguf(p)


def exercise_gguf(path: Path) -> None:
    """What run, convert, offload and quantize read of a GGUF before llama.cpp sees it."""
    from dsq.convert.gguf_to_hf import hf_config_from_gguf
    from dsq.errors import DsqError
    from dsq.formats.gguf_file import GGUFFile
    from dsq.formats.tokenizer_gguf import vocab_from_gguf
    from dsq.models.registry import arch_for_gguf, build_args
    from dsq.runtime.model_shape import shape_from_gguf

    import numpy as np

    g = GGUFFile(path)
    _ = g.metadata, g.name, g.n_layers, g.describe_quant(), g.field("tokenizer.ggml.tokens")
    small = [t for t in g.tensors if t.n_elements <= 1 << 16]
    with np.errstate(all="ignore"):  # damaged blocks dequantize to NaN and inf, as they may
        for t in small[:1] + small[-1:]:
            g.dequantize(t.name)
    for step in (lambda: vocab_from_gguf(g), lambda: shape_from_gguf(path),
                 lambda: build_args(hf_config_from_gguf(g, arch_for_gguf(g.arch), "float32"), "GGUF")):
        try:
            step()
        except DsqError:
            pass


class SafetensorsTarget:
    """A model directory whose model.safetensors header is mutated."""

    name, suffix = "safetensors", ".safetensors"

    def __init__(self, root: Path):
        self.seed_dir = seeds.hf_seed(root)
        self.seed = (self.seed_dir / "model.safetensors").read_bytes()

    def make(self, rng: random.Random) -> bytes:
        data = self.seed
        for _ in range(rng.choice((1, 1, 2))):
            data = mutate.safetensors_mutation(rng, data)
        return data

    def run(self, data: bytes, work: Path) -> None:
        d = _model_dir(self.seed_dir, work)
        (d / "model.safetensors").unlink()  # a hard link to the seed: write a new file instead
        (d / "model.safetensors").write_bytes(data)
        exercise_hf(d, load=False)


class ConfigTarget:
    """A model directory whose config.json is mutated (as JSON values, or as text)."""

    name, suffix = "config", ".json"

    def __init__(self, root: Path):
        self.seed_dir = seeds.hf_seed(root)
        self.seed = seeds.config_seed(root)

    def make(self, rng: random.Random) -> bytes:
        cfg = self.seed
        for _ in range(rng.choice((1, 1, 2, 3))):
            cfg = mutate.json_mutation(rng, cfg)
        text = json.dumps(cfg)
        if rng.random() < 0.15:
            text = mutate.json_text_mutation(rng, text)
        return text.encode()

    def run(self, data: bytes, work: Path) -> None:
        d = _model_dir(self.seed_dir, work)
        (d / "config.json").write_bytes(data)
        exercise_hf(d, load=True)


def _model_dir(seed_dir: Path, work: Path) -> Path:
    """A fresh copy of the seed directory (the weights hard-linked, not copied)."""
    d = work / "model"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir()
    for f in seed_dir.iterdir():
        (d / f.name).hardlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, d / f.name)
    return d


def exercise_hf(d: Path, load: bool) -> None:
    """What run (native), convert and quantize read of an HF directory."""
    import torch

    from dsq.errors import DsqError
    from dsq.formats.hf import HFModelDir
    from dsq.models.registry import build_args
    from dsq.runtime.model_shape import shape_from_hf

    hf = HFModelDir(d)
    for name in hf.tensor_names():
        hf.tensor_shape(name)
    hf.mmap_tensors()
    try:
        shape_from_hf(d)
    except DsqError:
        pass
    if load:
        from dsq.runtime.native_loader import load_hf

        build_args(hf.config, "config.json")
        load_hf(d, torch.float32)


class TemplateTarget:
    """A chat template (the model's own, falling back to its architecture's) rendered in the sandbox."""

    name, suffix = "template", ".jinja"

    def __init__(self, root: Path):
        self.seeds = seeds.template_seeds()

    def make(self, rng: random.Random) -> bytes:
        text = rng.choice(self.seeds)
        for _ in range(rng.choice((1, 1, 2, 3, 4))):
            text = mutate.template_mutation(rng, text)
        return text.encode("utf-8", "replace")

    def run(self, data: bytes, work: Path) -> None:
        render_template(data.decode("utf-8", "replace"))


def render_template(text: str) -> str:
    from dsq.runtime.chat_template import pick_template

    t = pick_template(text, "qwen2", lambda tok: False, "<s>", "</s>", warn=lambda line: None)
    return t.render(MESSAGES)


class ProbeTarget(GGUFTarget):
    """A mutated GGUF (a third of them declaring another tokenizer model) that dsq's reader passes,
    through the child-process check before llama.cpp loads it in dsq's process: vocabulary only
    (the native backend), the whole model (the llama.cpp backend), the quantizer's dry run (float
    seeds). A file that crashes llama.cpp must come back as a BackendError, never end this process."""

    name = "probe"

    def make(self, rng: random.Random) -> bytes:
        if rng.random() < 0.35:
            return mutate.tokenizer_mutation(rng, self.seeds[rng.randrange(len(self.seeds))])
        return super().make(rng)

    def run(self, data: bytes, work: Path) -> None:
        from dsq.errors import DsqError
        from dsq.formats.gguf_file import GGUFFile
        from dsq.runtime.llama_probe import check_loads

        p = work / "input.gguf"
        p.write_bytes(data)
        g = GGUFFile(p)  # what dsq checks before llama.cpp sees a file
        floats = all(t.type_name in ("F32", "F16", "BF16") for t in g.tensors if len(t.shape) >= 2)
        load = {"n_ctx": 64, "gpu_layers": 0, "logits_all": False, "f32_kv": False, "kv_dtype": None}
        whats = [{"call": "load", "load": dict(load, vocab_only=True)},
                 {"call": "load", "load": dict(load, vocab_only=False)}]
        if floats:
            whats.append({"call": "quantize", "qtype": "Q8_0"})
        cache = os.environ.get("DSQ_CACHE")
        os.environ["DSQ_CACHE"] = str(work / "cache")  # one verdict per input: not in the user's cache
        try:
            for what in whats:
                try:
                    check_loads(p, what)
                except DsqError:
                    pass
        finally:
            if cache is None:
                os.environ.pop("DSQ_CACHE", None)
            else:
                os.environ["DSQ_CACHE"] = cache
            shutil.rmtree(work / "cache", ignore_errors=True)


TARGETS = {t.name: t for t in (GGUFTarget, SafetensorsTarget, ConfigTarget, TemplateTarget, ProbeTarget)}
