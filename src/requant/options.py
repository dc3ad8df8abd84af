"""Every option of a quantization run, in one table: the API's keywords, the CLI's flags and the config
file's keys are all read through :data:`OPTIONS`, and every check runs once, in :meth:`Options.create`,
before any work.

A new option is one :class:`Option` row here and one field of :class:`Options`: the CLI's flag, the
config file's key, the API's keyword, its check and its error message all come from the row.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from requant.backends.tosa.program import ROUNDING as ROUNDINGS
from requant.errors import ArgumentError
from requant.report.budget import METRICS
from requant.transforms.smoothing import DEFAULT_ALPHA

__all__ = ["OPTIONS", "Option", "Options", "preflight"]

# method=None with the presets' observers (or a config that names none): MobileNetV2 0.797 -> 0.877 top-1
# agreement, the other bench models as good as their best method, in less time than NNCF (calibration.md)
DEFAULT_METHOD = "auto"


def _target_names() -> list[str]:
    from requant.targets.registry import TARGETS

    return sorted(TARGETS)


def _backend(target: str) -> str:
    from requant.targets.registry import get_target

    return get_target(target).backend


def _methods() -> list[str]:
    from requant.calibration.observers import known_methods

    return known_methods()


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _path(v: Any) -> bool:
    return isinstance(v, str | os.PathLike)


def _quantizer(v: Any) -> bool:
    from requant.quantizers import Quantizer

    return isinstance(v, Quantizer)


def _fixed_input(text: str) -> tuple[str, list[float] | float]:
    """``NAME=VALUE`` as (name, a number or a list of them)."""
    name, sep, value = text.partition("=")
    try:
        numbers = [float(v) for v in value.split(",")] if sep and name and value else None
    except ValueError:
        numbers = None
    if numbers is None:
        raise ArgumentError(f"--fix-input {text!r}: expected NAME=VALUE, a number or numbers separated by commas")
    return name.strip(), numbers if len(numbers) > 1 else numbers[0]


@dataclass(frozen=True)
class Option:
    """One option: its name (the API's keyword), what it accepts (``accepts``, said as ``expected`` in
    errors: "<name> must be <expected>; got ..."), its default, and how the CLI and the config file
    spell it (``flag``, ``key``; None: not there)."""

    name: str
    default: Any
    accepts: Callable[[Any], bool]
    expected: str | Callable[[], str]
    help: str
    flag: str | None = None  # the CLI's flag; a boolean on by default gets "--no-..." (it turns it off)
    key: str | None = None  # the config file's key (None: not in the file)
    metavar: str | None = None
    parse: Callable[[str], Any] = str  # the CLI's text to a value
    choices: Callable[[], Sequence[str]] | None = None  # the CLI's choices, listed in its help
    backends: tuple[str, ...] = ()  # an option of the targets with these backends only (empty: of every target)
    path: bool = False  # a path: relative to the config file that gives it
    short: str | None = None  # the CLI's one-letter flag
    repeat: bool = False  # the CLI's flag is given once per entry of a dict (``parse`` gives (key, value))

    def checked(self, value: Any, where: str = "") -> Any:
        """``value``, or an :class:`ArgumentError` saying what the option accepts."""
        if not self.accepts(value):
            expected = self.expected if isinstance(self.expected, str) else self.expected()
            raise ArgumentError(f"{where}{self.name} must be {expected}; got {value!r} ({type(value).__name__})")
        return float(value) if self.parse is float and _number(value) else value


# the ONNX targets' backends: options the executorch-xnnpack target's PT2E flow does not implement (yet)
ONNX_BACKENDS = ("qdq", "tosa")
# the flows that quantize activations (every target's), not language models' weight-only blocks
QUANTIZED_ACTIVATIONS = ("qdq", "tosa", "executorch")
BLOCKS = ("blocks",)  # language models' weight-only blocks (requant.stages.blocks)
BLOCKS_PRESET = "INT4_BLOCKWISE_WEIGHTS"


def _block_size(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 16 and v & (v - 1) == 0


OPTIONS: tuple[Option, ...] = (
    Option("target", "onnxruntime-cpu", lambda v: isinstance(v, str) and v in _target_names(),
           lambda: f"a target name, one of {', '.join(_target_names())}",
           "what the model is for (default: onnxruntime-cpu, exact on every x86-64 CPU; onnxruntime-cpu-vnni: "
           "full-range int8 weights for CPUs with VNNI; tosa-int8: integer-only TOSA MLIR, with -o FILE.mlir; "
           "see docs/targets.md)", flag="--target", key="target", choices=_target_names),
    Option("quantizer", None, _optional(_quantizer), "a requant Quantizer, or None for the defaults",
           "which parts are quantized and how (the CLI and the config file build it from --preset and the "
           "file's [configs], [[override]] and [module_params])"),
    Option("method", None, lambda v: v is None or v == "auto" or v in _methods(),
           lambda: f"None, 'auto' or one of {', '.join(_methods())}",
           "activation calibration method: auto (the default unless a --config names observers: tries minmax "
           "and mean_minmax, keeps the closer to float; a detector: stem_percentile), minmax, mean_minmax, "
           "percentile, stem_percentile, entropy, mse",
           flag="--method", key="method", backends=QUANTIZED_ACTIVATIONS),
    Option("output", None, _optional(_path), "a path (str or os.PathLike), or None",
           "where to write the quantized model (.mlir: the TOSA program, tosa-int8 only)",
           flag="--output", key="output", metavar="OUT", path=True, short="-o"),
    Option("eval_data", None, lambda v: True, "evaluation data",
           "evaluation data (.npz; a 'labels' array gives accuracy)", flag="--eval", key="eval", metavar="DATA",
           path=True),
    Option("progress", None, _optional(callable), "None or a callable progress(done, total)",
           "called as work advances (default: a progress bar on a terminal)"),
    Option("measure", True, _is_bool, "True or False",
           "skip the latency measurement (float and int8 runs interleaved, at most 2 s)",
           flag="--no-measure", key="measure"),
    Option("strict", False, _is_bool, "True or False",
           "fail if a node asked to be quantized cannot be; on the command line, exit 3 when an output of the "
           "int8 model stays far from float (the model and reports are written)",
           flag="--strict", key="strict"),
    Option("bias_correction", True, _is_bool, "True or False",
           "keep the biases as quantized (default: correct the mean shift of int8 convolutions and Gemms)",
           flag="--no-bias-correction", key="bias_correction"),
    Option("keep_float_below", None, _optional(lambda v: _number(v) and math.isfinite(v)),
           "a finite number of dB (e.g. 29), or None",
           "keep float the int8 convolutions and Gemms whose output SQNR against float is below DB "
           "(measured on the first 64 calibration samples, pointwise convolutions on the first 16; the model "
           "is quantized a second time)", flag="--keep-float-below", key="keep_float_below", metavar="DB",
           parse=float, backends=ONNX_BACKENDS),
    Option("max_drop", None, _optional(lambda v: _number(v) and 0 <= v <= 1),
           "a number in [0, 1] (e.g. 0.01 for one point), or None",
           "an accuracy budget on --eval: if the int8 model loses more than X (0.01: one point), keep float "
           "the kernels that bring it within X at the least modelled latency: the most effective (measured) or "
           "the first ones in graph order (one float region from the inputs); each try re-quantizes",
           flag="--max-drop", key="max_drop", metavar="X", parse=float, backends=QUANTIZED_ACTIVATIONS),
    Option("metric", None, lambda v: v is None or v in METRICS, f"one of {', '.join(METRICS)}",
           "what --max-drop measures (default: accuracy when the --eval data has labels, else a detector's detections "
           "after NMS, else top-1 agreement)",
           flag="--metric", key="metric", choices=lambda: METRICS, backends=QUANTIZED_ACTIVATIONS),
    Option("smoothing", DEFAULT_ALPHA, _optional(lambda v: _number(v) and 0 <= v <= 1),
           f"an alpha in [0, 1] (0 or None: off; default {DEFAULT_ALPHA}, 0.5 on executorch-xnnpack)",
           f"SmoothQuant's alpha for the inputs of linear layers, in models with more linear layers than "
           f"convolutions (default {DEFAULT_ALPHA}, 0.5 on executorch-xnnpack; 0: off): outlier channels move "
           "into the weights",
           flag="--smoothing", key="smoothing", metavar="ALPHA", parse=float),
    Option("equalization", True, _is_bool, "True or False",
           "leave depthwise convolutions' inputs as they are (default: scale their small channels up "
           "against the convolution before them, in convolutional models)",
           flag="--no-equalization", key="equalization"),
    Option("rounding", None, lambda v: v is None or v in ROUNDINGS, f"one of {', '.join(ROUNDINGS)}",
           "tosa-int8: how the rescales round (default single_round, TOSA's; double_round: TFLite's)",
           flag="--rounding", key="rounding", choices=lambda: ROUNDINGS, backends=("tosa",)),
    Option("accumulator_bits", None, _optional(lambda v: isinstance(v, int) and not isinstance(v, bool)
                                               and 8 <= v <= 32),
           "a whole number of bits in [8, 32], or None",
           "tosa-int8: simulate accumulators this wide (e.g. 16) in requant's interpreter; the report says how "
           "often each kernel's would overflow", flag="--accumulator-bits", key="accumulator_bits",
           metavar="BITS", parse=int, backends=("tosa",)),
    Option("fixed_inputs", None, _optional(lambda v: isinstance(v, Mapping)),
           "a dict of input name -> value, or None",
           "make input NAME a constant of VALUE (a number, or numbers separated by commas), as a setting "
           "the model branches on: its If folds and the branch taken is quantized (repeatable)",
           flag="--fix-input", key="fixed_inputs", metavar="NAME=VALUE", parse=lambda text: _fixed_input(text),
           repeat=True, backends=ONNX_BACKENDS),
    Option("example_inputs", None, lambda v: True, "example inputs",
           "a PyTorch module's example inputs (requant.load)"),
    Option("dynamic_shapes", None, lambda v: True, "dynamic shapes",
           "a PyTorch module's dynamic shapes (requant.load)"),
    Option("text_field", "text", lambda v: isinstance(v, str) and bool(v), "a column name (a non-empty string)",
           "a Hugging Face folder's model: the column (or JSON-lines field) of the rows of a dataset given as text "
           "data (a saved datasets folder, a Parquet or .jsonl file; default: text)", flag="--text-field",
           key="text_field", metavar="NAME"),
    Option("transform", None, _optional(callable), "a callable, or None",
           "applied to each item of iterable calibration and evaluation data (a DataLoader's batches) before it "
           "is matched to the model's inputs: NNCF's transform_fn (files, arrays and dicts of arrays are read as "
           "they are)"),
    Option("bits", None, _optional(lambda v: v in (4, 8) and not isinstance(v, bool)), "4 or 8, or None",
           f"language models (--preset {BLOCKS_PRESET}): bits of the weight blocks (default: the preset's, 4)",
           flag="--bits", key="bits", metavar="BITS", parse=int, backends=BLOCKS),
    Option("block_size", None, _optional(_block_size), "a power of 2 of at least 16, or None",
           "language models: weights per block along a layer's input axis (default: the preset's, 32)",
           flag="--block-size", key="block_size", metavar="N", parse=int, backends=BLOCKS),
    Option("symmetric", True, _is_bool, "True or False",
           "language models: blocks with a zero point each (default: symmetric blocks, no zero points)",
           flag="--asymmetric", key="symmetric"),
    Option("max_size", None, _optional(lambda v: _number(v) and v > 0), "a size in MB (a number > 0), or None",
           "language models: the most the written model may weigh, in MB (10^6 bytes): the 4-bit layers whose "
           "blocks leave the most output error per byte get 8 bits until it is reached (default: none)",
           flag="--max-size", key="max_size", metavar="MB", parse=float, backends=BLOCKS),
    Option("embedding_bits", None, _optional(lambda v: v in (4, 8) and not isinstance(v, bool)), "4 or 8, or None",
           "language models: the embedding's table in blocks of BITS (a GatherBlockQuantized). An embedding tied to "
           "the LM head shares its blocks: the LM head gets BITS too (default 8 when the layers have 4); an untied "
           "one stays float unless this is given", flag="--embedding-bits", key="embedding_bits", metavar="BITS",
           parse=int, backends=BLOCKS),
    Option("tokenizer", None, _optional(_path), "a path (str or os.PathLike), or None",
           "language models: the folder with the tokenizer.json of the --calib and --eval text (default: the "
           "model's folder)", flag="--tokenizer", key="tokenizer", metavar="DIR", path=True, backends=BLOCKS),
)  # fmt: skip
BY_NAME = {o.name: o for o in OPTIONS}


@dataclass(frozen=True)
class Options:
    """One run's options, checked: build it with :meth:`create` (the API), or from the CLI's flags and
    the config file (:mod:`requant.cli.quantize_cmd`), never field by field."""

    target: str = "onnxruntime-cpu"
    quantizer: Any = None
    method: str | None = None
    output: str | os.PathLike[str] | None = None
    eval_data: Any = None
    progress: Callable[[int, float], None] | None = None
    measure: bool = True
    strict: bool = False
    bias_correction: bool = True
    keep_float_below: float | None = None
    max_drop: float | None = None
    metric: str | None = None
    smoothing: float | None = DEFAULT_ALPHA
    equalization: bool = True
    rounding: str | None = None
    accumulator_bits: int | None = None
    fixed_inputs: Mapping[str, Any] | None = None
    example_inputs: Any = None
    dynamic_shapes: Any = None
    text_field: str = "text"
    transform: Any = None
    bits: int | None = None
    block_size: int | None = None
    symmetric: bool = True
    max_size: float | None = None
    embedding_bits: int | None = None
    tokenizer: str | os.PathLike[str] | None = None

    @classmethod
    def create(cls, where: str = "", **given: Any) -> Options:
        """The options ``given`` (the rest at their defaults), each checked, then together
        (:meth:`_together`); the quantizer built for the target, and the method it implies.
        ``where``: what errors start with (a config file's name)."""
        unknown = sorted(set(given) - set(BY_NAME))
        if unknown:
            raise ArgumentError(f"{where}unknown option {', '.join(map(repr, unknown))}; known: {', '.join(BY_NAME)}")
        values = {name: BY_NAME[name].checked(value, where) for name, value in given.items()}
        options = cls(**values)
        if "smoothing" not in given:  # the target's default alpha
            options = _replace(options, smoothing=options.chosen_target.smoothing_alpha)
        options._together()
        return options._resolved()

    def _together(self) -> None:
        """The checks that read more than one option."""
        backend = self.chosen_target.backend
        for option in OPTIONS:
            if option.backends and getattr(self, option.name) is not None and self.flow not in option.backends:
                raise ArgumentError(self._not_here(option))
        if self.flow == "blocks" and backend != "qdq":
            raise ArgumentError(f"{BLOCKS_PRESET} (language models' weight blocks, MatMulNBits) runs on ONNX Runtime: "
                                f"the onnxruntime-cpu target, not {self.target}")  # fmt: skip
        if not self.symmetric and self.flow != "blocks":
            raise ArgumentError(f"symmetric=False (--asymmetric) is an option of language models' weight blocks "
                                f"(--preset {BLOCKS_PRESET})")  # fmt: skip
        if self.output is not None and (backend == "executorch") != str(self.output).endswith(".pte"):
            writes = "a .pte program (.pte)" if backend == "executorch" else "ONNX (.onnx)"
            raise ArgumentError(f"'{self.output}': the {self.target} target writes {writes}")
        if self.output is not None and str(self.output).endswith(".mlir") and backend != "tosa":
            raise ArgumentError(f"'{self.output}': only the tosa-int8 target writes MLIR; {self.target} writes ONNX "
                                "(.onnx)")  # fmt: skip
        if self.max_drop is None:
            if self.metric is not None:
                raise ArgumentError("metric is the accuracy budget's: give max_drop too")
            return
        if self.eval_data is None:
            raise ArgumentError("max_drop needs eval_data: the drop is measured on the evaluation data")
        if self.keep_float_below is not None:
            raise ArgumentError("give max_drop or keep_float_below, not both: both choose which kernels stay float")
        if self.metric == "detections" and backend == "executorch":  # decoded from every output of an ONNX model
            raise ArgumentError(
                "metric 'detections' is measured by the ONNX targets' budget; the executorch-xnnpack "
                "target's measures accuracy, top1 or cosine"
            )
        if self.metric == "accuracy" and not _has_labels(self.eval_data):  # (an iterable's targets: read later)
            raise ArgumentError("metric 'accuracy' needs labels in the evaluation data (a 'labels' array, or a data "
                                "loader's (x, y) with class indices y)")  # fmt: skip

    def _not_here(self, option: Option) -> str:
        """Why ``option`` is refused in this run's flow."""
        if option.backends == BLOCKS:
            return f"{option.name} is an option of language models' weight blocks (--preset {BLOCKS_PRESET})"
        if self.flow == "blocks":
            return f"{option.name} is not an option of language models' weight blocks (--preset {BLOCKS_PRESET})"
        owners = [t for t in _target_names() if _backend(t) in option.backends]
        named = " and ".join(filter(None, (", ".join(owners[:-1]), owners[-1])))
        plural = "s" if len(owners) > 1 else ""
        return f"{option.name} is an option of the {named} target{plural}, not of {self.target}"

    @property
    def flow(self) -> str:
        """Which stages run: the target's backend (``qdq``, ``tosa``, ``executorch``), or ``blocks`` for a
        global config of weight-only blocks (language models, :mod:`requant.stages.blocks`)."""
        quantizer = self.quantizer
        if quantizer is not None and quantizer.block_weights() is not None:
            return "blocks"
        return str(self.chosen_target.backend)

    @property
    def block_format(self) -> Any:
        """The blocks of the ``blocks`` flow: the preset's, with ``bits``, ``block_size`` and ``symmetric``."""
        from requant.llm.blocks import BlockFormat

        spec = self.quantizer.block_weights()
        bits = self.bits or int("".join(c for c in spec.dtype if c.isdigit()))
        if bits not in (4, 8):
            raise ArgumentError(f"weight blocks of {spec.dtype} ({bits} bits): MatMulNBits takes 4 or 8 bits")
        return BlockFormat(bits, self.block_size or spec.block_size, self.symmetric and spec.symmetric)

    @property
    def embedding_format(self) -> Any:
        """The embedding's blocks (``embedding_bits``, the layers' block size and symmetry), or None."""
        from requant.llm.blocks import BlockFormat

        fmt = self.block_format
        return None if self.embedding_bits is None else BlockFormat(self.embedding_bits, fmt.block_size, fmt.symmetric)

    def _resolved(self) -> Options:
        """The quantizer for the target's table (the model's default preset when none is given), and
        the method: ``"auto"`` unless the quantizer's configs name observers of their own."""
        from requant.quantizers import Quantizer

        quantizer = (self.quantizer or Quantizer().set_global_by_model()).for_table(self.chosen_target.table)
        if self.chosen_target.backend != "executorch":
            for config in quantizer.configs():
                if any(getattr(r, "dynamic", False) for r in (config.input_activation, config.output_activation)):
                    raise ArgumentError(f"{config} quantizes activations at run time (dynamic): only the "
                                        f"executorch-xnnpack target has such kernels, not {self.target}")  # fmt: skip
        chooses = self.method is None and not quantizer.names_observers() and self.flow != "blocks"
        method = DEFAULT_METHOD if chooses else self.method
        return _replace(self, quantizer=quantizer, method=method)

    @property
    def chosen_target(self) -> Any:
        from requant.targets.registry import get_target

        return get_target(self.target)

    @property
    def load_options(self) -> dict[str, Any]:
        """What the front door takes besides the model."""
        named = ("example_inputs", "dynamic_shapes", "fixed_inputs")
        return {name: getattr(self, name) for name in named if getattr(self, name) is not None}

    @property
    def measures_kernels(self) -> bool:
        """Whether each int8 kernel is measured against float (bias correction, and what reads it)."""
        return self.bias_correction or self.keep_float_below is not None or self.max_drop is not None

    def keeps_float_model(self) -> bool:
        """Whether the float model is kept serialized beside the run: always, since every output of the
        int8 model is checked against it (:mod:`requant.stages.outputs`)."""
        return True


def _replace(options: Options, **changes: Any) -> Options:
    values = {f.name: getattr(options, f.name) for f in fields(options)}
    return Options(**{**values, **changes})


def _has_labels(data: Any) -> bool:
    """Labels in ``data`` (a path: its labels array read alone); an iterable may give them as targets."""
    from requant.calibration.data import iterable
    from requant.calibration.samples import split_labels

    return iterable(data) or split_labels(data, set())[1] is not None


def check_table() -> None:
    """The table and :class:`Options` name the same options, with the same defaults."""
    names = [f.name for f in fields(Options) if not f.name.startswith("_")]
    assert names == [o.name for o in OPTIONS], names
    for f in fields(Options):
        if not f.name.startswith("_"):
            assert f.default == BY_NAME[f.name].default, f.name


check_table()


def preflight(options: Options, model: Any, calibration_data: Any) -> None:
    """The checks of what the options name on disk, before any work: the data are there (by part name, naming
    the model's parts, for a model of parts), and the output overwrites no input (a refused run writes nothing)."""
    from requant.calibration.data import check_exists, iterable
    from requant.frontends import check_outputs
    from requant.frontends.hf_parts import by_part, parts_of

    check_exists(calibration_data, "calibration")
    check_exists(options.eval_data, "evaluation")
    if options.transform is not None and not (iterable(calibration_data) or iterable(options.eval_data)):
        raise ArgumentError("transform applies to the items of iterable data (a DataLoader, a list, a generator); "
                            "neither the calibration nor the evaluation data is one")  # fmt: skip
    parted = parts_of(model)
    if parted:  # data by part name naming every part, before every part is exported (seconds each)
        by_part(calibration_data, parted, "calibration")
        by_part(options.eval_data, parted, "evaluation")
    if parted and options.output is not None and os.path.splitext(os.fspath(options.output))[1]:
        raise ArgumentError(f"'{model}' holds a model of parts ({', '.join(parted)}), each written as its own file: "
                            f"give a folder as the output, not '{options.output}'")  # fmt: skip
    if options.output is not None:
        check_outputs({"output": options.output}, {"the model": model, "the calibration data": calibration_data,
                                                   "the evaluation data": options.eval_data},
                      folders=("output",) if options.flow == "blocks" or parted else ())  # fmt: skip
