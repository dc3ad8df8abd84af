"""Language models end to end: ``requant quantize`` with ``--preset INT4_BLOCKWISE_WEIGHTS`` on a tiny
trained Llama (tests/models/tiny_decoder.py), from its Hugging Face folder and from its onnxruntime-genai
folder, text calibration, the report, onnxruntime-genai's generation from the output, and the errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from requant.errors import ArgumentError, RequantError
from requant.llm.blocks import BlockFormat, dequantize, dequantized_rows, round_to_nearest, unpack
from requant.llm.budget import stored_bytes
from requant.llm.decoder import open_decoder
from requant.llm.nbits import BudgetError, to_matmul_nbits
from requant.llm.text import TextError
from requant.options import Options
from requant.pipeline import quantize
from requant.quantizers import PRESETS, Quantizer
from tests.models import once_per_run
from tests.models.tiny_decoder import docs_text, make_genai_folder, make_hf_folder, untied_copy

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("transformers")

PRESET = ("--preset", "INT4_BLOCKWISE_WEIGHTS")


def _tiny_files(root: Path) -> None:
    hf = make_hf_folder(root / "hf")
    calib, held_out = docs_text()
    (root / "calib.txt").write_text(calib)
    (root / "eval.txt").write_text(held_out)
    make_genai_folder(hf, root / "genai")


@pytest.fixture(scope="module")
def tiny() -> dict[str, Path]:
    """The tiny decoder as a Hugging Face folder and a genai one, with text to calibrate and evaluate on: made
    once per test run (read only)."""
    root = once_per_run("tiny_decoder", _tiny_files)
    return {"hf": root / "hf", "genai": root / "genai", "calib": root / "calib.txt", "eval": root / "eval.txt",
            "root": root}  # fmt: skip


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "requant", "quantize", *args], capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def blocks(**given: Any) -> Options:
    return Options.create(quantizer=Quantizer().set_global(PRESETS["INT4_BLOCKWISE_WEIGHTS"]), **given)


def ops(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def greedy(path: Path, prompt: list[int], steps: int) -> list[int]:
    """The quantized model's greedy continuation, step by step in ONNX Runtime with its past key values."""
    decoder = open_decoder(path.parent)
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    ids, pasts, out = np.array([prompt]), None, list(prompt)
    for _ in range(steps):
        results = dict(zip(names, session.run(None, decoder.feeds(ids, pasts)), strict=True))
        token = int(np.argmax(results["logits"][0, -1]))
        out.append(token)
        ids, pasts = np.array([[token]]), decoder.presents(results)
    return out


def assert_genai_generates(out: Path) -> None:
    """onnxruntime-genai loads the folder ``out`` and generates what the model requant wrote does, greedily."""
    import onnxruntime_genai as og

    model = og.Model(str(out))
    tokenizer = og.Tokenizer(model)
    prompt = [int(t) for t in tokenizer.encode("The quantized model")]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 12, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    generated = [int(t) for t in generator.get_sequence(0)]
    assert generated == greedy(out / "model.onnx", prompt, 12)  # genai runs the model requant wrote


def test_a_hugging_face_folder_becomes_a_genai_folder_that_generates(tiny: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "q4"
    done = run_cli(str(tiny["hf"]), "-o", str(out), "--calib", str(tiny["calib"]), *PRESET, "--block-size", "64",
                   "--report-json", str(tmp_path / "r.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "11 of 11 linear layers in symmetric blocks of 64 (MatMulNBits): 10 in 4-bit and 1 in 8-bit" in done.stdout
    assert {"genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    counts = ops(out / "model.onnx")
    assert counts["MatMulNBits"] == 11 and "MatMul" not in counts  # 2 x (qkv, o, gate, up, down) and the LM head
    report = json.loads((tmp_path / "r.json").read_text())
    llm = report["llm"]
    (head,) = [layer for layer in llm["layers"] if "tied" in layer]  # the embedding reads the LM head's blocks
    assert head["node"] == "/lm_head/MatMul" and list(head["tied"]) == ["/model/embed_tokens/Gather"]
    assert counts["GatherBlockQuantized"] == 1 and "Transpose" not in counts  # no float table left
    assert "onnxruntime-genai's builder" in llm["exported"]
    assert llm["size"]["quantized_bytes"] < 0.6 * llm["size"]["float_bytes"]
    for layer in llm["layers"]:  # each layer's choice is the least output error of those tried
        sqnr = layer["rounding"]["output_sqnr_db"]
        assert sqnr[layer["rounding"]["chosen"]] == max(sqnr.values())
    checked = report["outputs"]
    assert checked["held_out"] and checked["poor"] == [] and 0.9 < checked["ratio"] < 1.1
    assert_genai_generates(out)


def test_eight_bits_asymmetric_to_an_onnx_file_with_evaluation(tiny: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "q8.onnx"
    result = quantize(tiny["genai"], str(tiny["calib"]), blocks(bits=8, symmetric=False, block_size=32,
                                                                eval_data=str(tiny["eval"]), output=out))  # fmt: skip
    assert out.is_file() and (tmp_path / "q8.onnx.data").is_file()
    model = onnx.load(str(out), load_external_data=False)
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 11 and all(len(n.input) == 4 for n in nbits)  # zero points stored
    assert {a.i for n in nbits for a in n.attribute if a.name == "bits"} == {8}
    assert {a.i for n in nbits for a in n.attribute if a.name == "accuracy_level"} == {4}  # ORT's 8-bit kernel
    llm = result.report["llm"]
    evaluation = llm["evaluation"]
    assert evaluation["windows"] >= 1 and abs(evaluation["increase"]) < 0.01 * evaluation["float_perplexity"]
    assert {"prefill", "decode"} == set(llm["latency"])
    four = quantize(tiny["genai"], str(tiny["calib"]), blocks(block_size=32, measure=False))
    layers = four.report["llm"]["layers"]
    assert [r["bits"] for r in layers] == [4] * 10 + [8]  # the LM head tied to the embedding: 8 bits
    for a, b in zip(layers[:-1], llm["layers"][:-1], strict=True):  # 8 bits: ~24 dB more per layer
        chosen = (
            a["rounding"]["output_sqnr_db"][a["rounding"]["chosen"]],
            b["rounding"]["output_sqnr_db"][b["rounding"]["chosen"]],
        )
        assert chosen[1] > chosen[0] + 15, (a["node"], chosen)


def test_an_embedding_in_blocks_of_the_bits_asked(tiny: dict[str, Path], tmp_path: Path) -> None:
    """Untied (a copy of the tiny model with its LM head untied): kept float and said so, or with
    --embedding-bits 8 a GatherBlockQuantized of 8-bit blocks of its own that onnxruntime-genai generates with;
    tied: the LM head in the bits asked, the embedding reading its blocks."""
    genai = make_genai_folder(untied_copy(tiny["hf"], tmp_path / "hf"), tmp_path / "genai")
    kept = quantize(genai, str(tiny["calib"]), blocks(block_size=64, measure=False))
    assert "embedding model.embed_tokens.weight (512 x 128, 0.3 MB float) kept float, untied from the LM head: " \
           "--embedding-bits 8" in kept.report["summary"]  # fmt: skip
    out = tmp_path / "q"
    done = run_cli(str(genai), "-o", str(out), "--calib", str(tiny["calib"]), *PRESET, "--block-size", "64",
                   "--embedding-bits", "8", "--no-measure", "--report-json", str(tmp_path / "r.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "embedding model.embed_tokens.weight (512 x 128, 0.3 MB float): 8-bit blocks of its own, read by a " \
           "GatherBlockQuantized" in done.stdout  # fmt: skip
    counts = ops(out / "model.onnx")
    assert counts["GatherBlockQuantized"] == 1 and counts["MatMulNBits"] == 11
    stored = {t.name for t in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.initializer}
    assert "model.embed_tokens.weight" not in stored and "model.embed_tokens.weight_Q" in stored
    report = json.loads((tmp_path / "r.json").read_text())
    (embedding,) = report["llm"]["embeddings"]
    assert embedding["bits"] == 8 and embedding["sqnr_db"] > 40  # 8 bits: ~6 dB a bit, less the blocks' outliers
    assert [r["bits"] for r in report["llm"]["layers"]] == [4] * 11  # the untied LM head in the layers' bits
    saved = kept.report["llm"]["size"]["quantized_bytes"] - report["llm"]["size"]["quantized_bytes"]
    blocks_bytes = stored_bytes(BlockFormat(8, 64, True), 128, 512)  # what MatMulNBits would store: the same layout
    assert report["outputs"]["poor"] == [] and saved == pytest.approx(embedding["bytes"] - blocks_bytes, abs=1000)
    assert_genai_generates(out)
    tied = quantize(tiny["genai"], str(tiny["calib"]), blocks(block_size=64, embedding_bits=4, measure=False))
    layers = tied.report["llm"]["layers"]
    assert [r["bits"] for r in layers] == [4] * 11 and "tied" in layers[-1] and tied.report["llm"]["embeddings"] == []


def test_the_same_model_text_and_options_give_the_same_bytes(tiny: dict[str, Path], tmp_path: Path) -> None:
    for name in ("a", "b"):
        quantize(tiny["genai"], str(tiny["calib"]), blocks(output=tmp_path / name, measure=False))
    for file in ("model.onnx", "model.onnx.data", "genai_config.json"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file


def test_text_as_a_list_of_strings_and_a_folder(tiny: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "texts"
    folder.mkdir()
    text = tiny["calib"].read_text()
    (folder / "a.txt").write_text(text[: len(text) // 2])
    (folder / "b.txt").write_text(text[len(text) // 2 :])
    for source in (folder, [text[: len(text) // 2], text[len(text) // 2 :]]):
        result = quantize(tiny["genai"], source, blocks(measure=False))
        assert result.report["llm"]["calibration"]["tokens"] > 0


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"bits": 8}, "bits is an option of language models' weight blocks (--preset INT4_BLOCKWISE_WEIGHTS)"),
        ({"block_size": 64}, "block_size is an option of language models' weight blocks"),
        ({"symmetric": False}, "symmetric=False (--asymmetric) is an option of language models' weight blocks"),
    ],
)
def test_block_options_without_the_preset_are_refused(given: dict[str, Any], message: str) -> None:
    with pytest.raises(ArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Options.create(**given)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"block_size": 100}, "block_size must be a power of 2 of at least 16, or None; got 100"),
        ({"bits": 3}, "bits must be 4 or 8, or None; got 3"),
        ({"method": "minmax"}, "method is not an option of language models' weight blocks"),
        ({"target": "tosa-int8"}, "runs on ONNX Runtime: the onnxruntime-cpu target, not tosa-int8"),
    ],
)
def test_block_options_that_do_not_fit_are_refused(given: dict[str, Any], message: str) -> None:
    with pytest.raises(ArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        blocks(**given)


def test_bad_inputs_get_clear_errors_and_write_nothing(tiny: dict[str, Path], tmp_path: Path) -> None:
    lonely = tmp_path / "lonely"  # the genai folder without its tokenizer
    lonely.mkdir()
    for file in ("model.onnx", "model.onnx.data", "genai_config.json"):
        (lonely / file).write_bytes((tiny["genai"] / file).read_bytes())
    out = tmp_path / "out"
    done = run_cli(str(lonely), "-o", str(out), "--calib", str(tiny["calib"]), *PRESET)
    assert done.returncode == 1 and "give --tokenizer DIR" in done.stderr and not out.exists()
    done = run_cli(str(lonely), "-o", str(out), "--calib", str(tiny["calib"]), *PRESET, "--tokenizer",
                   str(tiny["genai"]), "--no-measure")  # fmt: skip
    assert done.returncode == 0, done.stderr
    # the model alone: its past inputs' head size is symbolic, and no genai_config.json gives it
    done = run_cli(str(lonely / "model.onnx"), "-o", str(tmp_path / "o2"), "--calib", str(tiny["calib"]), *PRESET)
    assert done.returncode == 1 and not (tmp_path / "o2").exists()
    assert "past input 'past_key_values.0.key' has shape" in done.stderr and "must be numbers" in done.stderr
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    with pytest.raises(TextError, match="the calibration text has [0-9]+ tokens; at least 16 are needed"):
        quantize(tiny["genai"], str(short), blocks(output=tmp_path / "never"))
    assert not (tmp_path / "never").exists()
    with pytest.raises(RequantError, match="no calibration data at '.*missing.txt'"):  # before any work
        quantize(tiny["genai"], str(tmp_path / "missing.txt"), blocks())
    digits = Path(__file__).resolve().parents[1] / "examples" / "digits" / "digits_cnn.onnx"
    with pytest.raises(RequantError, match="is not a causal language model .* nor a Hugging Face folder with a "
                                           "tokenizer: text cannot be its calibration data"):  # fmt: skip
        quantize(digits, str(tiny["calib"]), blocks())
    with pytest.raises(RequantError, match="is not a language model requant reads"):
        open_decoder(tmp_path / "nothing")


@pytest.mark.parametrize(("k", "bits", "symmetric"), [(64, 4, True), (80, 4, False), (64, 8, False), (80, 8, True)])
def test_a_tied_embedding_reads_the_lm_heads_blocks(k: int, bits: int, symmetric: bool) -> None:
    """The embedding (a Gather of the LM head's weight, transposed) becomes a GatherBlockQuantized of the LM
    head's blocks: in ONNX Runtime, each token's row is the dequantized weight's, bit for bit."""
    text = f"""
    <ir_version: 10, opset_import: ["" : 21]>
    g (int64[1, 3] ids, float[{k}, 16] w) => (float[1, 3, 16] logits) {{
        table = Transpose <perm = [1, 0]> (w)
        x = Gather <axis = 0> (table, ids)
        logits = MatMul (x, w)
    }}
    """
    model = ir.from_proto(onnx.parser.parse_model(text))
    w = model.graph.inputs.pop()  # the tied weight, made an initializer
    w.const_value = ir.tensor(np.random.default_rng(0).normal(size=(k, 16)).astype(np.float32), name="w")
    model.graph.register_initializer(w)
    fmt = BlockFormat(bits, 32, symmetric)
    (record,) = to_matmul_nbits(model, fmt)
    ops = [n.op_type for n in model.graph]
    assert sorted(ops) == sorted(["GatherBlockQuantized", "MatMulNBits", "Reshape"] + (["Slice"] if k % 32 else []))
    ((_, how),) = record["tied"].items()
    assert how.startswith("reads the LM head's blocks") and ("Slice" in how) == (k % 32 != 0)
    assert "w" not in model.graph.initializers
    import onnxruntime as ort

    proto = ir.to_proto(model)
    proto.graph.output.append(onnx.helper.make_empty_tensor_value_info("x"))  # the embedding's rows
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[0, 5, 15]])
    logits, rows = session.run(None, {"ids": ids})
    table = dequantize(round_to_nearest(np.asarray(w.const_value.numpy()), fmt)).T  # [16, K]: one row per token
    np.testing.assert_array_equal(rows, table[ids])
    # 8 bits run at accuracy level 4 (the activations rounded to int8 per block): at most half a step of the
    # largest row value on each input, times the weights' magnitudes
    bound = 1e-5 if bits == 4 else np.abs(rows).max() / 254 * np.abs(table).sum(axis=1).max() * 1.01
    np.testing.assert_allclose(logits, rows @ table.T, rtol=1e-5, atol=bound)


@pytest.mark.parametrize(("k", "bits", "symmetric"), [(64, 4, True), (80, 4, False), (64, 8, False), (80, 8, True)])
def test_an_untied_embedding_becomes_blocks_of_its_own_when_asked(k: int, bits: int, symmetric: bool) -> None:
    """An embedding with a table of its own (a Gather of input_ids) becomes a GatherBlockQuantized of its table's
    blocks: in ONNX Runtime each token's row is the dequantized table's, bit for bit; each block's range clipped
    to the ratio of least error on its row (never more than nearest's); a table gathered by other indices, and
    every table without ``embedding_format``, stay float."""
    text = f"""
    <ir_version: 10, opset_import: ["" : 21]>
    g (int64[1, 3] input_ids, int64[1, 3] position_ids, float[40, {k}] table, float[8, {k}] positions,
       float[{k}, 16] w) => (float[1, 3, 16] logits) {{
        tokens = Gather <axis = 0> (table, input_ids)
        where = Gather <axis = 0> (positions, position_ids)
        x = Add (tokens, where)
        logits = MatMul (x, w)
    }}
    """
    rng = np.random.default_rng(0)
    data = {"table": rng.normal(size=(40, k)), "positions": rng.normal(size=(8, k)), "w": rng.normal(size=(k, 16))}
    data["table"][3, :5] = 20.0  # an outlier: clipping the range pays on other blocks, not on this one's row

    def model() -> ir.Model:
        built = ir.from_proto(onnx.parser.parse_model(text))
        for value in built.graph.inputs[2:]:
            value.const_value = ir.tensor(data[str(value.name)].astype(np.float32), name=str(value.name))
            built.graph.register_initializer(value)
        del built.graph.inputs[2:]
        return built

    fmt = BlockFormat(bits, 32, symmetric)
    kept = model()
    _, record = to_matmul_nbits(kept, fmt)  # not asked: the tables stay float, the token table's said to
    assert record["table"] == "table" and record["float"].startswith("not asked")
    assert {"table", "positions"} <= set(kept.graph.initializers)
    smallest = 8 * k * 4 + stored_bytes(fmt, k, 40) + stored_bytes(fmt, k, 16)  # a size budget counts the table
    with pytest.raises(BudgetError, match="more than --max-size"):  # in blocks only when asked
        to_matmul_nbits(model(), fmt, max_bytes=smallest)
    quantized = model()
    _, embedding = to_matmul_nbits(quantized, fmt, max_bytes=smallest, embedding_format=fmt)
    assert embedding["table"] == "table" and embedding["gathers"] == ["tokens"] and embedding["bits"] == bits
    assert ("Slice" in embedding["how"]) == (k % 32 != 0) and "table" not in quantized.graph.initializers
    assert "positions" in quantized.graph.initializers  # gathered by position_ids: not an embedding of tokens
    import onnxruntime as ort

    proto = ir.to_proto(quantized)
    proto.graph.output.append(onnx.helper.make_empty_tensor_value_info("tokens"))
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[0, 3, 39]])
    _, rows = session.run(None, {"input_ids": ids, "position_ids": np.array([[0, 1, 2]])})
    q = {str(v.name): np.asarray(v.const_value.numpy()) for v in quantized.graph.initializers.values()}
    zero_points = q.get("table_zero_points")
    stored = unpack(q["table_Q"].reshape(40, fmt.blocks(k), -1), q["table_scales"], zero_points, k, fmt)
    table = dequantized_rows(stored)
    np.testing.assert_array_equal(rows, table[ids])
    error = np.square(table - data["table"]).sum()
    nearest = np.square(dequantize(round_to_nearest(data["table"].T, fmt)).T - data["table"]).sum()
    assert error < nearest if bits == 4 else error <= nearest * (1 + 1e-6)  # (float32 ranking at 8 bits)
    assert embedding["sqnr_db"] == pytest.approx(10 * np.log10(np.square(data["table"]).sum() / error), rel=1e-4)


def test_a_decoder_no_faster_than_float_and_a_far_perplexity_are_said_first() -> None:
    from requant.stages.report import summary

    report: dict[str, Any] = {"target": "onnxruntime-cpu", "quantize_seconds": 1.0,
                              "outputs": {"poor": ["perplexity 30.00 against float's 10.00 on the calibration text"]},
                              "llm": {"latency": {"decode": {"float_ms": 10.0, "quantized_ms": 12.0, "ratio": 1.2}}}}  # fmt: skip
    first = summary(report).splitlines()[:2]
    assert first[0] == "NOT USABLE AS IS: perplexity 30.00 against float's 10.00 on the calibration text"
    assert first[1].startswith("SLOWER THAN FLOAT: one decoding step takes 1.20x the float model's time")
    report["llm"]["latency"]["decode"].update(quantized_ms=5.0, ratio=0.5)
    assert "SLOWER" not in summary(report)


def test_an_output_folder_is_written_whole_or_not_at_all(
    tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    result = quantize(tiny["genai"], str(tiny["calib"]), blocks(measure=False))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    copied: list[str] = []
    real = shutil.copyfile

    def full_disk(src: Any, dst: Any) -> Any:
        if copied:  # the second file fails
            raise OSError(28, "No space left on device")
        copied.append(str(src))
        return real(src, dst)

    monkeypatch.setattr(shutil, "copyfile", full_disk)
    with pytest.raises(RequantError, match="could not write the model to .*No space left on device"):
        result.save(out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]  # nothing of the model, the user's file untouched
    monkeypatch.undo()
    result.save(out)
    assert {"model.onnx", "model.onnx.data", "genai_config.json", "notes.txt"} <= {p.name for p in out.iterdir()}


@pytest.mark.parametrize("where", ["blocks", "staged model"])
def test_a_full_disk_for_the_temporary_files_is_said(tiny: dict[str, Path], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, where: str) -> None:  # fmt: skip
    """The rounded blocks kept on disk, or the staged model, meeting a full disk: a requant error that says where
    the temporary files go (TMPDIR), nothing written to the output."""
    import requant.llm.memory
    import requant.stages.blocks

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    if where == "blocks":
        monkeypatch.setattr(requant.llm.memory.np, "save", full)
    else:
        monkeypatch.setattr(requant.stages.blocks.ir, "save", full)
    out = tmp_path / "out"
    with pytest.raises(RequantError, match="could not write requant's temporary files in .*No space left on "
                                           "device.*TMPDIR chooses where they go"):  # fmt: skip
        quantize(tiny["genai"], str(tiny["calib"]), blocks(measure=False, output=out))
    assert not out.exists()


def test_a_size_budget_is_met_with_8_bit_layers_and_one_too_small_is_refused(tiny: dict[str, Path],
                                                                          tmp_path: Path) -> None:  # fmt: skip
    four = quantize(tiny["genai"], str(tiny["calib"]), blocks(block_size=32, measure=False)).report
    smallest = four["llm"]["size"]["quantized_bytes"]
    budget = (smallest + 40_000) / 1e6
    out = tmp_path / "fit"
    result = run_cli(str(tiny["genai"]), "-o", str(out), "--calib", str(tiny["calib"]), *PRESET, "--block-size", "32",
                     "--max-size", f"{budget:.6f}", "--no-measure", "--report-json", str(tmp_path / "r.json"))  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    size, layers = report["llm"]["size"], report["llm"]["layers"]
    assert smallest < size["quantized_bytes"] <= budget * 1e6 == size["max_bytes"]
    wider = [r for r in layers if "budget" in r]
    assert wider and all(r["bits"] == 8 for r in wider)
    assert f"size budget {budget:.1f} MB: {len(wider)} layers at 8 bits" in result.stdout
    # the greedy rule on the all-4-bit run's errors: the layer losing the most per byte is promoted, and a layer
    # losing more per byte than a promoted one is promoted too or bigger (it no longer fitted)
    sizes = {r["node"]: r["k"] * r["n"] for r in four["llm"]["layers"] if r["bits"] == 4}
    per_byte = {r["node"]: r["rounding"]["output_error"] / sizes[r["node"]] for r in four["llm"]["layers"]
                if r["bits"] == 4}  # fmt: skip
    ranked = sorted(per_byte, key=per_byte.__getitem__, reverse=True)
    chosen = {r["node"] for r in wider}
    assert ranked[0] in chosen and len(chosen) < len(ranked)
    for name in chosen:
        before = ranked[: ranked.index(name)]
        assert all(other in chosen or sizes[other] > sizes[name] for other in before), (name, before)
    before = {r["node"]: r["rounding"]["output_sqnr_db"][r["rounding"]["chosen"]] for r in four["llm"]["layers"]}
    for r in wider:  # each promoted layer's output error: about 24 dB less at 8 bits
        assert r["rounding"]["output_sqnr_db"][r["rounding"]["chosen"]] > before[r["node"]] + 15, r["node"]
    refused = tmp_path / "refused"
    small = run_cli(str(tiny["genai"]), "-o", str(refused), "--calib", str(tiny["calib"]), *PRESET,
                    "--block-size", "32", "--max-size", f"{(smallest - 50_000) / 1e6:.6f}", "--no-measure")  # fmt: skip
    assert small.returncode != 0 and "more than --max-size" in small.stderr and not refused.exists()


def test_a_decoder_runs_a_section_at_a_time_as_it_runs_whole(tiny: dict[str, Path], tmp_path: Path) -> None:
    """On the tests' tiny decoder: its sections; the perplexity run a section at a time is the whole session's
    to the bit; each layer's moments gathered by sections are the sums over a whole-model run's values; only
    the section being rounded has its moments, and an earlier one's come back only from where they were kept."""
    from requant.errors import RequantError
    from requant.llm.decoder import open_decoder
    from requant.llm.moments import LayerMoments
    from requant.llm.nbits import linear_weights
    from requant.llm.runs import perplexity, sectioned_perplexity, session
    from requant.llm.sections import sections
    from requant.runtime import cpu_session

    tiny_genai = tiny["genai"]

    decoder = open_decoder(tiny_genai)
    assert [s.name for s in sections(decoder.model.graph)] == ["prologue", "layers.0-2", "epilogue"]
    assert [s.name for s in sections(decoder.model.graph, most=0)] == ["prologue", "layers.0", "layers.1",
                                                                        "layers.2", "epilogue"]  # fmt: skip
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, 512, size=(1, n)).astype(np.int64) for n in (40, 64, 17)]
    whole = perplexity(decoder, session(str(decoder.path)), windows)
    assert sectioned_perplexity(decoder, decoder.model, decoder.path.parent, windows) == whole

    layers = {name: str(node.inputs[0].name) for name, (node, _) in linear_weights(decoder.model.graph).items()}
    proto = ir.to_proto(decoder.model)
    for value in sorted(set(layers.values())):
        proto.graph.output.add().name = value
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(tiny_genai))
    probe = cpu_session(proto.SerializeToString(), options)
    names = sorted(set(layers.values()))
    expected: dict[str, np.ndarray] = {}
    magnitude: dict[str, np.ndarray] = {}  # sum |x_i| |x_j|: float32 sums in another order differ by ulps of it
    for ids in windows[:2]:
        for name, x in zip(names, probe.run(names, decoder.feeds(ids)), strict=True):
            rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
            expected[name] = expected.get(name, 0) + (rows.T @ rows).astype(np.float64)
            magnitude[name] = magnitude.get(name, 0) + np.abs(rows.astype(np.float64)).T @ np.abs(rows)

    def same_sums(got: np.ndarray, name: str) -> None:  # NumPy's BLAS sums float32 in an order its threads decide
        ulps = 16 * np.finfo(np.float32).eps * magnitude[layers[name]]
        assert np.all(np.abs(got - expected[layers[name]]) <= ulps), name

    moments = LayerMoments(decoder, layers, windows[:2], held=windows[2:], most=0)  # a layer per section
    first, second = next(iter(layers)), list(layers)[-2]  # layers.0's qkv, layers.1's down_proj
    same_sums(moments[first], first)
    assert set(moments._current) == {n for n in layers if "layers.0/" in n}
    same_sums(moments[second], second)
    assert set(moments._current) == {n for n in layers if "layers.1/" in n}  # layers.0's are gone
    with pytest.raises(RequantError, match="dropped"):
        moments[first]
    moments.finish()
    count = sum(w.shape[1] - 1 for w in windows[2:])
    held = perplexity(decoder, session(str(decoder.path)), windows[2:])
    assert np.exp(moments.held_nll / count) == pytest.approx(held, rel=1e-12)

    kept = LayerMoments(decoder, layers, windows[:2], keep=tmp_path, most=0)
    for name in layers:
        kept[name]
    same_sums(kept[first], first)  # read back from tmp_path
