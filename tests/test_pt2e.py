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

from requant.pt2e import RequantQuantizer, annotations_text  # noqa: E402
from requant.quantizers import INT8_PER_TENSOR, Quantizer  # noqa: E402
from tests.models.pt2e_cases import make_residual_net  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "pt2e"
EXAMPLE = (torch.linspace(-1, 1, 3 * 8 * 8).reshape(1, 3, 8, 8),)

CASES: dict[str, Callable[[], Quantizer]] = {
    "defaults": lambda: Quantizer().set_global_by_model(),
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


def _calibrated(net: Any, equalization: bool) -> tuple[Any, Any, dict[str, Any], list[dict[str, Any]]]:
    """The float program, its prepared module (equalized or not, calibrated, weights rounded), its records,
    and the samples."""
    from requant.options import Options
    from requant.stages import pt2e

    rng = np.random.default_rng(0)
    data = [{"x": rng.uniform(-1, 1, size=(1, 3, 8, 8)).astype(np.float32)} for _ in range(64)]
    options = Options.create(target="executorch-xnnpack", example_inputs=(torch.from_numpy(data[0]["x"]),),
                             equalization=equalization, method="minmax", bias_correction=False)  # fmt: skip
    exported = pt2e.export_program(net, options)
    quantizer = RequantQuantizer(None, methods=("minmax",))
    prepared, record = pt2e._prepared(exported, quantizer, data, options)
    return exported, prepared, record, data


@pytest.mark.parametrize("pad", [False, True])
def test_equalization_evens_the_depthwise_input_and_computes_the_same(pad: bool) -> None:
    """After prepare_pt2e folded the batch norm: the chain is found (through the zero padding), its small
    channels scaled up to half the largest (at most 8x), and the prepared module still computes float's
    outputs (the ReLU6 bound is never reached by these inputs)."""
    from tests.models.pt2e_cases import make_depthwise_block

    net = make_depthwise_block(pad)
    _, prepared, record, data = _calibrated(net, equalization=True)
    (chain,) = record["chains"]
    assert chain["depthwise"] == "conv2d_1" and chain["activation"] in ("relu6", "hardtanh") and not chain["skipped"]
    assert chain["scaled"] >= 8 and chain["largest_factor"] <= 8.0 and chain["spread_after"] < chain["spread_before"]
    x = torch.from_numpy(data[1]["x"])
    with torch.no_grad():
        np.testing.assert_allclose(prepared(x).numpy(), net(x).numpy(), rtol=1e-4, atol=1e-4)
    _, _, off, _ = _calibrated(net, equalization=False)
    assert off == {"enabled": False, "not_applied": "turned off", "chains": []}


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
