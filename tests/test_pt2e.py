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
