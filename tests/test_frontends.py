"""The ONNX front door and saving: each failure names the input, nothing partial is written."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from requant.frontends import LoadError, SaveError, load_onnx, load_onnx_text, save_onnx


def _model(
    opset: int = 17, nodes: list[onnx.NodeProto] | None = None, domain_imports: list[tuple[str, int]] = ()
) -> onnx.ModelProto:  # type: ignore[assignment]
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "W")
    graph = helper.make_graph(
        nodes or [helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 4])],
        [w],
    )
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in domain_imports]
    return helper.make_model(graph, opset_imports=imports)


def test_loads_paths_bytes_and_protos(tmp_path: Path) -> None:
    proto = _model()
    onnx.save(proto, tmp_path / "m.onnx")
    for source in (tmp_path / "m.onnx", str(tmp_path / "m.onnx"), proto.SerializeToString(), proto):
        model = load_onnx(source)
        assert [n.op_type for n in model.graph] == ["MatMul"]
        assert str(model.graph.inputs[0].shape) == "[N,3]"  # the symbolic batch is kept


def test_external_data_stays_external_and_mapped(tmp_path: Path) -> None:
    onnx.save(_model(), tmp_path / "m.onnx", save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    model = load_onnx(tmp_path / "m.onnx")
    weight = model.graph.initializers["W"].const_value
    assert type(weight).__name__ == "ExternalTensor"
    out = tmp_path / "out"
    out.mkdir()
    save_onnx(model, out / "q.onnx")
    assert sorted(os.listdir(out)) == ["q.onnx", "q.onnx.data"]
    assert np.array_equal(load_onnx(out / "q.onnx").graph.initializers["W"].const_value.numpy(), weight.numpy())


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing.onnx", "no model file at '.*missing.onnx'"),
        (
            lambda p: (p / "bad.onnx").write_bytes(b"\x08\x07\x12garbage") and p / "bad.onnx",
            "could not parse '.*bad.onnx' as an ONNX model",
        ),
    ],
)
def test_bad_files(tmp_path: Path, make: object, message: str) -> None:
    with pytest.raises(LoadError, match=message):
        load_onnx(make(tmp_path))  # type: ignore[operator]


def test_missing_external_data_names_the_initializer(tmp_path: Path) -> None:
    onnx.save(_model(), tmp_path / "m.onnx", save_as_external_data=True, location="w.bin", size_threshold=0)
    (tmp_path / "w.bin").unlink()
    with pytest.raises(LoadError, match="initializer 'W' keeps its data in 'w.bin', which is missing"):
        load_onnx(tmp_path / "m.onnx")


def test_truncated_external_data(tmp_path: Path) -> None:
    onnx.save(_model(), tmp_path / "m.onnx", save_as_external_data=True, location="w.bin", size_threshold=0)
    (tmp_path / "w.bin").write_bytes(b"\x00" * 8)
    with pytest.raises(LoadError, match="needs bytes up to 48 of 'w.bin', which has only 8"):
        load_onnx(tmp_path / "m.onnx")


def test_unknown_domain_names_the_node() -> None:
    node = helper.make_node("Frobnicate", ["X"], ["Y"], domain="my.ops", name="frob_1")
    with pytest.raises(LoadError, match=r"unknown domain\(s\) 'my.ops': 'frob_1' \(my.ops.Frobnicate\)"):
        load_onnx(_model(nodes=[node], domain_imports=[("my.ops", 1)]))


def test_checker_failures_are_reported() -> None:
    node = helper.make_node("Relu", ["X", "X"], ["Y"])
    with pytest.raises(LoadError, match="fails ONNX's checker: .*input size 2"):
        load_onnx(_model(nodes=[node]))


def test_old_opsets_are_converted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    node = helper.make_node("Relu", ["X"], ["R"])
    mm = helper.make_node("MatMul", ["R", "W"], ["Y"])
    with caplog.at_level(logging.INFO, logger="requant"):
        model = load_onnx(_model(opset=9, nodes=[node, mm]))
    assert model.opset_imports[""] == 13
    assert "converted from opset 9 to opset 13" in caplog.text


def test_an_ir_3_model_whose_weights_are_inputs_is_quantized(tmp_path: Path) -> None:
    """What exporters of opset 7 wrote: IR version 3, every initializer also a graph input. Taken as
    constants (no longer inputs), its IR version is raised to what its opset needs: ONNX Runtime refused
    an IR-3 model whose initializers are not inputs ("initializer_arg was false") when requant ran it."""
    import requant

    weight = numpy_helper.from_array(np.linspace(-1, 1, 4 * 3 * 3 * 3, dtype=np.float32).reshape(4, 3, 3, 3), "w")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8]),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 3, 3, 3])]  # fmt: skip
    conv = helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1])
    graph = helper.make_graph([conv, helper.make_node("Relu", ["c"], ["y"])], "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [weight])  # fmt: skip
    path = tmp_path / "opset7.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 7)], ir_version=3), path)
    model = load_onnx(path)
    assert model.ir_version == 7 and [v.name for v in model.graph.inputs] == ["x"]
    x = np.random.default_rng(0).normal(size=(16, 1, 3, 8, 8)).astype(np.float32)
    samples = [{"x": sample} for sample in x]
    result = requant.quantize(path, samples, eval_data=samples, measure=False)
    assert result.report["evaluation"]["sqnr_db"] > 30  # measured: 39 dB
    assert result.report["lint"]["int8_kernels"] == {"QLinearConv": 1}


def test_text_syntax_errors() -> None:
    with pytest.raises(LoadError, match="could not parse the text model as ONNX text syntax"):
        load_onnx_text("<ir_version: 10> g (float X) => (float Y) { Y = Relu(X ")


def test_save_is_whole_or_nothing(tmp_path: Path) -> None:
    model = load_onnx(_model())
    with pytest.raises(SaveError, match="folder .* does not exist"):
        save_onnx(model, tmp_path / "nope" / "m.onnx")
    target = tmp_path / "m.onnx"
    target.write_bytes(b"previous")
    (tmp_path / "m.onnx").chmod(0o644)
    save_onnx(model, target)
    assert load_onnx(target).graph.node(0).op_type == "MatMul"
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]  # no temporary left behind


def test_loading_does_not_touch_the_input(tmp_path: Path) -> None:
    onnx.save(_model(opset=9, nodes=[helper.make_node("MatMul", ["X", "W"], ["Y"])]), tmp_path / "m.onnx")
    before = (tmp_path / "m.onnx").read_bytes()
    load_onnx(tmp_path / "m.onnx")
    assert (tmp_path / "m.onnx").read_bytes() == before


def test_torch_is_imported_only_for_pytorch_models() -> None:
    import subprocess
    import sys

    text = '<ir_version: 10, opset_import: ["" : 21]> g (float X) => (float Y) { Y = Relu(X) }'
    code = (
        "import sys, requant, requant.frontends, requant.passes, requant.cli;"
        f"requant.frontends.load_onnx_text('{text}');"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_models_above_2gb_load_and_canonicalize_without_reading_weights(tmp_path: Path) -> None:
    # a 2.6 GB weight in a sparse external data file: no disk used, and requant must not read it
    from requant.ir import print_model
    from requant.passes import get_passes, run_passes

    n = 25600
    weight = onnx.TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[n, n])
    weight.data_location = TensorProto.EXTERNAL
    for key, value in {"location": "w.bin", "offset": "0", "length": str(n * n * 4)}.items():
        weight.external_data.add(key=key, value=value)
    with open(tmp_path / "w.bin", "wb") as f:
        f.truncate(n * n * 4)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["M"]), helper.make_node("Identity", ["M"], ["Y"])],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", n])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", n])],
        [weight],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "big.onnx")
    model = load_onnx(tmp_path / "big.onnx")
    model, _ = run_passes(model, get_passes("canonicalize"))
    assert "%W: tensor<25600x25600xf32> = initializer dense<655360000 elements>" in print_model(model)
    status = Path("/proc/self/status").read_text().splitlines()
    peak_mb = int(next(x for x in status if x.startswith("VmHWM")).split()[1]) / 1024
    assert peak_mb < 2000, f"the 2.6 GB weight was read: peak {peak_mb:.0f} MB"


@pytest.mark.parametrize("rows", [1, 3, 40, 5000, 300_000])  # tensor and graph lengths across varint sizes
def test_serialized_size_is_the_byte_size_without_serializing_the_weights_together(
    rows: int, caplog: pytest.LogCaptureFixture
) -> None:
    import onnx_ir as ir

    from requant.frontends import serialized_size

    proto = _model()
    proto.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.ones((3, rows), np.float32), "W"))
    proto.graph.output[0].type.tensor_type.shape.dim[1].dim_value = rows
    proto.graph.initializer.append(numpy_helper.from_array(np.arange(rows, dtype=np.int64), "unused"))
    model = load_onnx(proto)
    before = ir.serde.serialize_model(model).SerializeToString()
    with caplog.at_level(logging.WARNING):
        assert serialized_size(model) == ir.serde.serialize_model(model).ByteSize()
    assert not caplog.records  # onnx-ir's warnings about initializers without data stay quiet
    assert ir.serde.serialize_model(model).SerializeToString() == before  # the model is as it was


def _set_external(path: Path, **entries: str) -> None:
    proto = onnx.load(path, load_external_data=False)
    for entry in proto.graph.initializer[0].external_data:
        if entry.key in entries:
            entry.value = entries[entry.key]
    onnx.save(proto, path)


def test_external_data_must_be_a_relative_path_with_numeric_offsets(tmp_path: Path) -> None:
    onnx.save(_model(), tmp_path / "m.onnx", save_as_external_data=True, location="w.bin", size_threshold=0)
    _set_external(tmp_path / "m.onnx", offset="ten")
    with pytest.raises(LoadError, match=r"initializer 'W' has a non-numeric external-data offset or length \('ten'"):
        load_onnx(tmp_path / "m.onnx")
    for location in ("/etc/passwd", "../w.bin"):
        _set_external(tmp_path / "m.onnx", location=location, offset="0")
        with pytest.raises(LoadError) as raised:
            load_onnx(tmp_path / "m.onnx")
        assert f"keeps its data at '{location}', outside the model's folder" in str(raised.value)
        assert "which has only" not in str(raised.value)  # its size was not read


def test_an_opset_newer_than_onnx_knows_is_named() -> None:
    with pytest.raises(LoadError, match=r"uses opset 99 of the default ONNX domain; the newest requant knows is \d+"):
        load_onnx(_model(opset=99))


def test_initializers_listed_as_inputs_are_constants(caplog: pytest.LogCaptureFixture) -> None:
    """IR 3 listed every weight among the inputs; requant takes them as the constants they are."""
    proto = _model(opset=13)
    proto.graph.input.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, [3, 4]))
    with caplog.at_level(logging.INFO, logger="requant"):
        model = load_onnx(proto)
    assert [v.name for v in model.graph.inputs] == ["X"] and "W" in model.graph.initializers
    assert "1 initializers listed as inputs are taken as constants: 'W'" in caplog.text


def test_onnx_text_must_be_utf8(tmp_path: Path) -> None:
    path = tmp_path / "m.onnxtxt"
    path.write_bytes(
        '<ir_version: 10, opset_import: ["" : 21]>\ng (float[1] X) => (float[1] Y) {\n  Y = Relu(X) # \xe9\n}'.encode(
            "latin-1"
        )
    )
    with pytest.raises(LoadError, match=r"is not UTF-8 text \(ONNX text syntax is UTF-8\): byte 0xe9 at offset"):
        load_onnx(path)


def test_a_model_of_an_ir_version_onnx_runtime_does_not_load_yet_is_lowered_to_what_it_loads() -> None:
    """onnx 1.23's helper.make_model writes IR 14, which onnxruntime 1.31 refuses ("max supported IR version:
    13"): requant loads it at the newest IR ONNX Runtime reads, calibrates it there, and its output loads."""
    import onnx_ir as ir
    import onnxruntime as ort

    import requant
    from requant.frontends.onnx_loader import runtime_ir_version

    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])
    weight = numpy_helper.from_array(rng.normal(size=(6, 3)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = onnx.IR_VERSION  # what the helper writes
    newest = runtime_ir_version()
    if newest >= onnx.IR_VERSION:
        pytest.skip(f"this ONNX Runtime loads IR {onnx.IR_VERSION}, the newest this onnx writes")
    with pytest.raises(Exception, match="Unsupported model IR version"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert load_onnx(model).ir_version == newest
    samples = [{"x": rng.normal(size=(1, 6)).astype(np.float32)} for _ in range(8)]
    written = ir.to_proto(requant.quantize(model, samples, measure=False).model)
    assert written.ir_version == newest and model.ir_version == onnx.IR_VERSION  # the caller's model untouched
    ort.InferenceSession(written.SerializeToString(), providers=["CPUExecutionProvider"])
