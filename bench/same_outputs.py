"""The same outputs before and after a restructuring: quantize a fixed set of models with a fixed set of
options and record a digest of every quantized model (its bytes; the MLIR text for tosa-int8) and of its
report (timing fields aside), then compare with a recorded run.

    python bench/same_outputs.py --write bench/results/same_outputs.json   # record (before)
    python bench/same_outputs.py --check bench/results/same_outputs.json   # compare (after)

Cases cover the paths ``quantize`` composes: the digits CNN (``method="auto"``, an explicit method, the
accuracy budget, ``keep_float_below``, every evening step off, a generator as calibration source, the
VNNI target, ``tosa-int8`` with its options, the CLI with a ``--config`` file), MobileNetV2,
EfficientNet-Lite0 (and MobileNetV2 on tosa-int8) on the bench's photo crops, and all-MiniLM-L6-v2 on
its sentences. Timing fields (latency, seconds) are replaced by a placeholder: a report must keep them,
not their values. Exit 1 when a digest differs, naming the case and what differs.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.models: the model classes

DIGITS = ROOT / "examples" / "digits"
TIMED = {"quantize_seconds", "latency_ms_batch1", "latency_ms", "latency_ms_before", "speed"}
# summary and page lines whose figures are timings (the speed stage's say whether int8 measured slower)
TIMED_LINE = re.compile(r"(latency|quantized in|re-quantizations|SLOWER THAN FLOAT|^speed: )")


WITHOUT: set[str] = set()  # report sections left out of the digests (--without)


def _untimed(value: Any, top: bool = True) -> Any:
    """The report with every timing replaced by a placeholder (the key kept), the sections of
    ``WITHOUT`` left out."""
    if isinstance(value, dict):
        return {k: ("<timed>" if k in TIMED else _untimed(v, False)) for k, v in value.items()
                if not (top and k in WITHOUT)}  # fmt: skip
    if isinstance(value, list):
        return [_untimed(v, False) for v in value]
    if isinstance(value, str) and "\n" in value:
        return "\n".join(line for line in value.splitlines() if not TIMED_LINE.search(line))
    return value


def _digest(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def _result_digests(result: Any, mlir: bool = False) -> dict[str, str]:
    import onnx_ir as ir

    report = json.dumps(_untimed(result.report), sort_keys=True, default=str)
    model = ir.serde.serialize_model(result.model).SerializeToString()
    out = {"model": _digest(model), "report": _digest(report)}
    if mlir:
        out["mlir"] = _digest(result.mlir())
    from requant.report.markdown import to_markdown

    out["markdown"] = _digest(_untimed(to_markdown(result.report) + "\n"))
    return out


def _digits(**options: Any) -> Callable[[], dict[str, str]]:
    def run() -> dict[str, str]:
        import requant

        result = requant.quantize(DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", **options)
        return _result_digests(result, mlir=options.get("target") == "tosa-int8")

    return run


def _digits_generator() -> dict[str, str]:
    import requant

    def samples() -> Iterator[dict[str, np.ndarray]]:
        x = np.load(DIGITS / "calib.npz")["x"]
        for i in range(len(x)):
            yield {"x": x[i : i + 1]}

    result = requant.quantize(DIGITS / "digits_cnn.onnx", samples(), eval_data=DIGITS / "eval.npz", measure=False)
    return _result_digests(result)


CONFIG = """
calib = "{calib}"
eval = "{eval}"
preset = "INT8_PER_CHANNEL_WEIGHTS"
method = "percentile"
keep_float_below = 30

[[override]]
node = "node_linear"
config = "float"
"""


def _digits_cli() -> dict[str, str]:
    from requant.cli.main import main

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        config = out / "requant.toml"
        config.write_text(CONFIG.format(calib=DIGITS / "calib.npz", eval=DIGITS / "eval.npz"))
        args = ["quantize", str(DIGITS / "digits_cnn.onnx"), "-o", str(out / "m.onnx"), "--config", str(config),
                "--report-json", str(out / "r.json"), "--report-md", str(out / "r.md")]  # fmt: skip
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = main(args)
        report = json.loads((out / "r.json").read_text())
        text = printed.getvalue().replace(folder, "<tmp>")
        return {
            "exit": str(code),
            "model": _digest((out / "m.onnx").read_bytes()),
            "report": _digest(json.dumps(_untimed(report), sort_keys=True)),
            "markdown": _digest(_untimed((out / "r.md").read_text())),
            "printed": _digest(_untimed(text)),
        }


def _on_crops(make: str, target: str = "onnxruntime-cpu", calibration: int = 64) -> Callable[[], dict[str, str]]:
    def run() -> dict[str, str]:
        from tests.models import on_crops

        import requant

        model, calib, evaluation = on_crops(make, calibration, 32, seed=7)
        result = requant.quantize(model, calib, eval_data=evaluation, target=target, measure=False)
        return _result_digests(result, mlir=target == "tosa-int8")

    return run


def _minilm() -> dict[str, str]:
    from tests.models.minilm import export_minilm

    import requant

    model, samples = export_minilm(60)
    result = requant.quantize(model, samples[:40], eval_data=samples[40:], measure=False)
    return _result_digests(result)


def _clipping() -> Any:
    """The digits CNN with its first conv's output clipped (a percentile of 60): the budget's tries."""
    import dataclasses

    from requant.ir.requests import QuantizationSpec
    from requant.quantizers import INT8_PER_CHANNEL_WEIGHTS, Quantizer

    spec = QuantizationSpec("uint8", observer="percentile", observer_options={"percentile": 60.0})
    clipped = dataclasses.replace(INT8_PER_CHANNEL_WEIGHTS, output_activation=spec)
    return Quantizer().set_global_by_model().set_node_name("node_conv2d", clipped)


EVAL = DIGITS / "eval.npz"
CASES: dict[str, Callable[[], dict[str, str]]] = {
    "digits auto": _digits(eval_data=EVAL, measure=False),
    "digits auto, measured": _digits(eval_data=EVAL),
    "digits minmax": _digits(method="minmax", eval_data=EVAL, measure=False),
    "digits budget": _digits(eval_data=EVAL, max_drop=0.0, metric="top1"),
    "digits budget with tries": _digits(quantizer=_clipping(), eval_data=EVAL, max_drop=0.0, metric="top1"),
    "digits keep_float_below": _digits(keep_float_below=45.0, measure=False),
    "digits nothing evened": _digits(smoothing=0, equalization=False, bias_correction=False, measure=False),
    "digits generator": _digits_generator,
    "digits vnni": _digits(target="onnxruntime-cpu-vnni", eval_data=EVAL, measure=False),
    "digits tosa": _digits(target="tosa-int8", eval_data=EVAL, measure=False),
    "digits tosa double_round 16 bits": _digits(
        target="tosa-int8", rounding="double_round", accumulator_bits=16, measure=False
    ),
    "digits cli config": _digits_cli,
    "mobilenet_v2": _on_crops("mobilenet_v2"),
    "efficientnet_lite0": _on_crops("efficientnet_lite0"),
    "mobilenet_v2 tosa": _on_crops("mobilenet_v2", "tosa-int8", 32),
    "minilm": _minilm,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--write", metavar="FILE", help="record the digests")
    which.add_argument("--check", metavar="FILE", help="compare with recorded digests")
    parser.add_argument("--only", metavar="TEXT", help="run the cases whose name contains TEXT")
    parser.add_argument("--without", metavar="KEYS", default="",
                        help="report sections to leave out (comma-separated): a change that adds a section "
                        "shows the rest unchanged")  # fmt: skip
    args = parser.parse_args()
    WITHOUT.update(k for k in args.without.split(",") if k)
    import logging

    logging.basicConfig(level=logging.WARNING)
    got: dict[str, dict[str, str]] = {}
    for name, case in CASES.items():
        if args.only and args.only not in name:
            continue
        got[name] = case()
        print(f"{name}: {got[name]}", flush=True)
    if args.write:
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write).write_text(json.dumps(got, indent=2) + "\n")
        return 0
    recorded = json.loads(Path(args.check).read_text())
    differ = [
        f"{name}: {key} differs" for name, digests in got.items() for key, value in digests.items()
        if recorded.get(name, {}).get(key) != value
    ]  # fmt: skip
    print("\n".join(differ) or f"the same: {len(got)} cases, every digest")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
