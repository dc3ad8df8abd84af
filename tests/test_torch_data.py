"""A PyTorch module and its data as a PyTorch user has them: no ``example_inputs`` (taken from the first
calibration sample), a ``DataLoader`` of ``(image, label)`` batches (the labels give accuracy), NNCF's
``transform_fn`` convention (``transform=``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
import pytest

import requant
from requant.calibration import CalibrationError
from requant.errors import ArgumentError
from requant.frontends import LoadError
from requant.report.markdown import to_markdown

torch = pytest.importorskip("torch")
DataLoader, TensorDataset = torch.utils.data.DataLoader, torch.utils.data.TensorDataset


@pytest.fixture(scope="module")
def digits() -> tuple[Any, tuple[np.ndarray, ...]]:
    from tests.models.digits import digits_split, train_digits_cnn

    net, _ = train_digits_cnn()
    return net, digits_split()


def _loaders(data: tuple[np.ndarray, ...]) -> tuple[Any, Any]:
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in data)
    calibration = DataLoader(TensorDataset(x_train[:96], y_train[:96]), batch_size=16)
    evaluation = DataLoader(TensorDataset(x_test[:60], y_test[:60]), batch_size=8)  # the last batch of 4
    return calibration, evaluation


def _bytes(result: requant.api.QuantizedModel) -> bytes:
    assert result.model is not None
    return ir.to_proto(result.model).SerializeToString()


def test_a_module_without_example_inputs_is_exported_from_its_data_loaders_first_batch(digits: Any) -> None:
    """The DataLoader's first batch of 16 is the example, its batch axis left dynamic (the evaluation's last
    batch of 4 runs); its labels give the accuracy; a generator of the same batches, and dicts turned into
    them by ``transform``, give the same bytes."""
    net, data = digits
    calibration, evaluation = _loaders(data)
    result = requant.quantize(net, calibration, eval_data=evaluation, measure=False)
    assert result.report["example_inputs"] == "the first calibration sample: x [16, 1, 8, 8] float32"
    assert "| example inputs | the first calibration sample: x [16, 1, 8, 8] float32 |" in to_markdown(result.report)
    assert result.model is not None and not isinstance(result.model.graph.inputs[0].shape[0], int)
    with torch.no_grad():
        expected = float((net(torch.from_numpy(data[2][:60])).argmax(1).numpy() == data[3][:60]).mean())
    ev = result.report["evaluation"]
    assert ev["samples"] == 60 and ev["float_accuracy"] == expected and ev["int8_accuracy"] >= expected - 2 / 60
    assert _bytes(requant.quantize(net, iter(calibration), measure=False)) == _bytes(result)
    dicts = [{"image": x, "label": y} for x, y in calibration]
    same = requant.quantize(net, dicts, measure=False, transform=lambda d: (d["image"], d["label"]))
    assert _bytes(same) == _bytes(result)


def test_targets_that_are_not_one_class_index_per_sample_give_no_accuracy(digits: Any) -> None:
    """A float target (a regression's) and one integer map per sample (a segmentation's) are not class labels:
    the evaluation says agreement with float only, as without targets."""
    net, data = digits
    x, y = data[2][:8], data[3][:8]
    for target in (y.astype(np.float32), np.zeros((8, 8, 8), np.int64)):
        evaluation = [(x[i : i + 1], target[i : i + 1]) for i in range(8)]
        report = requant.quantize(net, (x[i : i + 1] for i in range(8)), eval_data=evaluation, measure=False).report
        assert "float_accuracy" not in report["evaluation"] and report["evaluation"]["samples"] == 8


def test_data_that_does_not_fit_forward_and_a_failing_transform_are_errors_naming_them(digits: Any) -> None:
    net, data = digits
    x = data[0][:2]
    with pytest.raises(LoadError, match=r"the first calibration sample \(a, b\) does not fit DigitsCNN.forward's "
                                        r"inputs \(x\): give the module's example_inputs="):  # fmt: skip
        requant.quantize(net, [{"a": x, "b": x}], measure=False)

    def broken(item: Any) -> Any:
        raise ValueError("no image here")

    with pytest.raises(CalibrationError, match="calibration sample 1: transform raised ValueError: no image here"):
        requant.quantize(net, [x], measure=False, transform=broken)
    with pytest.raises(ArgumentError, match="transform applies to the items of iterable data"):
        requant.quantize(net, {"x": x}, measure=False, transform=lambda item: item)


def test_the_executorch_target_takes_its_example_from_the_first_sample_too(digits: Any) -> None:
    net, data = digits
    calibration, _ = _loaders(data)
    result = requant.quantize(net, calibration, target="executorch-xnnpack", measure=False)
    assert result.report["example_inputs"] == "the first calibration sample: x [16, 1, 8, 8] float32"
    assert result.pte is not None


def test_an_accuracy_budget_reads_a_data_loaders_labels(digits: Any) -> None:
    """The budget measures accuracy (the default with labels, or asked for) from the (image, label) batches."""
    net, data = digits
    calibration, evaluation = _loaders(data)
    for metric in (None, "accuracy"):
        report = requant.quantize(net, calibration, eval_data=evaluation, measure=False, max_drop=0.05,
                                  metric=metric).report  # fmt: skip
        budget = report["accuracy_budget"]
        assert budget["metric"] == "accuracy" and budget["met"], budget
