"""Options the commands share: single flags, and the groups that `run` and `chat` both take
(sampling, loading), spread into a command's flags by `grouped`."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from dsq.errors import DsqError

ModelArg = Annotated[Optional[str], typer.Argument(
    help="A .gguf file, an HF model directory, or a Hugging Face repo id: org/name (an HF model), "
    "org/name:Q4_K_M or org/name/file.gguf (a GGUF repo), fetched into the Hugging Face cache. A local path of "
    "the same spelling wins. Omit it to use the built-in model.", show_default=False)]
Revision = Annotated[Optional[str], typer.Option(
    "--revision", help="With a Hugging Face repo id: the branch, tag or commit to fetch (default: main).",
    show_default=False)]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="Most tokens to generate.")]
Temperature = Annotated[float, typer.Option("--temperature", "-t", help="Sampling temperature; 0 = greedy.")]
TopK = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens; 0 = off.")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass; 1 = off.")]
MinP = Annotated[float, typer.Option("--min-p", help="Drop tokens below min-p x the top probability; 0 = off.")]
RepeatPenalty = Annotated[float, typer.Option("--repeat-penalty", help="Penalty for the last 64 tokens; 1 = off.")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling (reproducible output).")]
Ctx = Annotated[int, typer.Option("--ctx", "-c", help="Context length in tokens (prompt + reply).")]
Threads = Annotated[Optional[int], typer.Option("--threads", min=1, help="CPU threads (default: the physical cores this "
                                                                   "process may run on, one per core, not per SMT "
                                                                   "thread).")]
GpuLayersOption = Annotated[str, typer.Option(
    "--gpu-layers", "-g", help="Layers to put on the GPU: a number, 'all', or 'auto' (fit the free VRAM).")]
Experts = Annotated[str, typer.Option(
    "--experts", help="MoE models (DeepSeek), native backend: where the routed experts run. cpu: in RAM "
    "through the C kernels, the rest of each layer where --gpu-layers puts it; gpu: with their layers; "
    "auto: the faster placement that fits the free VRAM.")]
TensorParallel = Annotated[int, typer.Option(
    "--tp", help="native backend: split the model over N ranks, one process each (tensor parallel: attention heads "
    "and MLP columns, DeepSeek's routed experts placed per rank), on torch.distributed: N GPUs with --gpu-layers "
    "all (NCCL), else N processes on the CPU (gloo).")]
Head = Annotated[Optional[str], typer.Option(
    "--head", help="native backend, a model split between the GPU and the CPU: where the output head runs. "
    "gpu: in VRAM, read fastest every token; cpu: in RAM, as llama.cpp places it unless every layer is on the "
    "GPU, leaving its VRAM (~0.4 GB on an 8B) to layers; a share such as 0.6: that share of its rows in VRAM, "
    "the rest in RAM. Default: with --gpu-layers auto the plan's choice; with N layers the share that 10% of "
    "their VRAM holds (the VRAM of llama.cpp's -ngl N + 10%); with 0 layers on a machine with a GPU, the share "
    "that llama.cpp's CUDA build reserves there holds.", show_default=False)]
TensorSplit = Annotated[Optional[str], typer.Option(
    "--tensor-split", help="Several GPUs: each one's share of the GPU layers, in proportion, one number per "
    "visible GPU, as llama.cpp's -ts (e.g. 3,1: three quarters on the first). The layers go in contiguous "
    "ranges, the CPU's first, the output head on the last GPU. Default: each GPU's free memory.",
    show_default=False)]
Force = Annotated[bool, typer.Option("--force", "-f", help="Overwrite an existing output.")]
Backend = Annotated[str, typer.Option(
    "--backend", "-b", help="llama.cpp, native (dsq's torch engine), or auto: llama.cpp, and native for AWQ / "
    "GPTQ / FP8 directories, which only it runs.")]
Dtype = Annotated[Optional[str], typer.Option(
    "--dtype", help="native: activation dtype bf16|fp16|fp32 (default: bf16 on GPU, fp32 on CPU).")]
def _fp8_names() -> tuple[str, ...]:
    from dsq.serve.paged import FP8_NAMES

    return FP8_NAMES


def _kv_dtype(value: str | None) -> str | None:
    """A KV cache dtype some engine here keeps: the native dtypes, or fp8 (dsq serve's paged cache only)."""
    from dsq.runtime.native import _DTYPES

    if value is not None and value.lower() not in (*_DTYPES, *_fp8_names()):
        raise typer.BadParameter(f"{value!r} is not a KV cache dtype; use fp8, bf16, fp16 or fp32")
    return value


KvDtype = Annotated[Optional[str], typer.Option(
    "--kv-dtype", callback=_kv_dtype, help="KV cache dtype: bf16, fp16, fp32 (default: the activations'), or fp8 "
    "(e4m3, a scale per token and head; dsq serve's paged cache).")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of text.")]
OutFile = Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the records to this JSON file.")]
PromptTokens = Annotated[int, typer.Option("--prompt-tokens", min=1, help="Prompt length in tokens (real English text).")]
Repeat = Annotated[int, typer.Option("--repeat", "-r", min=1, help="Timed runs per configuration.")]
Tokens = Annotated[int, typer.Option("--tokens", min=1, help="Most tokens to score.")]
Window = Annotated[int, typer.Option("--window", min=16, help="Tokens per scoring window.")]
Compile = Annotated[bool, typer.Option(
    "--compile", help="native: torch.compile the decode step, on CUDA or the CPU (starts slower: ~20 s on a "
    "GPU, ~40 s on 2 CPU cores the first time, ~7 s once cached; decodes faster). On the CPU, not where "
    "every layer already decodes as one C call (GGUF llama/qwen2/gemma3), which is faster.")]


@dataclass
class Sampling:
    """How tokens are picked (`run` and `chat`; each its own defaults)."""

    max_tokens: MaxTokens = 256
    temperature: Temperature = 0.8
    top_k: TopK = 40
    top_p: TopP = 0.95
    min_p: MinP = 0.0
    repeat_penalty: RepeatPenalty = 1.0
    seed: Seed = None

    def params(self):
        from dsq.runtime.sampling import SamplingParams

        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p, self.repeat_penalty,
                              self.seed).validate()


@dataclass
class Loading:
    """Where and how a model runs."""

    ctx: Ctx = 4096
    threads: Threads = None
    gpu_layers: GpuLayersOption = "0"
    backend: Backend = "auto"
    dtype: Dtype = None
    kv_dtype: KvDtype = None
    compile: Compile = False
    experts: Experts = "auto"
    head: Head = None
    tensor_split: TensorSplit = None
    revision: Revision = None

    def load(self, model: str | None, seed: int | None = None):
        """The model on the backend that runs it (--backend auto: llama.cpp, or native for weights
        only it runs, said on stderr)."""
        from dsq.runtime.engine import load, native_only_format, pick_backend
        from dsq.runtime.gpu_layers import gpu_usable
        from dsq.runtime.model_ref import resolve_model
        from dsq.ui import console

        con = console()
        ref = resolve_model(model, con, self.revision)
        backend = pick_backend(ref, self.backend)
        if backend != self.backend and backend == "native":
            con.print(f"[dim]{native_only_format(ref)} weights: running on the native backend "
                      "(llama.cpp takes GGUF)[/dim]")
        m = load(ref, backend=backend, ctx=self.ctx, threads=self.threads, gpu_layers=self.gpu_layers, seed=seed,
                 console=con, **backend_options(backend, self.dtype, self.kv_dtype, self.compile, self.experts,
                                                 self.head, self.tensor_split))
        if (self.gpu_layers.strip() != "0" or self.tensor_split) and not gpu_usable(backend):
            con.print("[yellow]note:[/yellow] no GPU: running on the CPU")
        return m


def grouped(**groups) -> Callable:
    """Spread each option group (a dataclass instance holding the command's defaults) into the
    command's flags, where its parameter stands; the command receives the group filled in."""

    def deco(fn: Callable) -> Callable:
        hints = typing.get_type_hints(fn, include_extras=True)
        params = []
        for p in inspect.signature(fn).parameters.values():
            if p.name in groups:
                params += _group_params(groups[p.name])
            else:
                params.append(p.replace(annotation=hints.get(p.name, p.annotation)))

        @functools.wraps(fn)
        def wrapper(*args, **kw):
            for name, group in groups.items():
                kw[name] = type(group)(**{f.name: kw.pop(f.name) for f in dataclasses.fields(group)})
            return fn(*args, **kw)

        wrapper.__signature__ = inspect.Signature(params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return deco


def _group_params(group) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(type(group), include_extras=True)
    return [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=getattr(group, f.name),
                              annotation=hints[f.name]) for f in dataclasses.fields(group)]


def backend_options(backend: str, dtype: str | None, kv_dtype: str | None, compile: bool = False,
                    experts: str = "auto", head: str | None = None, tensor_split: str | None = None) -> dict:
    """Backend-specific load options from the shared flags."""
    from dsq.runtime.experts import check_backend, parse_experts
    from dsq.runtime.gpu_layers import parse_head

    experts = check_backend(parse_experts(experts), backend)
    head = None if head is None else parse_head(head)
    split = tensor_split_option(tensor_split)
    if kv_dtype is not None and kv_dtype.lower() in _fp8_names():
        raise DsqError("--kv-dtype fp8 is dsq serve's (its paged KV cache)", "use bf16, fp16 or fp32 here")
    shared = {"tensor_split": split} if split is not None else {}
    if backend == "native":
        return {"dtype": dtype, "kv_dtype": kv_dtype, "compile": compile, "experts": experts, "head": head, **shared}
    if dtype is not None or compile or head is not None:
        raise DsqError("--dtype, --compile and --head apply to the native backend",
                       "drop them, or pass --backend native")
    return {**({"kv_dtype": kv_dtype} if kv_dtype else {}), **shared}


def tensor_split_option(value: str | None) -> list[float] | None:
    """--tensor-split as each visible GPU's share, checked (one per GPU, numbers, none below 0, one
    above); None where none is given or there is no GPU (the caller's "no GPU" note covers it)."""
    from dsq.runtime.gpu_layers import parse_tensor_split
    from dsq.runtime.placement import detect_gpus

    shares = parse_tensor_split(value)
    if shares is None:
        return None
    gpus = detect_gpus()
    return parse_tensor_split(value, len(gpus)) if gpus else None


def check_output_path(path: Path, flag: str) -> None:
    """Refuse an output path whose folder cannot be made: a file where a folder must be."""
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise DsqError(f"cannot write {path}: {parent} is a file, not a folder", f"choose another {flag}")
            return


def stdin_text() -> str | None:
    if sys.stdin is not None and not sys.stdin.isatty():
        data = sys.stdin.read()
        return data if data.strip() else None
    return None
