"""A data set opened once (``requant.calibration.samples``): every stage asks it for samples, a generator is
read once, and the first samples are read from the source once."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir
import pytest

import requant
from requant.calibration import CalibrationError
from requant.calibration.samples import Replayed, Samples
from requant.frontends import load_onnx_text
from tests.test_equalization import _data, _model, _text


def _counted(samples: list[dict[str, np.ndarray]], reads: list[int]) -> Iterator[dict[str, np.ndarray]]:
    for sample in samples:
        reads.append(1)
        yield sample


def test_a_generator_is_read_once_and_a_pass_that_stopped_early_is_continued() -> None:
    reads: list[int] = []
    replayed = Replayed(_counted([{"i": np.array(i)} for i in range(100)], reads), keep=64)
    assert [int(s["i"]) for s in itertools.islice(replayed, 8)] == list(range(8))  # a stage reads the first 8
    assert [int(s["i"]) for s in replayed] == list(range(100))  # the next reads all: the first 8 replayed
    assert len(reads) == 100  # each sample read from the generator once
    assert [int(s["i"]) for s in replayed] == list(range(64))  # then the kept ones only
    assert len(reads) == 100


def test_the_first_samples_are_read_from_the_source_once() -> None:
    model = _model(_text())
    reads: list[int] = []
    samples = Samples(_counted(_data(100), reads))
    first = samples.head(model, 8)
    assert samples.head(model, 8) == first and samples.first(model, 4) == first[:4]
    assert len(reads) == 8
    assert sum(1 for _ in samples.each(model)) == 100 and len(reads) == 100


def test_an_empty_data_set_is_named_when_its_first_samples_are_asked_for() -> None:
    with pytest.raises(CalibrationError, match="the calibration data set is empty"):
        Samples([]).first(_model(_text()), 8)


def test_a_generator_calibrates_on_all_its_samples_when_equalization_reads_the_first_ones_before() -> None:
    """Equalization measures its channels on the first 64 samples before calibration reads them all.
    A generator gave calibration only those 64 (its later samples were dropped): now the same model,
    byte for byte, as from a list of the same 200 samples."""
    data = _data(200)
    data[150]["x"] = data[150]["x"] * 3  # a late sample that widens the input's range
    proto = ir.serde.serialize_model(_model(_text()))
    listed = requant.quantize(proto, data, method="minmax", measure=False)
    streamed = requant.quantize(proto, iter(data), method="minmax", measure=False)
    assert listed.report["equalization"]["chains"][0]["scaled"] > 0  # equalization read the data first
    assert ir.to_proto(streamed.model).SerializeToString() == ir.to_proto(listed.model).SerializeToString()


def test_evaluation_from_a_generator_is_read_by_every_check() -> None:
    """The evaluation and the tensor-by-tensor comparison both read the evaluation data: a generator is
    read once and its first samples replayed (before, the comparison found it empty)."""
    text = """<ir_version: 10, opset_import: ["" : 21]>
g (float[N, 4] x) => (float[N, 3] y) <float[4, 3] w = {0.5, -1., 2., 1., 0.25, -0.5, 1.5, -2., 0.75, 1., 0.5, -1.}> {
  y = MatMul (x, w)
}"""
    proto = ir.to_proto(load_onnx_text(text))
    rng = np.random.default_rng(0)
    calib = [{"x": rng.normal(size=(1, 4)).astype(np.float32)} for _ in range(40)]
    evaluation = [{"x": rng.normal(size=(1, 4)).astype(np.float32)} for _ in range(20)]
    result = requant.quantize(proto, calib, eval_data=iter(evaluation), measure=False)
    listed = requant.quantize(proto, calib, eval_data=evaluation, measure=False)
    assert result.report["evaluation"] == listed.report["evaluation"]
    assert result.report["tensors"] == listed.report["tensors"]


def test_a_data_loaders_tuples_tensors_and_other_names_calibrate_as_the_arrays_do() -> None:
    """The same 64 digits as a torch DataLoader of (image, label) batches of one, as bare tensors, as dicts under
    another name than the input's (``input`` for ``x``) and as arrays by name: one model, to the byte."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from tests.test_budget import DIGITS

    x = np.load(DIGITS / "calib.npz")["x"][:64]
    labels = torch.zeros(64, dtype=torch.int64)

    def quantized(data: object) -> bytes:
        result = requant.quantize(DIGITS / "digits_cnn.onnx", data, measure=False, bias_correction=False)
        return ir.to_proto(result.model).SerializeToString()

    expected = quantized({"x": x})
    loader = DataLoader(TensorDataset(torch.from_numpy(x[:, 0]).unsqueeze(1), labels), batch_size=1)
    assert quantized(loader) == expected
    assert quantized([torch.from_numpy(x[i : i + 1]) for i in range(64)]) == expected
    assert quantized([{"input": x[i : i + 1]} for i in range(64)]) == expected


def test_a_tuple_that_does_not_fit_the_inputs_is_an_error_naming_them() -> None:
    from tests.test_budget import DIGITS

    x = np.load(DIGITS / "calib.npz")["x"][:1]
    with pytest.raises(CalibrationError, match=r"calibration sample 1: a tuple of 3 values for a model of 1 input\(s\) "
                                               r"\(x\): give one value per input"):  # fmt: skip
        requant.quantize(DIGITS / "digits_cnn.onnx", [(x, x, x)], measure=False)
