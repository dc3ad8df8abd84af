"""Stage blocks: a language model's linear layers as weight-only blocks of 4 or 8 bits (``MatMulNBits``),
calibrated on text: the flow of a weight-only block preset (``--preset INT4_BLOCKWISE_WEIGHTS``).

open the decoder (:mod:`requant.llm.decoder`) -> tokenize the calibration text into windows
(:mod:`requant.llm.text`) -> gather each linear layer's input moments on the
windows -> round each layer's weight by the rounding that leaves the least error on its output
(:mod:`requant.llm.rounding`) -> write ``MatMulNBits`` -> check the perplexity against float on held-out
windows (far: an alarm, ``--strict`` exits 3) -> with ``--eval TEXT``: perplexity -> the latency of a prefill
and of one decoding step, float and quantized, interleaved (unless ``--no-measure``; slower than float: an
alarm).

Records: ``llm`` (the model, the format, the calibration, each layer's rounding, the size, ``latency``; with
``--eval`` its ``evaluation``) and ``outputs`` (the held-out check).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx_ir as ir
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from requant.calibration.runner import terminal_progress
from requant.frontends import SaveError, save_onnx
from requant.llm.awq import ScaleSearch, groups
from requant.llm.blocks import BlockFormat
from requant.llm.decoder import Decoder, model_bytes, open_decoder
from requant.llm.memory import no_room
from requant.llm.moments import LayerMoments
from requant.llm.nbits import BudgetError, linear_weights, tied_gathers, to_matmul_nbits, weight_dims
from requant.llm.runs import PREFILL, latency_ms, nll_perplexity, sectioned_perplexity, session
from requant.llm.text import CALIBRATION_WINDOWS, EVALUATION_WINDOWS, WINDOW, load_tokenizer, read_text, token_windows

if TYPE_CHECKING:
    from requant.options import Options
    from requant.pipeline import QuantizedModel

__all__ = ["FAR", "METHODS", "Staged", "alarm_lines", "lines", "quantize_blocks", "scale_search", "tied_format"]

# natural-order GPTQ never won a layer where both were tried (MiniLM 36 of 36, SmolLM2 150 of 150 to
# activation order): not tried by default (it took a third of the rounding time). The clipping search's
# scales (clip, clip_gptq) won 117 of SmolLM2's 151 layers: perplexity 23.82 -> 21.96 (4 bits, blocks of 128).
# With the activation-aware scales GPTQ at the weights' own ranges won 3 of 151 and its pass took 9 s of 41:
# not tried (evaluation +1.78 with it, +1.76 without)
METHODS = ("nearest", "clip", "clip_gptq")
CHECK_WINDOWS = 4  # calibration windows held out to check the perplexity (when there are 3x as many)
FAR = 1.5  # a quantized perplexity this many times float's is an alarm (4-bit nearest, blocks of 128: 1.29)


class Staged:
    """The quantized model written to a temporary folder (its ``.onnx``, external data and the files of
    its onnxruntime-genai folder), which sessions read and :meth:`save` copies."""

    def __init__(self, decoder: Decoder) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="requant-blocks-")
        self.folder = Path(self._folder.name)
        self.model_path = self.folder / decoder.path.name
        self.ir_model = decoder.model
        try:
            ir.save(decoder.model, self.model_path, external_data=decoder.path.name + ".data")
            if decoder.folder is not None:  # its configuration and tokenizer, not its models nor their data
                for item in sorted(decoder.folder.iterdir()):
                    if item.is_file() and item.suffix not in (".onnx", ".data") and not item.name.startswith("."):
                        shutil.copy2(item, self.folder / item.name)
        except OSError as exc:  # (a full disk)
            raise no_room(exc, self.folder) from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """A path ending in ``.onnx``: the model there, its weights in ``<name>.data`` beside it; any other: a
        folder (made if need be) with the model and the files of its onnxruntime-genai folder, written whole or
        not at all (temporary files, then renames; other files there are left alone)."""
        target = Path(path)
        if target.suffix == ".onnx":  # read back from the staged copy (the source's folder may be gone by now)
            save_onnx(ir.load(self.model_path), target, external_data=True)
            return
        if target.exists() and not target.is_dir():
            raise SaveError(f"'{target}' is a file: a language model is written to a folder (or to a path ending "
                            "in .onnx)")  # fmt: skip
        staged: list[tuple[Path, Path]] = []
        try:
            target.mkdir(parents=False, exist_ok=True)
            for item in sorted(self.folder.iterdir()):  # every file copied first, then all renamed: whole or none
                staged.append((target / f".{item.name}.{os.getpid()}.partial", target / item.name))
                shutil.copyfile(item, staged[-1][0])
            for partial, final in staged:
                partial.replace(final)
        except OSError as exc:
            raise SaveError(f"could not write the model to '{target}': {exc.strerror or exc}") from None
        finally:
            for partial, _ in staged:
                partial.unlink(missing_ok=True)


def _split(windows: list[Any]) -> tuple[list[Any], list[Any], bool]:
    """(calibration windows, check windows, whether the check's are held out)."""
    if len(windows) >= 3 * CHECK_WINDOWS:
        return windows[:-CHECK_WINDOWS], windows[-CHECK_WINDOWS:], True
    return windows, windows[:CHECK_WINDOWS], False


def _moments(decoder: Decoder, windows: list[Any], held: list[Any], keep: Path | None, progress: Any,
             scales: ScaleSearch) -> LayerMoments:  # fmt: skip
    """Each linear layer's ``sum x x^T`` by node name (layers reading one value share it), gathered a section
    at a time as the rounding asks (:mod:`requant.llm.moments`), each section's searched for activation-aware
    scales first (``scales``); ``held`` windows carried for their logits."""
    graph = decoder.model.graph
    layers = {name: str(node.inputs[0].name) for name, (node, _) in linear_weights(graph).items()}  # type: ignore[union-attr]
    moments = LayerMoments(decoder, layers, windows, held, keep, prepare=scales)
    moments.progress = progress or terminal_progress("calibrating and rounding", len(moments.sections), "sections")
    return moments


def scale_search(graph: ir.Graph, fmt: BlockFormat, folder: Path | None = None) -> ScaleSearch:
    """The activation-aware scale search (:mod:`requant.llm.awq`) of ``graph``'s layers rounded in ``fmt`` (not
    those tied to an embedding, nor those shorter than a block), the scaled weights kept in ``folder`` (held in
    memory without one)."""
    ties = tied_gathers(graph)
    linear = linear_weights(graph, ties)
    rounded = {
        name for name, (_, w) in linear.items() if str(w.name) not in ties and weight_dims(w)[0] >= fmt.block_size
    }
    return ScaleSearch(linear, groups(linear, rounded), dict.fromkeys(rounded, fmt), folder)


def _check(decoder: Decoder, moments: LayerMoments, staged: Staged, windows: list[Any],
           held_out: bool) -> dict[str, Any]:  # fmt: skip
    """Float's perplexity on the held-out windows (their logits came through the moments' pass) against the
    quantized model's, run a section at a time."""
    before = nll_perplexity(moments.held_nll, windows)
    after = sectioned_perplexity(decoder, ir.load(staged.model_path), staged.folder, windows)
    ratio = after / before
    checked: dict[str, Any] = {"windows": len(windows), "held_out": held_out, "float_perplexity": before,
                               "perplexity": after, "ratio": ratio, "poor": []}  # fmt: skip
    if not ratio <= FAR:  # (NaN too)
        checked["poor"].append(f"perplexity {after:.2f} against float's {before:.2f} on the calibration text "
                               f"({ratio:.2f}x; more than {FAR}x is far)")  # fmt: skip
    return checked


def _evaluate(decoder: Decoder, staged: Staged, text: Any, tokenizer: Any) -> dict[str, Any]:
    """Perplexity on the evaluation text, float and quantized, each run a section at a time."""
    windows = token_windows(read_text(text, "evaluation"), tokenizer, EVALUATION_WINDOWS, "evaluation")
    before, after = (sectioned_perplexity(decoder, ir.load(path), path.parent, windows)
                     for path in (decoder.path, staged.model_path))  # fmt: skip
    return {"windows": len(windows), "tokens": sum(w.shape[1] for w in windows), "float_perplexity": before,
            "perplexity": after, "increase": after - before}  # fmt: skip


def _latency(decoder: Decoder, runs: list[Any], prompt: Any) -> dict[str, Any]:
    """A prefill of ``prompt`` and one decoding step, float and quantized, interleaved."""
    ms = latency_ms(decoder, runs, prompt[:, :PREFILL])
    return {step: {"float_ms": f, "quantized_ms": q, "ratio": q / f} for step, (f, q) in ms.items()}


def alarm_lines(report: Mapping[str, Any]) -> list[str]:
    """The summary's first line when the quantized decoder decodes no faster than float."""
    decode = report.get("llm", {}).get("latency", {}).get("decode")
    if not decode or decode["ratio"] < 1:
        return []
    return [f"SLOWER THAN FLOAT: one decoding step takes {decode['ratio']:.2f}x the float model's time "
            f"({decode['quantized_ms']:.1f} ms against {decode['float_ms']:.1f} ms, interleaved)"]  # fmt: skip


def _format(fmt: BlockFormat) -> dict[str, Any]:
    storage = f"{'i' if fmt.symmetric else 'u'}{fmt.bits}"
    return {"bits": fmt.bits, "block_size": fmt.block_size, "symmetric": fmt.symmetric,
            "type": f"!quant.uniform<{storage}:f32:{{0:{fmt.block_size}}}, ...>"}  # fmt: skip


def quantize_blocks(model: Any, calibration_data: Any, options: Options, started: float) -> QuantizedModel:
    """The flow of this module (see its docstring): a :class:`~requant.pipeline.QuantizedModel` whose
    ``staged`` folder holds the quantized model."""
    from requant.pipeline import QuantizedModel  # (it imports this module's flow)

    fmt = options.block_format
    decoder = open_decoder(model, options.tokenizer)
    tokenizer = load_tokenizer(decoder.tokenizer)
    windows = token_windows(read_text(calibration_data, "calibration"), tokenizer, CALIBRATION_WINDOWS, "calibration")
    calibration, check_windows, held_out = _split(windows)
    seconds, lap = _laps()
    max_bytes = None if options.max_size is None else int(options.max_size * 1e6)
    with tempfile.TemporaryDirectory(prefix="requant-blocks-") as folder:  # the moments a budget reads again, and
        kept = Path(folder)  # the rounded layers' blocks (memory-mapped until the model is written)
        scales = scale_search(decoder.model.graph, fmt, kept)
        moments = _moments(decoder, calibration, check_windows, kept if max_bytes else None, options.progress, scales)
        with threadpool_limits(limits=os.cpu_count(), user_api="blas"):  # no ONNX Runtime session spins meanwhile
            records = to_matmul_nbits(decoder.model, fmt, moments, METHODS, None,
                                      options.embedding_format or tied_format(fmt), max_bytes, _framing(decoder),
                                      kept, options.embedding_format)  # fmt: skip
        moments.finish()
        embeddings = [r for r in records if "table" in r]  # an untied embedding's record
        records = [r for r in records if "table" not in r]
        lap("rounding")
        rounded = seconds.pop("rounding") - moments.seconds  # the two interleave: the moments' time is their own
        seconds["moments"], seconds["rounding"] = moments.seconds, rounded
        staged = Staged(decoder)
        lap("writing")
    written = model_bytes(staged.model_path)
    if max_bytes is not None and written > max_bytes:  # the plan counts the weights, not the file's framing
        raise BudgetError(f"the quantized model takes {written / 1e6:.2f} MB, more than --max-size "
                          f"{max_bytes / 1e6:.2f} MB (nothing written)")  # fmt: skip
    report: dict[str, Any] = {"target": options.target, "target_description": options.chosen_target.description}
    chosen = Counter(r["rounding"]["chosen"] for r in records if "rounding" in r)
    report["llm"] = {"model": str(decoder.path), "exported": decoder.exported, "format": _format(fmt),
                     "scales": scales.records,
                     "calibration": {"windows": len(calibration), "window": WINDOW,
                                     "tokens": sum(w.shape[1] for w in calibration)},
                     "roundings": dict(sorted(chosen.items())), "layers": records, "embeddings": embeddings,
                     "size": {"float_bytes": model_bytes(decoder.path), "quantized_bytes": written,
                              "max_bytes": max_bytes}}  # fmt: skip
    report["outputs"] = _check(decoder, moments, staged, check_windows, held_out)
    lap("check")
    if options.eval_data is not None:
        report["llm"]["evaluation"] = _evaluate(decoder, staged, options.eval_data, tokenizer)
        lap("evaluation")
    if options.measure:  # always (unless --no-measure): a decoder slower than float is said first; whole models
        runs = [session(str(decoder.path)), session(str(staged.model_path))]
        report["llm"]["latency"] = _latency(decoder, runs, check_windows[0])
        lap("latency")
    report["llm"]["seconds"] = seconds
    report["quantize_seconds"] = time.perf_counter() - started
    from requant.stages.report import summary

    report["summary"] = summary(report)
    return QuantizedModel(staged.ir_model, report, staged=staged)


# bytes of the model's file a linear layer adds beyond its tensors once it is MatMulNBits: the node, its
# attributes, three tensors' names and external-data entries (SmolLM2: about 155 per layer, 171 -> 203 KB)
LAYER_FRAMING = 512


def _framing(decoder: Decoder) -> int:
    """What the quantized model's files will hold beyond its tensors, at most: the float model's (its files
    less its tensors) and ``LAYER_FRAMING`` per linear layer (a size budget plans the tensors)."""
    graph = decoder.model.graph
    tensors = sum(v.const_value.nbytes for v in graph.initializers.values() if v.const_value is not None)
    return model_bytes(decoder.path) - tensors + LAYER_FRAMING * len(linear_weights(graph))


def tied_format(fmt: BlockFormat) -> BlockFormat | None:
    """The format of an LM head tied to the embedding: 8 bits when the others have 4. Stored once for both
    (``GatherBlockQuantized`` reads the LM head's blocks), they still take a quarter of the float embedding
    another tool keeps beside a 4-bit head; at 4 bits the two cost SmolLM2 1.0 (the embedding) and 1.4 (the
    head) of perplexity."""
    return BlockFormat(8, fmt.block_size, fmt.symmetric) if fmt.bits == 4 else None


def _laps() -> tuple[dict[str, float], Callable[[str], None]]:
    """A record of seconds by step, and the function that closes a step (the time since the last one)."""
    seconds: dict[str, float] = {}
    last = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        seconds[name], last[0] = now - last[0], now

    return seconds, lap


def _scale_lines(groups: list[dict[str, Any]]) -> list[str]:
    if not groups:
        return []
    alphas = sorted(g["alpha"] for g in groups if g["alpha"] > 0)
    if not alphas:
        return [
            f"activation-aware scales: none of {len(groups)} groups of layers gained from scaling (kept as they were)"
        ]
    ratios = sorted(g["error_ratio"] for g in groups)
    return [f"activation-aware scales: {len(alphas)} of {len(groups)} groups of layers scaled (alpha {alphas[0]:g}-"
            f"{alphas[-1]:g}; their nearest rounding's output error x{ratios[len(ratios) // 2]:.2f} at the median), "
            "1/s folded into what makes their input (a normalization, or the layer before a Mul)"]  # fmt: skip


def _embedding_lines(embeddings: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in embeddings:
        shape = f"{e['n']} x {e['k']}, {e['bytes'] / 1e6:.1f} MB float"
        if "float" not in e:
            out.append(f"embedding {e['table']} ({shape}): {e['bits']}-bit blocks of its own, read by a "
                       f"GatherBlockQuantized ({e['how']}; SQNR {e['sqnr_db']:.1f} dB)")  # fmt: skip
        elif "bits" in e:
            out.append(f"embedding {e['table']} ({shape}) kept float: {e['float']}")
        else:
            out.append(f"embedding {e['table']} ({shape}) kept float, untied from the LM head: --embedding-bits 8 "
                       "(or 4) stores it in blocks")  # fmt: skip
    return out


def lines(report: Mapping[str, Any]) -> list[str]:
    """The summary's lines of this flow."""
    llm = report.get("llm")
    if not llm or "layers" not in llm:
        return []
    fmt, layers = llm["format"], llm["layers"]
    kind = "symmetric" if fmt["symmetric"] else "asymmetric"
    rounded = ", ".join(f"{k} {v}" for k, v in llm["roundings"].items())
    by_bits = Counter(r.get("bits", fmt["bits"]) for r in layers if "rounding" in r)
    done = " and ".join(f"{n} in {b}-bit" for b, n in sorted(by_bits.items(), key=lambda kv: kv[0] != fmt["bits"]))
    out = [f"language model: {sum(by_bits.values())} of {len(layers)} linear layers in {kind} blocks of "
           f"{fmt['block_size']} (MatMulNBits): {done}; rounding chosen per layer: {rounded}"]  # fmt: skip
    out.extend(_scale_lines(llm.get("scales", [])))
    floats = [r["node"] for r in layers if "float" in r]
    if floats:
        out.append(f"kept float: {', '.join(floats[:4])}{', ...' if len(floats) > 4 else ''} (shorter than a block)")
    for layer in layers:
        for gather, how in layer.get("tied", {}).items():
            bits = f"{layer['bits']} bits, " if layer.get("bits", fmt["bits"]) != fmt["bits"] else ""
            out.append(
                f"tied embedding: {layer['node']} ({bits}its table) and {gather}, a GatherBlockQuantized that {how}"
            )
    out.extend(_embedding_lines(llm.get("embeddings", [])))
    size = llm["size"]
    out.append(f"size: {size['float_bytes'] / 1e6:.1f} MB -> {size['quantized_bytes'] / 1e6:.1f} MB")
    wider = [r["node"] for r in layers if "budget" in r]
    if size.get("max_bytes") is not None:
        named = f": {', '.join(wider[:4])}{', ...' if len(wider) > 4 else ''}" if wider else ""
        out.append(f"size budget {size['max_bytes'] / 1e6:.1f} MB: {len(wider)} layers at 8 bits (the most 4-bit "
                   f"output error per byte){named}")  # fmt: skip
    steps = ", ".join(f"{step} {t:.1f} s" for step, t in llm.get("seconds", {}).items())
    if steps:
        out.append(f"time: {steps}")
    checked = report["outputs"]
    where = "held-out calibration windows" if checked["held_out"] else "calibration windows (too few to hold some out)"
    out.append(f"perplexity on {checked['windows']} {where}: float {checked['float_perplexity']:.2f}, "
               f"quantized {checked['perplexity']:.2f} ({checked['ratio']:.3f}x)")  # fmt: skip
    evaluation = llm.get("evaluation")
    if evaluation:
        out.append(f"evaluation ({evaluation['windows']} windows, {evaluation['tokens']} tokens): perplexity "
                   f"{evaluation['float_perplexity']:.2f} -> {evaluation['perplexity']:.2f} "
                   f"(+{evaluation['increase']:.2f})")  # fmt: skip
    for step, t in llm.get("latency", {}).items():
        what = f"prefill of {PREFILL} tokens" if step == "prefill" else "one decoding step"
        out.append(f"latency, {what}: {t['float_ms']:.1f} ms float, {t['quantized_ms']:.1f} ms quantized "
                   f"({t['ratio']:.2f}x)")  # fmt: skip
    return out
