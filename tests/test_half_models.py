"""float16 and bfloat16 models: computed in float32 so ONNX Runtime's int8 kernels take them; the
interface keeps its types. bfloat16 inputs are refused with the reason."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import requant.api
from requant.frontends import LoadError

DIGITS = Path(__file__).parent.parent / "examples" / "digits"


def _narrowed(elem_type: int, numpy_type: type, interface: bool = True) -> onnx.ModelProto:
    """The digits CNN with every float32 weight (and, with ``interface``, its input and output) narrowed."""
    model = onnx.load(DIGITS / "digits_cnn.onnx")
    for i, tensor in enumerate(model.graph.initializer):
        if tensor.data_type == TensorProto.FLOAT:
            narrow = numpy_helper.to_array(tensor).astype(numpy_type)
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(narrow, tensor.name))
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(numpy_type), attr.t.name))
    if interface:
        for value in [*model.graph.input, *model.graph.output]:
            value.type.tensor_type.elem_type = elem_type
    else:  # float32 in and out, narrow inside
        x, y = model.graph.input[0].name, model.graph.output[0].name
        for node in model.graph.node:
            node.input[:] = [f"{x}_narrow" if i == x else i for i in node.input]
            node.output[:] = [f"{y}_narrow" if o == y else o for o in node.output]
        model.graph.node.insert(0, helper.make_node("Cast", [x], [f"{x}_narrow"], to=elem_type))
        model.graph.node.append(helper.make_node("Cast", [f"{y}_narrow"], [y], to=TensorProto.FLOAT))
    del model.graph.value_info[:]
    return model


def test_a_float16_model_gets_int8_kernels_and_keeps_its_float16_interface() -> None:
    result = requant.api.quantize(_narrowed(TensorProto.FLOAT16, np.float16), DIGITS / "calib.npz",
                                  eval_data=DIGITS / "eval.npz", measure=False)  # fmt: skip
    report = result.report
    assert report["lint"]["int8_kernels"] == {"QLinearConv": 2, "QGemm": 1}  # float16 as it was: none
    assert report["quantizers"]["compute"].startswith("float32 (the model computed in float16;")
    assert "compute: float32 (the model computed in float16" in report["summary"]
    assert report["evaluation"]["top1_agreement"] > 0.99 and report["evaluation"]["sqnr_db"] > 30
    session = ort.InferenceSession(ir.to_proto(result.model).SerializeToString(),
                                   providers=["CPUExecutionProvider"])  # fmt: skip
    assert [i.type for i in session.get_inputs()] == ["tensor(float16)"]
    assert [o.type for o in session.get_outputs()] == ["tensor(float16)"]


def test_bfloat16_inside_a_float32_interface_is_computed_in_float32() -> None:
    model = _narrowed(TensorProto.BFLOAT16, ml_dtypes.bfloat16, interface=False)
    result = requant.api.quantize(model, DIGITS / "calib.npz", eval_data=DIGITS / "eval.npz", measure=False)
    assert result.report["lint"]["int8_kernels"] == {"QLinearConv": 2, "QGemm": 1}
    assert "computed in bfloat16" in result.report["quantizers"]["compute"]
    assert result.report["evaluation"]["top1_agreement"] > 0.99


def test_a_bfloat16_input_is_refused_with_the_reason() -> None:
    with pytest.raises(LoadError, match="input 'x' is bfloat16: ONNX Runtime's Python API takes no bfloat16 arrays"):
        requant.api.quantize(_narrowed(TensorProto.BFLOAT16, ml_dtypes.bfloat16), DIGITS / "calib.npz", measure=False)
