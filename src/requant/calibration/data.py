"""Calibration data: samples as ``{input name: array}``, from files, dicts or iterables, checked against the model.

Accepted forms:

- a ``.npz`` file, or a dict ``{input name: array}``: arrays whose first axis indexes samples;
  each sample keeps a batch dimension of 1;
- a ``.npy`` file, or one array, for a single-input model, the same way;
- a folder of ``.npz``/``.npy`` files, each one sample (or a batch), in file-name order;
- an iterable (a list, a generator) of ``{input name: array}`` dicts, each one model run;
- an :class:`~requant.calibration.images.ImageFolder`: a folder of images with its stated
  preprocessing (a folder of images given as a plain path is an error that says so).

Every sample is checked before it is used: the model's inputs are all there and no other names
are; ranks and static dimensions match (symbolic ones may differ from sample to sample); float
arrays are cast to the input's float type, integer arrays to its integer type. A mismatch names
the input and the sample.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.calibration.images import ImageFolder, image_files
from requant.calibration.observers import CalibrationError

__all__ = ["Sample", "check_sample", "iter_samples", "model_inputs"]

Sample = dict[str, npt.NDArray[Any]]


def model_inputs(model: ir.Model) -> list[ir.Value]:
    """The inputs a sample feeds (not those that are initializers)."""
    return [v for v in model.graph.inputs if v.name not in model.graph.initializers]


def check_sample(model: ir.Model, sample: Mapping[str, Any], where: str) -> Sample:
    """The sample as the model takes it, or a :class:`CalibrationError` naming the input."""
    return _check(_specs(model), sample, where)


_Spec = tuple[str, np.dtype[Any] | None, tuple[int | str, ...] | None]  # name, dtype, shape (str: symbolic)


def _specs(model: ir.Model) -> list[_Spec]:
    """What each input takes: read once per data set, not once per sample."""
    return [
        (
            str(v.name),
            np.dtype(v.dtype.numpy()) if v.dtype is not None else None,
            tuple(d if isinstance(d, int) else str(d) for d in v.shape) if v.shape is not None else None,
        )
        for v in model_inputs(model)
    ]


def _shape_text(shape: tuple[int | str, ...]) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def _check(specs: list[_Spec], sample: Mapping[str, Any], where: str) -> Sample:
    if not isinstance(sample, Mapping):
        raise CalibrationError(f"{where}: expected a dict of input name -> array, got {type(sample).__name__}")
    if len(sample) > len(specs) or any(name not in sample for name, _, _ in specs):
        names = {name for name, _, _ in specs}
        unknown = sorted(set(sample) - names)
        if unknown:
            raise CalibrationError(
                f"{where}: the model has no input named {', '.join(map(repr, unknown))} "
                f"(its inputs: {', '.join(sorted(names))})"
            )
    out: Sample = {}
    for name, want_dtype, shape in specs:
        if name not in sample:
            raise CalibrationError(f"{where}: input '{name}' is missing")
        array = np.asarray(sample[name])
        dtype = want_dtype if want_dtype is not None else array.dtype
        if array.dtype != dtype:
            if (dtype.kind == "f" and array.dtype.kind in "fiu") or (dtype.kind in "iu" and array.dtype.kind in "iu"):
                array = array.astype(dtype)
            else:
                raise CalibrationError(f"{where}: input '{name}' expects {dtype}, got {array.dtype}")
        if shape is not None:
            if array.ndim != len(shape):
                raise CalibrationError(
                    f"{where}: input '{name}' expects rank {len(shape)} (shape {_shape_text(shape)}), "
                    f"got shape {array.shape}"
                )
            for axis, (want, got) in enumerate(zip(shape, array.shape, strict=True)):
                if isinstance(want, int) and want != got:
                    raise CalibrationError(
                        f"{where}: input '{name}' expects size {want} on axis {axis} "
                        f"(shape {_shape_text(shape)}), got shape {array.shape}"
                    )
        out[name] = array
    return out


def _rows(arrays: Mapping[str, Any]) -> Iterator[Sample]:
    lengths = {name: len(np.asarray(a)) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise CalibrationError(f"calibration arrays differ in their number of samples: {lengths}")
    count = next(iter(lengths.values()), 0)
    for i in range(count):
        yield {name: np.asarray(a)[i : i + 1] for name, a in arrays.items()}


def _from_file(path: Path, single_input: str | None) -> Iterator[Sample]:
    if path.suffix == ".npz":
        with np.load(path) as data:
            yield from _rows({k: data[k] for k in data.files})
    elif path.suffix == ".npy":
        if single_input is None:
            raise CalibrationError(
                f"'{path}': a .npy file can only feed a single-input model; use .npz with input names"
            )
        yield from _rows({single_input: np.load(path)})
    else:
        raise CalibrationError(f"'{path}': calibration files are .npz or .npy")


def _raw(source: Any, single_input: str | None) -> Iterator[Any]:
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in (".npz", ".npy"))
            if not files and image_files(path):
                raise CalibrationError(
                    f"'{path}' holds images: state how to preprocess them, with ImageFolder(path, IMAGENET) "
                    "in Python, or --images imagenet (or an [images] table in --config) on the command line"
                )
            if not files:
                raise CalibrationError(f"'{path}' holds no .npz or .npy files")
            for file in files:
                if file.suffix == ".npz":
                    with np.load(file) as data:
                        yield {k: data[k] for k in data.files}
                elif single_input is None:
                    raise CalibrationError(
                        f"'{file}': a .npy file can only feed a single-input model; use .npz with input names"
                    )
                else:
                    yield {single_input: np.load(file)}
            return
        if not path.is_file():
            raise CalibrationError(f"no calibration data at '{path}'")
        yield from _from_file(path, single_input)
    elif isinstance(source, np.ndarray):
        if single_input is None:
            raise CalibrationError("one array can only feed a single-input model; give a dict of input name -> array")
        yield from _rows({single_input: source})
    elif isinstance(source, Mapping):
        yield from _rows(source)
    elif isinstance(source, Iterable):
        yield from source
    else:
        raise CalibrationError(f"cannot read calibration data from a {type(source).__name__}")


def iter_samples(model: ir.Model, source: Any) -> Iterator[Sample]:
    """The checked samples of ``source`` for ``model``; an empty source is an error."""
    inputs = model_inputs(model)
    specs = _specs(model)
    single = str(inputs[0].name) if len(inputs) == 1 else None
    count = 0
    raws = source.samples(model, inputs) if isinstance(source, ImageFolder) else _raw(source, single)
    for count, raw in enumerate(raws, start=1):
        yield _check(specs, raw, f"calibration sample {count}")
    if count == 0:
        raise CalibrationError("the calibration data set is empty")
