"""What goes into `dsq.quant.quantize` and what it reports: the calibration text, the settings of
a method, and progress steps. Plain values: this module imports no torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar

from dsq.errors import DsqError

if TYPE_CHECKING:
    from dsq.quant.method import Method

# flat option names (the CLI's flags, a recipe's keys) -> CalibSpec fields
_CALIB_OPTIONS = {"calib": "source", "calib_samples": "samples", "calib_seq_len": "seq_len"}
_LAYER_OPTIONS = ("bits", "group_size", "sym", "act_order", "damp", "fp8_scheme", "fp8_format", "skip",
                  "quantize_dense", "min_expert_tokens")
EVAL_TOKENS = 2048  # held-out tokens the model card's full evaluation reads (--eval full)
QUICK_EVAL_TOKENS = 512  # --eval quick, the default: a quarter of full, two windows scored in one batch
EVAL_MODES = {"quick": QUICK_EVAL_TOKENS, "full": EVAL_TOKENS, "none": 0}


def eval_name(tokens: int) -> str:
    """The card's name for an evaluation of `tokens` held-out tokens."""
    return next((k for k, v in EVAL_MODES.items() if v == tokens), "custom")


def eval_shape(tokens: int) -> tuple[int, int]:
    """(tokens a window, windows a forward pass) for the card's evaluation of `tokens` tokens: the
    quick one as two windows of 256 in one batch, larger ones in windows of 512 one at a time
    (a batch's logits take batch x window x vocabulary floats)."""
    if tokens <= QUICK_EVAL_TOKENS:
        return max(16, tokens // 2), 2
    return 512, 1


def _fields(options: dict, names: dict[str, str]) -> dict:
    """The options present in `options`, renamed to the fields they set."""
    return {name: options[opt] for opt, name in names.items() if opt in options}


@dataclass
class CalibSpec:
    """Calibration text: where it comes from and how much of it (GPTQ, AWQ, a GGUF importance matrix)."""

    source: str = "builtin"  # builtin | builtin-chat | random | a .txt/.jsonl path
    samples: int = 128
    seq_len: int = 512

    @classmethod
    def from_options(cls, options: dict) -> "CalibSpec":
        return cls(**_fields(options, _CALIB_OPTIONS))


class _Spec:
    method: str

    @property
    def impl(self) -> "Method":
        """The registry's Method for `self.method`."""
        from dsq.quant.registry import get_method

        return get_method(self.method)

    def validate(self):
        """Refuse settings the method cannot honour (and fill in its defaults). Returns self."""
        impl = self.impl
        if not isinstance(self, impl.spec_type):
            raise DsqError(f"method {self.method!r} takes a {impl.spec_type.__name__}")
        calib = getattr(self, "calib", None)
        if calib is not None and (calib.samples < 1 or calib.seq_len < 8):
            raise DsqError(f"--calib-samples must be >= 1 and --calib-seq-len >= 8, got {calib.samples} and "
                           f"{calib.seq_len}")
        impl.validate(self)
        return self


@dataclass
class QuantSpec(_Spec):
    """Settings of a layer-by-layer method: rtn, gptq, awq or fp8."""

    method: str
    bits: int = 4
    group_size: int = 128
    sym: bool | None = None  # None: the method's default (GPTQ/RTN symmetric, AWQ asymmetric)
    act_order: bool = False
    damp: float = 0.01
    fp8_scheme: str = "channel"  # channel | block
    fp8_format: str = "compressed-tensors"  # compressed-tensors | deepseek
    calib: CalibSpec = field(default_factory=CalibSpec)
    skip: list[str] = field(default_factory=list)  # module-name patterns kept 16-bit
    # mixture-of-experts models (dsq.quant.moe): the dense layers before the first MoE layer
    # (DeepSeek-V3's first 3) stay 16-bit unless this is set; the routers always do
    quantize_dense: bool = False
    # an expert routed fewer calibration tokens than this is quantized by RTN (gptq, awq)
    min_expert_tokens: int = 128

    @classmethod
    def from_options(cls, method: str, options: dict) -> "QuantSpec":
        return cls(method, calib=CalibSpec.from_options(options),
                   **_fields(options, {k: k for k in _LAYER_OPTIONS}))

    @property
    def needs_calibration(self) -> bool:
        return self.impl.needs_calibration

    def quantization_config(self, kept=None) -> dict:
        """The artifact's quantization_config; `kept`: the layers' Linears it keeps 16-bit
        (dsq.quant.moe.Kept), named the way each format's loaders skip modules."""
        return self.impl.quantization_config(self, kept)

    def record(self) -> dict:
        """The settings as one flat mapping: what dsq_quant.json holds and the resume key hashes."""
        d = asdict(self)
        calib, skip = d.pop("calib"), d.pop("skip")
        return {**d, **{opt: calib[name] for opt, name in _CALIB_OPTIONS.items()}, "skip": skip}


@dataclass
class GGUFSpec(_Spec):
    """Settings of a GGUF quantization: llama.cpp's type, with or without an importance matrix."""

    type: str = "Q4_K_M"  # a llama.cpp type, or F16/BF16/F32 for a float GGUF
    imatrix: bool = False
    calib: CalibSpec = field(default_factory=CalibSpec)  # the importance matrix's text
    method: ClassVar[str] = "gguf"

    @classmethod
    def from_options(cls, options: dict) -> "GGUFSpec":
        return cls(calib=CalibSpec.from_options(options), **_fields(options, {"qtype": "type", "imatrix": "imatrix"}))


@dataclass(frozen=True)
class Step:
    """One progress report: `task` has done `done` of `total` (None: not known yet) `unit`s."""

    task: str  # "gptq gptq-w4: blocks", "importance matrix: blocks", "NAME -> GGUF", ...
    done: int = 0
    total: int | None = None
    unit: str = "items"  # "bytes" for llama.cpp's quantizer
    item: str = ""  # what is being worked on (the tensor a conversion writes)
    note: str = ""  # a message to show once (what a resumed run reuses); such a step reports no progress


def no_progress(step: Step) -> None:
    """The progress callback that reports nothing."""


def interrupted(e: BaseException, kept: str | None) -> BaseException:
    """What to raise for a stopped run: a KeyboardInterrupt saying what a rerun resumes from."""
    if not isinstance(e, KeyboardInterrupt) or not kept:
        return e
    return type(e)(f"{kept}: run the same command again to resume")  # (a Terminated stays one)


OnStep = Callable[[Step], None]  # a progress callback
