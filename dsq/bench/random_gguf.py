"""A random-weight GGUF of a named model shape in a llama.cpp type mix, written block by block.

    python -m dsq.bench.random_gguf llama3-8b.Q4_K_M.gguf --shape llama3-8b --mix Q4_K_M
    python -m dsq.bench.random_gguf v2-lite.Q4_K_M.gguf --shape deepseek-v2-lite --mix Q4_K_M

A shape's layout is Llama's, or Qwen2's (q/k/v biases, tied or untied embeddings: arch qwen2), or
DeepSeek's (random_models.DEEPSEEK_SHAPES: MLA and MoE, llama.cpp's `deepseek2` with the stacked
`*_exps` experts and the MLA keys attn_k_b / attn_v_b, as dsq's converter writes them).
For side-by-side speed runs of the native runtime and llama.cpp on one file
(`dsq bench FILE --backend native,llama.cpp`) where no real checkpoint can be had: the quantized
blocks are random bytes with their scales set so weights stay in a trained model's range
(|w| <~ 0.02), so neither engine meets NaNs, and no float model is ever built (an 8B file takes
seconds and ~1 GB of memory). The vocabulary is a small SentencePiece one (bytes, printable
characters, and "▁"+character pieces) padded to the shape's size with "▁w<index>" words that no
text tokenizes into, so real text tokenizes, both engines agree on it, and whatever a random model
generates decodes to text (a server's stream has something to send).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import numpy as np

from dsq.bench.random_models import DEEPSEEK_SHAPES, SHAPES, deepseek_config

# where each block type's f16 scale d sits (Q4_K's dmin follows it); block sizes: gguf_ref.BLOCKS
_D_AT = {"Q4_0": 0, "Q5_0": 0, "Q8_0": 0, "Q4_K": 0, "Q6_K": 208}
# llama.cpp's quantizer gives a tensor whose rows are no multiple of 256 these instead of a K-quant
_K_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}
_ALL_SAME = {"Q4_0", "Q8_0", "Q6_K"}  # file types whose tensors are all one type
MIXES = ("Q4_K_M", *sorted(_ALL_SAME))


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's Q4_K_M rule: which layers' attn_v / ffn_down get Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(mix: str, name: str, n_layers: int, tied: bool = False) -> str:
    """The block type llama.cpp's quantizer gives tensor `name` (GGUF naming) in file type `mix`;
    `tied`: the file has no output.weight, token_embd is the output head too."""
    if name.endswith(("norm.weight", ".bias")) or name == "rope_freqs.weight":
        return "F32"
    if mix in _ALL_SAME:
        return mix
    if mix != "Q4_K_M":
        raise ValueError(f"unknown mix {mix!r}; choose from {', '.join(MIXES)}")
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        return "Q6_K" if _more_bits(int(name.split(".")[1]), n_layers) else "Q4_K"
    return "Q4_K"


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) uint8: random codes, scales chosen so |w| stays under ~0.02 and each
    block's mean is near zero (Q4_K: dmin = 7.5 d against the codes' mean of 7.5)."""
    from dsq.kernels.gguf_ref import BLOCKS

    per, nbytes = BLOCKS[qtype]
    if cols % per:
        raise ValueError(f"{qtype} needs rows of a multiple of {per} weights, not {cols}")
    b = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    d = {"Q4_0": 2.5e-3, "Q5_0": 1.2e-3, "Q8_0": 1.5e-4, "Q4_K": 2e-5, "Q6_K": 5e-6}[qtype]
    scale = (d * rng.uniform(0.5, 1.5, size=(rows, cols // per))).astype(np.float16)
    at = _D_AT[qtype]
    b[..., at:at + 2] = scale.view(np.uint8).reshape(rows, cols // per, 2)
    if qtype == "Q4_K":  # dmin
        b[..., 2:4] = (scale.astype(np.float32) * 7.5).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    return b.reshape(rows, -1)


def synthetic_vocab(n: int, pad: str = "words"):
    """A SentencePiece vocabulary of n tokens: <unk> <s> </s>, the 256 byte tokens, printable
    ASCII and "▁"+character pieces (scored so longer pieces win), the rest "▁w<index>" words that
    tokenizing text never produces but that decode to text."""
    from dsq.formats.tokenizer_gguf import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, Vocab

    tokens, types, scores = ["<unk>", "<s>", "</s>"], [UNKNOWN, CONTROL, CONTROL], [0.0, 0.0, 0.0]
    tokens += [f"<0x{i:02X}>" for i in range(256)]
    types += [BYTE] * 256
    scores += [0.0] * 256
    chars = [chr(c) for c in range(33, 127)]
    for piece in ["\u2581"] + chars + ["\u2581" + c for c in chars]:
        tokens.append(piece)
        types.append(NORMAL)
        scores.append(-float(len(tokens)) if len(piece) == 1 else 1.0 - len(tokens) / 1e4)
    if n < len(tokens):
        raise ValueError(f"a vocabulary needs at least {len(tokens)} tokens, not {n}")
    if pad not in ("words", "unused"):
        raise ValueError(f"pad is 'words' or 'unused', not {pad!r}")
    # words no merge of the pieces above can form ("▁w" + 3+ digits), so a random model's output
    # renders as text (a server's stream, a load generator's TTFT); pad="unused": unused tokens, as
    # the fuzzer's frozen seed files were made
    words = pad == "words"
    while len(tokens) < n:
        tokens.append(f"\u2581w{len(tokens)}" if words else f"<unused{len(tokens)}>")
        types.append(NORMAL if words else UNUSED)
        scores.append(-1e9)
    return Vocab(model="llama", tokens=tokens, token_types=types, scores=scores,
                 special={"unk": 0, "bos": 1, "eos": 2}, add_bos=True, add_space_prefix=True)


def _plan(cfg: dict, mix: str) -> list[tuple[str, tuple[int, ...], str]]:
    """[(GGUF name, (rows, cols) or (n,), type)] in llama.cpp's file order: the Llama layout, with
    q/k/v biases (attention_bias: qwen2) and without output.weight (tie_word_embeddings)."""
    h, f, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd, tied = cfg["head_dim"], bool(cfg.get("tie_word_embeddings"))
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = [("token_embd.weight", (cfg["vocab_size"], h))]
    for i in range(L):
        qkv = [(f"blk.{i}.attn_{p}.weight", (n, h)) for p, n in (("q", q), ("k", kv), ("v", kv))]
        if cfg.get("attention_bias"):
            qkv = [t for p, n in (("q", q), ("k", kv), ("v", kv))
                   for t in ((f"blk.{i}.attn_{p}.weight", (n, h)), (f"blk.{i}.attn_{p}.bias", (n,)))]
        shapes += [(f"blk.{i}.attn_norm.weight", (h,)), *qkv,
                   (f"blk.{i}.attn_output.weight", (h, q)), (f"blk.{i}.ffn_norm.weight", (h,)),
                   (f"blk.{i}.ffn_gate.weight", (f, h)), (f"blk.{i}.ffn_up.weight", (f, h)),
                   (f"blk.{i}.ffn_down.weight", (h, f))]
    shapes += [("output_norm.weight", (h,))] + ([] if tied else [("output.weight", (cfg["vocab_size"], h))])
    return [(n, s, tensor_type(mix, n, L, tied)) for n, s in shapes]


def deepseek_tensor_type(mix: str, name: str, cols: int, n_layers: int) -> str:
    """The block type of a deepseek2 tensor with rows of `cols` weights in file type `mix`: as
    tensor_type, with the routers and V3's selection bias in F32 and llama.cpp's fallback where
    the rows are no multiple of a K-quant's 256 (attn_k_b's 128, V2-Lite's expert width 1408)."""
    if "ffn_gate_inp" in name or "exp_probs_b" in name:
        return "F32"
    base = name.replace("_exps.", ".").replace("_shexp.", ".")
    t = tensor_type(mix, base, n_layers)
    return _K_FALLBACK.get(t, t) if t in _K_FALLBACK and cols % 256 else t


def _deepseek_plan(cfg: dict, mix: str) -> list[tuple[str, tuple[int, ...], str]]:
    """[(GGUF name, shape (..., rows, cols) or (n,), type)] of a deepseek2 file in llama.cpp's order."""
    h, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, nope, rope, v = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                        cfg["v_head_dim"])
    r, q_lora = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
    E, FE, F = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    S = FE * cfg["n_shared_experts"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (V, h))]
    for i in range(L):
        b = f"blk.{i}."
        q = [(b + "attn_q_a_norm.weight", (q_lora,)), (b + "attn_q_a.weight", (q_lora, h)),
             (b + "attn_q_b.weight", (H * (nope + rope), q_lora))] if q_lora else [
            (b + "attn_q.weight", (H * (nope + rope), h))]
        shapes += [(b + "attn_norm.weight", (h,)), *q, (b + "attn_kv_a_norm.weight", (r,)),
                   (b + "attn_kv_a_mqa.weight", (r + rope, h)), (b + "attn_k_b.weight", (H, r, nope)),
                   (b + "attn_v_b.weight", (H, v, r)), (b + "attn_output.weight", (h, H * v)),
                   (b + "ffn_norm.weight", (h,))]
        if i < cfg["first_k_dense_replace"]:
            shapes += [(b + "ffn_gate.weight", (F, h)), (b + "ffn_up.weight", (F, h)), (b + "ffn_down.weight", (h, F))]
            continue
        shapes.append((b + "ffn_gate_inp.weight", (E, h)))
        if cfg["model_type"] == "deepseek_v3":
            shapes.append((b + "exp_probs_b.bias", (E,)))
        shapes += [(b + "ffn_gate_exps.weight", (E, FE, h)), (b + "ffn_up_exps.weight", (E, FE, h)),
                   (b + "ffn_down_exps.weight", (E, h, FE))]
        if S:
            shapes += [(b + "ffn_gate_shexp.weight", (S, h)), (b + "ffn_up_shexp.weight", (S, h)),
                       (b + "ffn_down_shexp.weight", (h, S))]
    shapes += [("output_norm.weight", (h,)), ("output.weight", (V, h))]
    return [(n, s, deepseek_tensor_type(mix, n, s[-1], L)) for n, s in shapes]


def _f32_values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Norm weights 1; biases and routers N(0, 0.02), a trained model's range (a router of equal
    rows would send every token to the same experts)."""
    if name.endswith(".bias") or "ffn_gate_inp" in name:
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    return np.ones(shape, dtype=np.float32)


def write_random_gguf(out: str | Path, shape: str = "llama3-8b", mix: str = "Q4_K_M", seed: int = 0,
                      force: bool = False, progress: Callable[[str, int, int], None] | None = None,
                      layers: int | None = None, vocab_pad: str = "words") -> Path:
    """Write a random GGUF of `shape` (a `random_models.SHAPES` name; `layers` overrides its depth) in
    `mix` to `out` (temp file + rename); `vocab_pad`: synthetic_vocab's padding."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from dsq.convert.hf_to_gguf import write_hparams
    from dsq.formats.gguf_types import FTYPES
    from dsq.formats.hf import atomic_output_file
    from dsq.formats.tokenizer_gguf import write_vocab_gguf
    from dsq.kernels.gguf_ref import row_bytes
    from dsq.models.registry import arch_for_model_type
    from dsq.models.rope import llama3_rope_factors

    if shape not in SHAPES and shape not in DEEPSEEK_SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join([*SHAPES, *DEEPSEEK_SHAPES])}")
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; choose from {', '.join(MIXES)}")
    if layers is not None and layers < 1:
        raise ValueError(f"--layers must be at least 1, not {layers}")
    if shape in DEEPSEEK_SHAPES:
        cfg = deepseek_config(shape, layers)
        plan = _deepseek_plan(cfg, mix)
        model_type = cfg["model_type"]
    else:
        cfg = dict(SHAPES[shape])
        cfg["rope_parameters"] = cfg.pop("rope")
        if layers is not None:
            cfg["num_hidden_layers"] = layers
        plan = _plan(cfg, mix)
        model_type = "qwen2" if cfg.get("attention_bias") else "llama"  # the two layouts of SHAPES
    rng = np.random.default_rng(seed)
    extra = []
    if cfg["rope_parameters"].get("rope_type") == "llama3":
        extra.append(("rope_freqs.weight", llama3_rope_factors(cfg["rope_parameters"], cfg["head_dim"]).numpy()))

    arch = arch_for_model_type(model_type)
    with atomic_output_file(Path(out), force=force) as tmp:
        w = GGUFWriter(str(tmp), arch.gguf_arch)
        w.add_name(f"random {shape} {mix}")
        w.add_file_type(FTYPES[mix])
        write_hparams(w, arch, cfg, cfg["vocab_size"])
        write_vocab_gguf(w, synthetic_vocab(cfg["vocab_size"], vocab_pad))
        for name, shp, t in plan:
            if t == "F32":
                w.add_tensor_info(name, shp, np.dtype(np.float32), 4 * int(np.prod(shp)),
                                  raw_dtype=GGMLQuantizationType.F32)
            else:
                byte_shape = (*shp[:-1], row_bytes(t, shp[-1]))
                w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                                  raw_dtype=GGMLQuantizationType[t])
        for name, data in extra:
            w.add_tensor_info(name, data.shape, np.dtype(np.float32), data.nbytes, raw_dtype=GGMLQuantizationType.F32)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total = len(plan) + len(extra)
        for i, (name, shp, t) in enumerate(plan):
            if t == "F32":
                w.write_tensor_data(_f32_values(name, shp, rng))
            else:
                rows = int(np.prod(shp[:-1]))
                w.write_tensor_data(random_blocks(t, rows, shp[-1], rng).reshape(*shp[:-1], -1))
            if progress:
                progress(name, i + 1, total)
        for name, data in extra:
            w.write_tensor_data(data)
        w.close()
    return Path(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted([*SHAPES, *DEEPSEEK_SHAPES]))
    ap.add_argument("--mix", default="Q4_K_M", choices=MIXES)
    ap.add_argument("--layers", type=int, help="override the shape's number of layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="replace an existing file")
    a = ap.parse_args(argv)
    from dsq.errors import DsqError
    from dsq.ui import progress_bar

    try:
        with progress_bar() as bar:
            task = bar.add_task(f"writing {a.out.name}", total=None)
            path = write_random_gguf(a.out, a.shape, a.mix, a.seed, a.force, layers=a.layers,
                                     progress=lambda n, i, t: bar.update(task, completed=i, total=t))
    except DsqError as e:
        ap.exit(1, f"error: {e.message}" + (f" ({e.hint})" if e.hint else "") + "\n")
    except ValueError as e:
        ap.exit(1, f"error: {e}\n")
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
