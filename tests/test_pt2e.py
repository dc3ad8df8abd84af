"""requant as a PT2E quantizer: the annotations it writes (golden), and what prepare/convert make of them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("executorch")

from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e  # noqa: E402

from requant.ir.requests import FixedSpec, QuantizationSpec  # noqa: E402
from requant.pt2e import RequantQuantizer, annotations_text  # noqa: E402
from requant.quantizers import INT8_PER_TENSOR, Quantizer  # noqa: E402
from requant.quantizers.config import QuantizationConfig  # noqa: E402
from tests.models.pt2e_cases import make_residual_net  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "pt2e"
EXAMPLE = (torch.linspace(-1, 1, 3 * 8 * 8).reshape(1, 3, 8, 8),)

# a linear layer writing fixed parameters (as a sigmoid's output is given 1/256 on other targets)
FIXED_OUTPUT = QuantizationConfig(
    "int8, output fixed at 1/16",
    input_activation=QuantizationSpec(),
    output_activation=FixedSpec(1 / 16, 0, "int8"),
    weight=QuantizationSpec(symmetric=True, narrow_range=True, granularity="per_axis", axis=0),
)

CASES: dict[str, Callable[[], Quantizer]] = {
    "defaults": lambda: Quantizer().set_global_by_model(),
    "fixed_output": lambda: Quantizer().set_global_by_model().set_op_type("Gemm", FIXED_OUTPUT),
    "module_float": lambda: Quantizer().set_global_by_model().set_module_name("conv2", None),
    "op_type_float": lambda: Quantizer().set_global_by_model().set_op_type("Gemm", None),
    "per_tensor_uint8": lambda: Quantizer().set_global(INT8_PER_TENSOR),
}


def _annotated(case: str) -> tuple[Any, RequantQuantizer]:
    quantizer = RequantQuantizer(CASES[case]())
    graph = torch.export.export(make_residual_net(), EXAMPLE).module()
    prepared = prepare_pt2e(graph, quantizer)
    return prepared, quantizer


@pytest.mark.parametrize("case", sorted(CASES))
def test_annotations_golden(case: str, update_golden: bool) -> None:
    prepared, quantizer = _annotated(case)
    text = (
        annotations_text(prepared)
        + "\n\n"
        + "\n".join(f"{r['node']}: {r['role']}, {r['config']}: {r['decision']}" for r in quantizer.records)
        + "\n"
    )
    path = GOLDEN / f"{case}.txt"
    if update_golden:
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs (pytest --update-golden rewrites it; review the diff)"


def _converted(case: str, samples: list[Any]) -> Any:
    prepared, _ = _annotated(case)
    with torch.no_grad():
        for x in samples:
            prepared(x)
    return convert_pt2e(prepared)


def _ops(module: Any) -> list[str]:
    return [str(n.target) for n in module.graph.nodes if n.op == "call_function"]


def test_converted_program_reads_requant_parameters() -> None:
    """The scale a converted program quantizes the input with is requant's minmax type's, from the
    calibration samples: (max - min) / 255 for int8 affine."""
    samples = [torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    converted = _converted("defaults", samples)
    first_q = next(n for n in converted.graph.nodes if "quantize_per_tensor" in str(n.target))
    scale, zero_point = first_q.args[1], first_q.args[2]
    stacked = torch.cat(samples)
    low, high = min(float(stacked.min()), 0.0), max(float(stacked.max()), 0.0)
    assert scale == pytest.approx((high - low) / 255, rel=1e-6)
    assert zero_point == round(-128 - low / scale)


def test_a_fixed_spec_is_written_as_given_whatever_the_samples() -> None:
    """A FixedSpec becomes torchao's FixedQParamsQuantizationSpec: the linear layer's output is quantized with
    scale 1/16 and zero point 0 (int8), not with parameters observed from the samples."""
    samples = [torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(i)) * 5 for i in range(4)]
    converted = _converted("fixed_output", samples)
    linear = next(n for n in converted.graph.nodes if "linear" in str(n.target))
    (quantize,) = [u for u in linear.users if "quantize_per_tensor" in str(u.target)]
    assert quantize.args[1:] == (1 / 16, 0, -128, 127, torch.int8)


def test_converted_program_is_close_to_float_and_keeps_floats_asked_for() -> None:
    samples = [torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    net = make_residual_net()
    for case in ("defaults", "op_type_float"):
        converted = _converted(case, samples)
        with torch.no_grad():
            f, q = net(samples[0]), converted(samples[0])
        # a few int8 steps of the output's range: each of 4 quantized layers adds up to half a step
        step = float(f.max() - f.min()) / 255
        assert float((f - q).abs().max()) < 8 * step, case
    linears = [n for n in converted.graph.nodes if "linear" in str(n.target)]
    weight_source = linears[0].args[1]
    assert "dequantize" not in str(weight_source.target)  # Gemm asked float: its weight is not quantized
    assert np.isfinite(q.numpy()).all()


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_bias_shift_is_the_weight_error_applied_to_the_input_means(groups: int) -> None:
    """(W_q - W) . E[x] per output channel equals the conv of the weight error over an input holding each
    channel's mean everywhere (no padding): grouped and depthwise convs read their own channels."""
    from requant.pt2e.bias import _shift

    rng = torch.Generator().manual_seed(groups)
    error = torch.randn(8, 8 // groups, 3, 3, generator=rng, dtype=torch.float64)
    mean = torch.randn(8, generator=rng, dtype=torch.float64)
    image = mean.reshape(1, 8, 1, 1).expand(1, 8, 5, 5)
    expected = torch.nn.functional.conv2d(image, error, groups=groups)[0, :, 0, 0]
    torch.testing.assert_close(_shift(error, mean, groups), expected)


def _images() -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    return [{"x": rng.uniform(-1, 1, size=(1, 3, 8, 8)).astype(np.float32)} for _ in range(64)]


def _calibrated(net: Any, data: list[dict[str, Any]] | None = None,
                **given: Any) -> tuple[Any, Any, dict[str, Any], list[dict[str, Any]]]:  # fmt: skip
    """The float program, its prepared module (smoothed and equalized or not, as ``given``), its records,
    and the samples (images unless ``data``)."""
    from requant.options import Options
    from requant.stages import pt2e

    data = data or _images()
    options = Options.create(target="executorch-xnnpack", example_inputs=(torch.from_numpy(data[0]["x"]),),
                             method="minmax", bias_correction=False, **given)  # fmt: skip
    exported = pt2e.export_program(net, options)
    quantizer = RequantQuantizer(options.quantizer, options.chosen_target.presets, methods=("minmax",))
    prepared, record = pt2e._prepared(exported, quantizer, data, options)
    return exported, prepared, {**record, "nodes": quantizer.records}, data


@pytest.mark.parametrize("pad", [False, True])
def test_equalization_evens_the_depthwise_input_and_computes_the_same(pad: bool) -> None:
    """After prepare_pt2e folded the batch norm: the chain is found (through the zero padding), its small
    channels scaled up to half the largest (at most 8x), and the prepared module still computes float's
    outputs (the ReLU6 bound is never reached by these inputs)."""
    from tests.models.pt2e_cases import make_depthwise_block

    net = make_depthwise_block(pad)
    _, prepared, record, data = _calibrated(net, equalization=True)
    (chain,) = record["equalization"]["chains"]
    assert chain["depthwise"] == "conv2d_1" and chain["activation"] in ("relu6", "hardtanh") and not chain["skipped"]
    assert chain["scaled"] >= 8 and chain["largest_factor"] <= 8.0 and chain["spread_after"] < chain["spread_before"]
    x = torch.from_numpy(data[1]["x"])
    with torch.no_grad():
        np.testing.assert_allclose(prepared(x).numpy(), net(x).numpy(), rtol=1e-4, atol=1e-4)
    _, _, off, _ = _calibrated(net, equalization=False)
    assert off["equalization"] == {"enabled": False, "not_applied": "turned off", "chains": []}


def test_weight_rounding_holds_integers_that_convert_keeps_and_beats_nearest() -> None:
    """Error feedback replaces each conv's float weight by integers times its observer's scales: convert_pt2e
    rounds them to themselves, and their output error on the calibration inputs is below nearest rounding's;
    the float weights are kept for bias correction (and survive a copy)."""
    import copy

    from requant.pt2e.equalize import constant
    from requant.pt2e.rounding import FLOAT_WEIGHTS, round_weights, watch_inputs
    from tests.models.pt2e_cases import make_depthwise_block

    _, prepared, _, data = _calibrated(make_depthwise_block(), equalization=False)
    watched, unhook = watch_inputs(prepared)
    with torch.no_grad():
        for sample in data:
            prepared(torch.from_numpy(sample["x"]))
    unhook()
    assert set(watched) == {"conv2d", "conv2d_1", "conv2d_2"} and all(w.moments.enough for w in watched.values())
    record = round_weights(prepared, watched)
    assert record["kernels"], record
    integers = {}
    for kernel in record["kernels"]:
        assert kernel["output_sqnr_db"] > kernel["nearest_output_sqnr_db"] and kernel["moved"] > 0
        entry = watched[kernel["node"]]
        scale, _ = entry.observer.calculate_qparams()
        weight = constant(prepared, str(entry.weight.target)).detach()
        units = (weight / scale.reshape(-1, 1, 1, 1)).numpy()
        np.testing.assert_allclose(units, np.rint(units), atol=1e-3)  # integers times scales
        integers[kernel["node"]] = np.rint(units)
        original = prepared.meta[FLOAT_WEIGHTS][str(entry.weight.target)]
        nearest = torch.round(original / scale.reshape(-1, 1, 1, 1)).numpy()
        assert int((nearest != np.rint(units)).sum()) == kernel["moved"]  # the float weight kept is the one rounded
    assert copy.deepcopy(prepared).meta[FLOAT_WEIGHTS].keys() == prepared.meta[FLOAT_WEIGHTS].keys()
    converted = convert_pt2e(prepared)
    for node in converted.graph.nodes:
        if node.name in integers:  # conv -> dequantize_per_channel(int8 constant, ...)
            stored = constant(converted, str(node.args[1].args[0].target))
            assert stored.dtype == torch.int8
            np.testing.assert_array_equal(stored.numpy(), integers.pop(node.name))
    assert not integers


def test_smoothing_moves_outlier_channels_into_the_weights_and_computes_the_same() -> None:
    """A post-LN block: the LayerNorm's output (three channels 20x the rest) is read by two linear layers
    and the residual sum. They read ``mul(h, 1 / s)`` (kept float), their weights' columns times ``s``; the
    residual sum still reads ``h``; the prepared module computes float's outputs, and the mul's value with its
    factors divided out (what comparisons with float read) is float's ``h``."""
    from requant.pt2e.equalize import FACTORS, constant, unscaled
    from requant.pt2e.quantizer import look_at_outputs
    from tests.models.pt2e_cases import make_post_norm_block

    net = make_post_norm_block()
    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=(1, 6, 16)).astype(np.float32)} for _ in range(64)]
    exported, prepared, record, _ = _calibrated(net, data, smoothing=0.5)
    assert record["smoothing"]["alpha"] == 0.5
    by_input = {r["input"]: r for r in record["smoothing"]["inputs"]}
    norm = by_input["layer_norm"]
    assert (
        norm["linears"] == ["linear_1", "linear_2"]
        and norm["applied"] == "aten.mul 'mul_tensor' before the linear layers"
    )
    assert norm["spread_before"] > 15 and norm["spread_after"] < norm["spread_before"] / 3
    assert by_input["x"]["applied"] is None and "1.3x its median one" in by_input["x"]["skipped"]
    decisions = {r["node"]: r["decision"] for r in record["nodes"]}
    assert decisions["mul_tensor"] == "float: smoothing scales its input per channel"
    x = torch.from_numpy(data[1]["x"])
    with torch.no_grad():
        np.testing.assert_allclose(prepared(x).numpy(), net(x).numpy(), rtol=1e-4, atol=1e-4)
    # the weights' columns times s = 1 / the mul's factors
    s = 1 / prepared.meta[FACTORS]["mul_tensor"]
    assert s.shape == (32,) and s[:3].min() > 2 * np.median(s)  # the outlier channels are divided most
    original = net.q.weight.detach().numpy()
    weights = {n.name: n.args[1] for n in prepared.graph.nodes if n.name == "linear_1"}
    scaled = constant(prepared, str(weights["linear_1"].args[0].target)).detach().numpy()  # behind its observer
    np.testing.assert_allclose(scaled, original * s.astype(np.float32), rtol=1e-6)
    values: dict[str, np.ndarray] = {}
    look_at_outputs(exported.module, [(x,)], lambda n, out: values.__setitem__("float " + n.name, out.numpy()))
    look_at_outputs(prepared, [(x,)], lambda n, out: values.__setitem__(n.name, out.numpy()))
    np.testing.assert_allclose(unscaled(prepared, "mul_tensor", values["mul_tensor"]), values["float layer_norm"],
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    assert _calibrated(net, data, smoothing=0)[2]["smoothing"] == {"alpha": None, "not_applied": "off", "inputs": []}


def test_looking_at_a_prepared_module_counts_nothing() -> None:
    """Bias correction reads its kernels' input means from the prepared module: its observers pass those runs'
    values through without adding them to their statistics (the method choice already read them)."""
    from requant.pt2e.observer import RequantObserver
    from requant.pt2e.quantizer import look_at_outputs

    samples = [torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    prepared, _ = _annotated("defaults")
    with torch.no_grad():
        for x in samples:
            prepared(x)
    observers = [m for m in prepared.modules() if isinstance(m, RequantObserver)]

    def counts() -> list[Any]:
        return [(m.method, m.quantized_type()) for m in observers]

    before = counts()
    seen: list[str] = []
    look_at_outputs(prepared, [(x * 10,) for x in samples], lambda n, out: seen.append(n.name))
    assert seen and counts() == before
    assert not any(m.paused for m in observers)  # observing again afterwards
    with torch.no_grad():
        prepared(samples[0] * 10)
    assert counts() != before
