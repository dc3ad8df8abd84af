"""requant.pt2e.fused: the converted program as it is compared (method choice, bias correction) computes the
converted program's own numbers, bit for bit, whether built from the converted module or simulated from the
prepared one without converting."""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e  # noqa: E402

from requant.pt2e import RequantQuantizer  # noqa: E402
from requant.pt2e.bias import static_kernels  # noqa: E402
from requant.pt2e.equalize import constant  # noqa: E402
from requant.pt2e.fused import fused, rounded, simulated  # noqa: E402
from requant.stages.pt2e import AUTO_METHODS, _use  # noqa: E402
from tests.models.pt2e_cases import make_depthwise_block, make_residual_net  # noqa: E402
from tests.test_pt2e import CASES, EXAMPLE  # noqa: E402


def _samples(shape: tuple[int, ...], count: int = 12) -> list[Any]:
    return [torch.randn(*shape, generator=torch.Generator().manual_seed(i)) * 2 for i in range(count)]


def _prepared(net: Any, case: str, samples: list[Any]) -> Any:
    quantizer = RequantQuantizer(CASES[case](), methods=AUTO_METHODS)
    prepared = prepare_pt2e(torch.export.export(net, (samples[0],)).module(), quantizer)
    with torch.no_grad():
        for x in samples:
            prepared(x)
    return prepared


def _quantize_ops(module: Any) -> list[str]:
    return [str(n.target) for n in module.graph.nodes if "quantized_decomposed" in str(n.target)]


@pytest.mark.parametrize("case", ["defaults", "per_tensor_uint8", "fixed_output", "module_float"])
def test_fused_and_simulated_programs_compute_the_converted_numbers(case: str) -> None:
    samples = _samples(tuple(EXAMPLE[0].shape))
    prepared = _prepared(make_residual_net(), case, samples)
    for method in AUTO_METHODS:
        _use(prepared, method)
        converted = convert_pt2e(copy.deepcopy(prepared))
        programs = {"fused": fused(converted), "simulated": simulated(prepared)}
        for name, program in programs.items():
            assert program is not None and _quantize_ops(program) == [], (case, method, name)
        with torch.no_grad():
            for x in samples[:4]:
                expected = converted(x)
                for name, program in programs.items():
                    torch.testing.assert_close(program(x), expected, rtol=0, atol=0, msg=f"{case} {method} {name}")


def test_depthwise_weights_per_channel_are_simulated_exactly() -> None:
    samples = _samples((1, 3, 8, 8))
    prepared = _prepared(make_depthwise_block(True), "defaults", samples)
    converted = convert_pt2e(copy.deepcopy(prepared))
    program = simulated(prepared)
    assert program is not None
    with torch.no_grad():
        torch.testing.assert_close(program(samples[0]), converted(samples[0]), rtol=0, atol=0)


def test_fused_copy_reads_the_biases_the_program_holds() -> None:
    """Bias correction changes the converted program's biases in place: the fused copy computes with them."""
    samples = _samples(tuple(EXAMPLE[0].shape))
    converted = convert_pt2e(_prepared(make_residual_net(), "defaults", samples))
    program = fused(converted)
    kernels = static_kernels(converted)  # what bias correction changes
    assert kernels
    bias = constant(converted, next(iter(kernels.values())))
    with torch.no_grad():
        bias.add_(0.5)
        torch.testing.assert_close(program(samples[0]), converted(samples[0]), rtol=0, atol=0)


def test_rounded_is_quantize_then_dequantize() -> None:
    x = torch.tensor([-3.0, -0.05, 0.0, 0.049, 0.051, 0.15, 0.25, 9.0])
    # scale 0.1, zero point 3, int8-like bounds [-5, 10]: codes clamp(round(x / 0.1) + 3), then back
    expected = (torch.clamp(torch.round(x / 0.1) + 3, -5, 10) - 3) * 0.1
    torch.testing.assert_close(rounded(x, 0.1, 3, -5, 10), expected)
    assert rounded(x, 0.1, 3, -5, 10).data_ptr() != x.data_ptr()  # the input is not changed in place
