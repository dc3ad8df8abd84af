"""A Hugging Face folder of a model of parts in (Whisper: encoder and decoder; CLIP: text and vision towers), each part
exported, calibrated on what it reads of the data and quantized as a model of its own; a folder out with a file per
part under Optimum's names, and the check of the parts together as their users run them (greedy transcripts,
zero-shot matches). Random weights (transformers configs): these find crashes, not accuracy."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

import requant
from requant.cli import main
from requant.cli.quantize_cmd import _poor
from requant.errors import RequantError
from requant.frontends import LoadError
from requant.frontends.audio import read_wav
from requant.frontends.hf_parts import DECODE_TOKENS, edits, load_parts
from requant.stages.report import parts_summary
from tests.models.whisper import save_whisper
from tests.test_hf_audio import _clips

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy.io.wavfile")
Image = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Whisper (2 + 2 layers of 64, 120 tokens, seeded) with its feature extractor's settings, saved."""
    return save_whisper(tmp_path_factory.mktemp("whisper"))


def _greedy(encoder: ort.InferenceSession, decoder: ort.InferenceSession, features: np.ndarray) -> list[int]:
    (hidden,) = encoder.run(None, {"input_features": features})
    ids = np.array([[1]], np.int64)
    while ids.shape[1] <= DECODE_TOKENS and ids[0, -1] != 2:
        logits = decoder.run(None, {"input_ids": ids, "encoder_hidden_states": hidden})[0]
        ids = np.concatenate([ids, [[int(np.argmax(logits[0, -1]))]]], 1)
    return ids[0].tolist()


def test_a_whisper_folder_and_wav_files_give_an_encoder_and_a_decoder_that_transcribe_as_float_does(
    whisper: Path, tmp_path: Path
) -> None:
    """The CLI writes encoder_model.onnx and decoder_model.onnx (Optimum's names) beside the folder's configuration;
    the decoder was calibrated on the float model's greedy tokens; its own transcripts of 4 held-out clips, run in
    ONNX Runtime as a user's loop runs them, equal the float parts' on at least 3 (measured: 4 of 4, as the
    report's check of the parts together says)."""
    _clips(tmp_path / "calib", 8, 1)
    clips = _clips(tmp_path / "eval", 4, 2)
    out, printed = tmp_path / "int8", io.StringIO()
    with redirect_stdout(printed):
        code = main(["quantize", str(whisper), "-o", str(out), "--calib", str(tmp_path / "calib"),
                     "--eval", str(tmp_path / "eval"), "--no-measure"])  # fmt: skip
    assert code == 0, printed.getvalue()
    assert {p.name for p in out.iterdir()} >= {"encoder_model.onnx", "decoder_model.onnx", "config.json",
                                               "preprocessor_config.json", "requant.toml", "report.json"}  # fmt: skip
    assert not (out / "model.onnx").exists()
    report = json.loads((out / "report.json").read_text())
    assert sorted(report["parts"]) == ["decoder_model", "encoder_model"]  # (the JSON report's keys sorted)
    assert "greedy tokens" in report["parts"]["decoder_model"]["model_source"]
    together = report["together"]
    assert together["check"] == "greedy transcripts" and together["samples"] == 4 and together["identical"] >= 3
    assert together["token_error_rate"] < 0.2 and not together["poor"]  # measured: 0.0
    assert "greedy transcripts (evaluation data, 4 clips" in printed.getvalue()

    def session(path: Path) -> ort.InferenceSession:
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    extractor = transformers.AutoFeatureExtractor.from_pretrained(out)
    pair = (session(out / "encoder_model.onnx"), session(out / "decoder_model.onnx"))
    model = transformers.WhisperForConditionalGeneration.from_pretrained(whisper).eval()
    same = 0
    for clip in clips:
        features = extractor(read_wav(clip, 16000), sampling_rate=16000, return_tensors="np")["input_features"]
        ints = _greedy(*pair, features.astype(np.float32))
        with torch.no_grad():
            hidden = model.get_encoder()(torch.from_numpy(features)).last_hidden_state
            ids = torch.tensor([[1]])
            while ids.shape[1] <= DECODE_TOKENS and int(ids[0, -1]) != 2:
                step = model(encoder_outputs=(hidden,), decoder_input_ids=ids, use_cache=False).logits[:, -1]
                ids = torch.cat([ids, step.argmax(-1, keepdim=True)], 1)
        same += ints == ids[0].tolist()
    assert same >= 3


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CLIP (2 + 2 layers of 32, 32x32 images, seeded) with a character-level tokenizer and its image processor's
    settings, saved; beside it, folders of photo crops with a file of captions."""
    root = tmp_path_factory.mktemp("clip")
    folder = root / "clip"
    folder.mkdir()
    chars = list("abcdefghijklmnopqrstuvwxyz,.!?'")
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    transformers.CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt")).save_pretrained(folder)
    torch.manual_seed(0)
    ends = {"bos_token_id": vocab["<|startoftext|>"], "eos_token_id": vocab["<|endoftext|>"],
            "pad_token_id": vocab["<|endoftext|>"]}  # fmt: skip
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77, **ends),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=16, architectures=["CLIPModel"],
    )  # fmt: skip
    transformers.CLIPModel(config).save_pretrained(folder)
    size = {"shortest_edge": 32}
    transformers.CLIPImageProcessor(size=size, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    words = ["a temple", "a flower", "a garden", "the sky", "a red flower", "a roof", "trees", "a bee", "petals",
             "a wall", "a pagoda", "leaves"]  # fmt: skip
    for name, count, seed in (("calib", 12, 1), ("eval", 6, 2)):
        (root / name).mkdir()
        rng = np.random.default_rng(seed)
        for i in range(count):
            photo, side = photos[i % 2], int(rng.integers(80, 300))
            top, left = rng.integers(0, photo.shape[0] - side), rng.integers(0, photo.shape[1] - side)
            Image.fromarray(photo[top : top + side, left : left + side]).save(root / name / f"img{i:02d}.png")
        (root / name / "captions.txt").write_text("\n".join(f"a photo of {w}." for w in words[:count]) + "\n")
    return folder


def test_a_clip_folder_and_a_folder_of_images_and_captions_give_two_towers_that_match_as_float_does(
    clip: Path, tmp_path: Path
) -> None:
    """One folder of photo crops and a captions file calibrates both towers (the text part reads the captions
    through the folder's tokenizer, the vision part the images through its image processor); the written towers run
    in ONNX Runtime on a caption length no sample had and a batch of images; the caption each held-out image matches
    best is float's for all 6 (measured); the requant.toml replayed gives the same bytes."""
    result = requant.quantize(clip, clip.parent / "calib", eval_data=clip.parent / "eval", measure=False,
                              output=tmp_path / "int8")  # fmt: skip
    assert result.model is None and result.parts is not None and list(result.parts) == ["text_model", "vision_model"]
    together = result.report["together"]
    assert together == {"check": "zero-shot matches", "data": "evaluation", "samples": 6, "captions": 6,
                        "identical": 6, "poor": False}  # fmt: skip
    for name in ("text_model", "vision_model"):
        part = result.report["parts"][name]
        assert part["evaluation"]["cosine_similarity"] > 0.99 and "feature extraction" in part["model_source"]
    reading = ort.InferenceSession(str(tmp_path / "int8" / "text_model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([[62, 5, 6, 7, 8, 9, 10, 11, 12, 63]] * 3, np.int64)
    (text,) = reading.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    seeing = ort.InferenceSession(str(tmp_path / "int8" / "vision_model.onnx"), providers=["CPUExecutionProvider"])
    (image,) = seeing.run(None, {"pixel_values": np.zeros((5, 3, 32, 32), np.float32)})
    assert text.shape == (3, 16) and image.shape == (5, 16)

    out, printed = tmp_path / "cli", io.StringIO()
    with redirect_stdout(printed):
        assert main(["quantize", str(clip), "-o", str(out), "--calib", str(clip.parent / "calib"), "--no-measure"]) == 0
        assert main(["quantize", str(clip), "--config", str(out / "requant.toml"), "-o", str(tmp_path / "again")]) == 0
    for name in ("text_model.onnx", "vision_model.onnx"):
        assert (out / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    assert {"tokenizer.json", "preprocessor_config.json", "config.json"} <= {p.name for p in out.iterdir()}
    assert "zero-shot matches (calibration data)" in printed.getvalue()


def test_a_model_of_parts_takes_data_by_part_name_and_is_refused_as_one_file_with_nothing_written(
    clip: Path, tmp_path: Path
) -> None:
    """A dict by part name gives each part its own data (token arrays for the text part here); a part it leaves out
    and a key that is no part are errors naming them before any work (from the folder's configuration alone), and so
    is text for a folder without a tokenizer's files; ``-o x.onnx`` is refused before any work, by the API and the
    CLI; --dry-run plans each part."""
    rng = np.random.default_rng(0)
    tokens = [{"input_ids": np.concatenate([[[62]], rng.integers(0, 62, (1, 6)), [[63]]], 1).astype(np.int64),
               "attention_mask": np.ones((1, 8), np.int64)} for _ in range(8)]  # fmt: skip
    result = requant.quantize(clip, {"text_model": tokens, "vision_model": clip.parent / "calib"}, measure=False)
    assert result.parts is not None and result.report["together"] == {}  # no captions and images together
    config_only = tmp_path.parent / f"{tmp_path.name}_config"  # refused from the configuration, before any export:
    config_only.mkdir()  # its weights are not read (a truncated file, which would fail to load)
    (config_only / "config.json").write_bytes((clip / "config.json").read_bytes())
    (config_only / "model.safetensors").write_bytes((clip / "model.safetensors").read_bytes()[:100])
    with pytest.raises(LoadError, match="names parts \\(text_model\\) but not 'vision_model' \\(the model's parts: "):
        requant.quantize(config_only, {"text_model": tokens}, measure=False)
    with pytest.raises(LoadError, match="'vison_model' is not one of the model's \\(its parts: text_model, vision_"):
        requant.quantize(config_only, {"text_model": tokens, "vison_model": tokens}, eval_data=tokens)
    bare = tmp_path.parent / f"{tmp_path.name}_bare"  # no tokenizer files: transformers would still make a tokenizer
    bare.mkdir()  # (of a vocabulary of 2, from the config alone), which would turn every caption into unknown tokens
    for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
        (bare / name).write_bytes((clip / name).read_bytes())
    with pytest.raises(LoadError, match="the calibration text cannot be read: '.*' has no tokenizer"):
        requant.quantize(bare, clip.parent / "calib", measure=False)
    with pytest.raises(RequantError, match="give a folder as the output"):
        requant.quantize(clip, clip.parent / "calib", output=tmp_path / "x.onnx")
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert main(["quantize", str(clip), "-o", str(tmp_path / "y.onnx"), "--calib", str(clip.parent / "calib")]) == 1
        assert main(["quantize", str(clip), "--dry-run"]) == 0
    assert list(tmp_path.iterdir()) == []
    plan = printed.getvalue()
    assert "== text_model" in plan and "== vision_model" in plan and plan.count("would quantize:") == 2


def test_the_parts_together_are_an_alarm_when_a_tower_matches_other_captions_than_float(clip: Path) -> None:
    """The check of the parts together on the float towers finds every best caption float's, no alarm; with the
    vision tower's projection redrawn (a tower that computes other embeddings), most images match another caption:
    the summary's first line is NOT USABLE AS IS, and --strict's exit code says so. Token edits, as the Whisper
    check counts changed tokens."""
    parted = load_parts(clip)
    models = {part.name: part.model for part in parted.parts}
    same = parted.check(models, clip.parent / "eval", "evaluation")
    assert same["identical"] == same["samples"] == 6 and not same["poor"]
    other = models["vision_model"].clone()
    projection = other.graph.initializers["visual_projection.weight"]  # [16, 32], a Gemm's (transB)
    projection.const_value = ir.tensor(np.random.default_rng(0).normal(size=(16, 32)).astype(np.float32))
    moved = parted.check({**models, "vision_model": other}, clip.parent / "eval", "evaluation")
    assert moved["identical"] < 0.8 * 6 and moved["poor"]
    report = {"parts": {"text_model": {"summary": "t"}, "vision_model": {"summary": "v"}}, "together": moved}
    assert parts_summary(report).startswith("NOT USABLE AS IS: the parts together, zero-shot matches")
    assert _poor(report) and not _poor({**report, "together": same})
    assert parts_summary({**report, "together": same}).startswith("a model of 2 parts")
    assert edits([1, 2, 3, 4], [1, 3, 4, 5]) == 2 and edits([], [7]) == 1 and edits([5, 6], [5, 6]) == 0
