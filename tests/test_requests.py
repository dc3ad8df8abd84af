"""Quantization requests and configs: validation, text round trip, annotations on the IR."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from requant.frontends import load_onnx, load_onnx_text, save_onnx
from requant.ir import AnnotationError, print_model, request, set_request
from requant.ir.verifier import VerifyError, verify_model
from requant.passes import get_passes, run_passes
from requant.quantizers import (
    DTYPES,
    INT4_BLOCKWISE_WEIGHTS,
    INT8_PER_CHANNEL_WEIGHTS,
    KNOWN_OBSERVERS,
    PRESETS,
    DerivedBias,
    DerivedSpec,
    FixedSpec,
    NoQuant,
    QuantizationConfig,
    QuantizationSpec,
    RequestError,
    SharedSpec,
    parse_request,
    register_observer,
)

options = st.dictionaries(
    st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True),
    st.one_of(st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=10)),
    max_size=3,
)  # fmt: skip
register_observer("zz_user_observer")  # an observer of the user's own takes any options (sorts last in lists)
# the built-in observers take their own options, checked (requant.ir.requests._OPTIONS)
observers = st.one_of(
    st.builds(dict, observer=st.sampled_from(sorted(KNOWN_OBSERVERS)), observer_options=st.just({})),
    st.builds(dict, observer=st.just("zz_user_observer"), observer_options=options),
    st.builds(dict, observer=st.just("percentile"), observer_options=st.fixed_dictionaries(
        {"percentile": st.floats(50.001, 100), "bins": st.integers(2, 4096)})),
    st.builds(dict, observer=st.just("moving_average_minmax"), observer_options=st.fixed_dictionaries(
        {"averaging_constant": st.floats(1e-6, 1)})),
)  # fmt: skip


@st.composite
def specs(draw: st.DrawFn) -> QuantizationSpec:
    granularity = draw(st.sampled_from(["per_tensor", "per_axis", "blockwise"]))
    return QuantizationSpec(
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        symmetric=draw(st.booleans()),
        narrow_range=draw(st.booleans()),
        reduce_range=draw(st.booleans()),
        granularity=granularity,
        axis=None if granularity == "per_tensor" else draw(st.integers(-4, 4)),
        block_size=draw(st.integers(1, 256)) if granularity == "blockwise" else None,
        **draw(observers),
    )


@given(specs())
def test_spec_text_round_trip(spec: QuantizationSpec) -> None:
    again = parse_request(str(spec))
    assert again == spec and hash(again) == hash(spec) and str(again) == str(spec)


@pytest.mark.parametrize(
    "request_",
    [SharedSpec("conv_out"), DerivedSpec(("x", "w")), FixedSpec(1 / 256), FixedSpec(0.5, -3, "int8"), NoQuant()],
)
def test_other_requests_round_trip(request_: object) -> None:
    assert parse_request(str(request_)) == request_


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: QuantizationSpec("int9"), "dtype 'int9' is not one of int16, int32, int4, int8, uint16, uint4, uint8"),
        (lambda: QuantizationSpec(granularity="per_row"), "granularity 'per_row' is not one of"),
        (lambda: QuantizationSpec(observer="kl"), "observer 'kl' is not one of entropy, mean_minmax, minmax"),
        (lambda: QuantizationSpec(granularity="per_axis"), "needs an integer axis"),
        (lambda: QuantizationSpec(axis=1), "'per_tensor' takes no axis"),
        (lambda: QuantizationSpec(granularity="blockwise", axis=0), "needs a block_size of at least 1"),
        (lambda: QuantizationSpec(granularity="per_axis", axis=0, block_size=4), "block_size is only for"),
        (lambda: QuantizationSpec(symmetric=1), "symmetric must be True or False"),  # type: ignore[arg-type]
        (lambda: QuantizationSpec(observer_options={"p": [1]}), "must be a number, a string or a bool"),
        (lambda: SharedSpec("no spaces"), "must name a value"),
        (lambda: DerivedSpec(()), "at least one source"),
        (lambda: DerivedSpec(("x",), rule="sum"), "derivation rule 'sum' is not one of product_of_scales"),
        (lambda: FixedSpec(0.0), "FixedSpec: scale 0.000000e\\+00 out of expressed type range"),
        (lambda: FixedSpec(0.1, 300), "zero point 300 out of storage type u8 range"),
        (lambda: parse_request("#requant.spec<int8>"), "invalid quantization request"),
        (lambda: parse_request("int8"), "expected #requant.spec"),
        (lambda: QuantizationConfig(""), "needs a name"),
        (lambda: QuantizationConfig("c", weight=FixedSpec(0.5)), "weight must be one of QuantizationSpec, NoQuant"),
        (lambda: DerivedBias("int64"), "bias dtype 'int64' is not one of"),
    ],
)
def test_invalid_requests_say_what_is_allowed(make: object, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        make()  # type: ignore[operator]


def test_specs_are_frozen() -> None:
    spec = QuantizationSpec(observer="percentile", observer_options={"percentile": 99.9})
    with pytest.raises(AttributeError):
        spec.dtype = "uint8"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.observer_options["percentile"] = 50.0  # type: ignore[index]


def test_user_observers_can_be_registered() -> None:
    with pytest.raises(RequestError):
        QuantizationSpec(observer="my_ranger")
    register_observer("my_ranger")
    assert QuantizationSpec(observer="my_ranger").observer == "my_ranger"
    with pytest.raises(RequestError, match="observer name"):
        register_observer("two words")


def test_presets() -> None:
    assert set(PRESETS) == {
        "INT8_PER_TENSOR", "INT8_PER_CHANNEL_WEIGHTS", "INT8_REDUCED_RANGE_WEIGHTS", "UINT8_PER_CHANNEL_WEIGHTS",
        "UINT8_FLOAT_OUTPUTS", "INT8_FLOAT_OUTPUTS", "A16W8", "INT8_FLOAT_BIAS", "INT8_DYNAMIC_LINEAR", "INT4_BLOCKWISE_WEIGHTS"
    }  # fmt: skip
    reduced = PRESETS["INT8_REDUCED_RANGE_WEIGHTS"].weight
    assert str(reduced) == "#requant.spec<int8, symmetric, reduced, per_axis = 0, observer = minmax>"
    uint8 = PRESETS["UINT8_PER_CHANNEL_WEIGHTS"].weight
    assert str(uint8) == "#requant.spec<uint8, symmetric, per_axis = 0, observer = minmax>"
    weight = INT8_PER_CHANNEL_WEIGHTS.weight
    assert isinstance(weight, QuantizationSpec) and (weight.storage, weight.granularity) == ("i8", "per_axis")
    assert isinstance(INT8_PER_CHANNEL_WEIGHTS.input_activation, QuantizationSpec)
    assert INT8_PER_CHANNEL_WEIGHTS.input_activation.storage == "u8"  # what x86 int8 kernels run fastest
    assert isinstance(INT4_BLOCKWISE_WEIGHTS.input_activation, NoQuant)
    assert str(INT8_PER_CHANNEL_WEIGHTS) == "INT8_PER_CHANNEL_WEIGHTS"


MODEL = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[N,4] X, int64[N] I) => (float[N,4] Y) {
    A = Relu(X)
    B = Identity(A)
    Y = Neg(B)
}
"""


def value(model: object, name: str) -> object:
    from requant.ir.annotations import iter_values

    return next(v for v in iter_values(model.graph) if v.name == name)  # type: ignore[attr-defined]


def test_requests_on_values_print_persist_and_survive_rewrites(tmp_path: Path) -> None:
    model = load_onnx_text(MODEL)
    spec = QuantizationSpec("uint8", observer="percentile", observer_options={"percentile": 99.99})
    set_request(value(model, "X"), QuantizationSpec("int8", True, granularity="per_axis", axis=1))
    set_request(value(model, "B"), spec)
    set_request(value(model, "Y"), SharedSpec("X"))
    text = print_model(model)
    assert "%X: tensor<Nx4xf32> #requant.spec<int8, symmetric, per_axis = 1, observer = minmax>" in text
    model, _ = run_passes(model, get_passes("remove-identity"))  # B goes; its request moves to A
    assert request(value(model, "A")) == spec
    save_onnx(model, tmp_path / "m.onnx")
    again = load_onnx(tmp_path / "m.onnx")
    assert request(value(again, "A")) == spec and request(value(again, "Y")) == SharedSpec("X")
    assert print_model(again) == print_model(model)


def test_requests_are_checked_against_their_values() -> None:
    model = load_onnx_text(MODEL)
    with pytest.raises(AnnotationError, match="rank 2: axis 2 .* is out of range"):
        set_request(value(model, "X"), QuantizationSpec(granularity="per_axis", axis=2))
    with pytest.raises(AnnotationError, match="holds i64 values"):
        set_request(value(model, "I"), QuantizationSpec())
    set_request(value(model, "I"), NoQuant())  # keeping an integer value as it is is fine
    set_request(value(model, "Y"), DerivedSpec(("X", "W_missing")))
    with pytest.raises(VerifyError, match="asks for #requant.derived<.*>, but no value is named 'W_missing'"):
        verify_model(model)
