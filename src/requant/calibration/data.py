"""Calibration data: samples as ``{input name: array}``, from files, dicts or iterables, checked against the model.

Accepted forms:

- a ``.npz`` file, or a dict ``{input name: array}``: arrays whose first axis indexes samples;
  each sample keeps a batch dimension of 1;
- a ``.npy`` file, or one array, for a single-input model, the same way;
- a folder of ``.npz``/``.npy`` files, each one sample (or a batch), in file-name order;
- an iterable (a list, a generator, a ``torch.utils.data.DataLoader``) of samples, each one model run
  (a generator is read once: what needs data again gets its first samples, see
  :class:`~requant.calibration.samples.Replayed`). A sample is matched to the model's inputs
  (:func:`matched`): a dict by its names, or by position where none of its names is an input's and it
  has one entry per input (``{"input": x}`` for an input named ``x``); a tuple or list by position,
  where one element more than the model has inputs is the target a data loader yields with them
  (``(x, y)``), not fed (kept as the sample's ``target``: :class:`Labelled`); one array or tensor, for a
  single-input model. Torch tensors are read as arrays (``transform=``, NNCF's ``transform_fn``, is applied
  to each item first: :func:`transformed`);
- an :class:`~requant.calibration.images.ImageFolder`: a folder of images with its stated
  preprocessing (a folder of images given as a plain path is an error that says so).

Every sample is checked before it is used: the model's inputs are all there and no other names
are; ranks and static dimensions match (symbolic ones may differ from sample to sample); float
arrays are cast to the input's float type, integer arrays to its integer type; float values are
finite. A mismatch names the input and the sample. After the last sample, one sample whose
largest magnitude at an input is more than a million times the median sample's (a stray 1e30)
is an error too: alone, it would set that input's whole range.

An input without a batch axis (a state ``[2, B, 128]``, a scalar) cannot be cut from a ``.npz``
along its first axis: give such data as a folder of one file per sample.
"""

from __future__ import annotations

import array as pyarray
import io
import math
import os
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.calibration.images import ImageFolder, image_files
from requant.calibration.observers import CalibrationError
from requant.frontends.fixed import fixed_inputs

__all__ = [
    "Labelled",
    "Sample",
    "check_exists",
    "check_sample",
    "checked_samples",
    "first_sample",
    "input_specs",
    "iterable",
    "labels_of",
    "matched",
    "model_inputs",
    "read_labels",
    "samples_for",
    "transformed",
]

# Statistics over samples *and positions* (means, channel maxima) settle with the number of input values
# (64 samples of a 3x224x224 image), so larger inputs need fewer samples, down to MIN_SAMPLES.
# A MobileNetV2 at 736x992, 32 samples: bias correction took 17.2 s of 25.6 s to quantize.
VALUES = 64 * 3 * 224 * 224
MIN_SAMPLES = 8

Sample = dict[str, npt.NDArray[Any]]


def samples_for(values_per_sample: int, requested: int, values: int = VALUES) -> int:
    """How many samples a pass measuring means or maxima runs on: ``requested``, or fewer when each
    sample holds more than a 3x224x224 image's values (never fewer than ``MIN_SAMPLES``); ``values``:
    the input values the pass needs (``VALUES``, 64 such images')."""
    wanted = max(MIN_SAMPLES, math.ceil(values / max(values_per_sample, 1)))
    return max(1, min(requested, wanted))


def model_inputs(model: ir.Model) -> list[ir.Value]:
    """The inputs a sample feeds (not those that are initializers)."""
    return [v for v in model.graph.inputs if v.name not in model.graph.initializers]


def check_sample(model: ir.Model, sample: Mapping[str, Any], where: str) -> Sample:
    """The sample as the model takes it, or a :class:`CalibrationError` naming the input."""
    return _check(input_specs(model), sample, where)


_Spec = tuple[str, np.dtype[Any] | None, tuple[int | str, ...] | None]  # name, dtype, shape (str: symbolic)


def input_specs(model: ir.Model) -> tuple[_Spec, ...]:
    """What each input takes (name, dtype, shape): read once per data set, not once per sample."""
    return tuple(
        (
            str(v.name),
            np.dtype(v.dtype.numpy()) if v.dtype is not None else None,
            tuple(d if isinstance(d, int) else str(d) for d in v.shape) if v.shape is not None else None,
        )
        for v in model_inputs(model)
    )


def _shape_text(shape: tuple[int | str, ...]) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def _floating(dtype: np.dtype[Any]) -> bool:
    """NumPy's floats, and ml_dtypes' (bfloat16, float8...: kind 'V' to NumPy) that onnx-ir maps ONNX's to."""
    return dtype.kind == "f" or (dtype.kind == "V" and "float" in dtype.name)


def _peak(array: npt.NDArray[Any]) -> float:
    """The largest magnitude, without a temporary array the size of the sample."""
    if array.dtype.kind != "f":  # ml_dtypes' floats
        array = array.astype(np.float32)
    return max(-float(array.min()), float(array.max()))


def _nonfinite(array: npt.NDArray[Any]) -> bool:
    return not np.isfinite(array if array.dtype.kind == "f" else array.astype(np.float32)).all()


# one sample's peak above this many times the median sample's: an outlier (a stray 1e30), not data
OUTLIER_RATIO = 1e6
_BATCH_HINT = (
    "; a .npz or array gives samples along its first axis, each keeping a batch axis of 1: give "
    "inputs without one as a folder of one .npz per sample"
)


def _check(specs: tuple[_Spec, ...], sample: Mapping[str, Any], where: str, hint: str = "") -> Sample:
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
        given = array = np.asarray(sample[name])
        dtype = want_dtype if want_dtype is not None else array.dtype
        if array.dtype != dtype:
            if (_floating(dtype) and array.dtype.kind in "fiu") or (dtype.kind in "iu" and array.dtype.kind in "iu"):
                with np.errstate(over="ignore"):
                    array = array.astype(dtype)
            else:
                raise CalibrationError(f"{where}: input '{name}' expects {dtype}, got {array.dtype}")
        if shape is not None:
            if array.ndim != len(shape):
                raise CalibrationError(
                    f"{where}: input '{name}' expects rank {len(shape)} (shape {_shape_text(shape)}), "
                    f"got shape {array.shape}{hint}"
                )
            for axis, (want, got) in enumerate(zip(shape, array.shape, strict=True)):
                if isinstance(want, int) and want > 0 and want != got:  # -1 and 0 mark dynamic dims too
                    raise CalibrationError(
                        f"{where}: input '{name}' expects size {want} on axis {axis} "
                        f"(shape {_shape_text(shape)}), got shape {array.shape}{hint}"
                    )
        if _floating(array.dtype) and _nonfinite(array):
            if given is not array and given.dtype.kind == "f" and not _nonfinite(given):  # the cast overflowed
                peak, top = float(np.max(np.abs(given))), float(np.finfo(array.dtype).max)
                raise CalibrationError(
                    f"{where}: input '{name}' holds {peak:.3g}, beyond {array.dtype}'s range ({top:.3g}): "
                    "it would become infinite"
                )
            array32 = array.astype(np.float32) if array.dtype.kind != "f" else array
            bad = ~np.isfinite(array32)
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            kinds = " and ".join(k for k, m in (("NaN", np.isnan(array32)), ("infinite", np.isinf(array32))) if m.any())
            raise CalibrationError(
                f"{where}: input '{name}' has {int(bad.sum())} {kinds} value(s) (the first at index {list(first)}); "
                "calibration and evaluation need finite data: fix or drop the sample"
            )
        out[name] = array
    return out


def _scalar(what: str, name: str) -> CalibrationError:
    return CalibrationError(
        f"{what} array '{name}' is 0-d (a scalar): arrays give samples along their first axis; "
        "give a scalar input as a folder of one .npz per sample"
    )


def _rows(arrays: Mapping[str, Any], what: str) -> Iterator[Sample]:
    for name, a in arrays.items():
        if np.ndim(a) == 0:
            raise _scalar(what, name)
    lengths = {name: len(np.asarray(a)) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise CalibrationError(f"{what} arrays differ in their number of samples: {lengths}")
    count = next(iter(lengths.values()), 0)
    for i in range(count):
        yield {name: np.asarray(a)[i : i + 1] for name, a in arrays.items()}


def _check_magic(path: Path, what: str) -> None:
    magic = {".npz": b"PK", ".npy": b"\x93NUMPY"}[path.suffix]
    try:
        with open(path, "rb") as f:
            start = f.read(len(magic))
    except OSError as exc:
        raise CalibrationError(f"{what} file '{path}' cannot be read: {exc.strerror or exc}") from None
    if start != magic:
        kind = "a zip archive of .npy arrays" if path.suffix == ".npz" else "NumPy's array format"
        raise CalibrationError(f"{what} file '{path}' is not a {path.suffix} file ({kind}): it starts with {start!r}")


def _unreadable(path: Path, what: str, exc: BaseException) -> CalibrationError:
    reason = str(exc) or type(exc).__name__
    if any(text in reason for text in ("allow_pickle", "object arrays", "Python objects")):
        reason = "it holds object arrays, which would need unpickling (requant never unpickles data)"
    return CalibrationError(f"{what} file '{path}' cannot be read as {path.suffix}: {reason}")


_READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError, zlib.error)


def _load_whole(path: Path, what: str) -> dict[str, npt.NDArray[Any]] | npt.NDArray[Any]:
    """A ``.npz`` file's arrays or a ``.npy`` file's array, all read now (a folder's files: one sample each)."""
    _check_magic(path, what)
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
        return np.asarray(np.load(path, allow_pickle=False))
    except _READ_ERRORS as exc:
        raise _unreadable(path, what, exc) from None


def read_labels(path: Path) -> npt.NDArray[Any] | None:
    """The ``labels`` array of an evaluation ``.npz``, read alone (None when it has none)."""
    _check_magic(path, "evaluation")
    try:
        with np.load(path, allow_pickle=False) as data:
            return np.asarray(data["labels"]).reshape(-1) if "labels" in data.files else None
    except _READ_ERRORS as exc:
        raise _unreadable(path, "evaluation", exc) from None


def _npz_rows(path: Path, what: str, skip: tuple[str, ...] = ()) -> Iterator[Sample]:
    """A ``.npz`` file's samples, read one row of each array at a time from its stream in the zip:
    memory holds one sample, whatever the file's size (an array stored in Fortran order is read
    whole). Arrays named in ``skip`` are not read."""
    _check_magic(path, what)
    try:
        with zipfile.ZipFile(path) as archive:
            streams: dict[str, tuple[Any, tuple[int, ...], np.dtype[Any]]] = {}
            for member in archive.namelist():
                name = member.removesuffix(".npy")
                if name in skip:
                    continue
                stream = archive.open(member)
                version = np.lib.format.read_magic(stream)
                fmt = np.lib.format
                header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
                shape, fortran, dtype = header(stream)
                if dtype.hasobject:
                    raise ValueError("object arrays")
                if len(shape) == 0:
                    raise _scalar(what, name)
                if fortran and len(shape) > 1:  # rows are not contiguous: read it whole
                    data = np.frombuffer(stream.read(), dtype).reshape(shape, order="F")
                    stream = io.BytesIO(np.ascontiguousarray(data).tobytes())
                streams[name] = (stream, shape, dtype)
            counts = {name: shape[0] for name, (_, shape, _) in streams.items()}
            if len(set(counts.values())) > 1:
                raise CalibrationError(f"{what} arrays differ in their number of samples: {counts}")
            for _ in range(next(iter(counts.values()), 0)):
                sample = {}
                for name, (stream, shape, dtype) in streams.items():
                    size = dtype.itemsize * math.prod(shape[1:])
                    raw = stream.read(size)
                    if len(raw) != size:
                        raise EOFError(f"array '{name}' ends early")
                    sample[name] = np.frombuffer(raw, dtype).reshape(1, *shape[1:])
                yield sample
    except _READ_ERRORS as exc:
        raise _unreadable(path, what, exc) from None


def _from_file(path: Path, single_input: str | None, what: str) -> Iterator[Sample]:
    if path.suffix == ".npz":
        yield from _npz_rows(path, what, skip=("labels",) if what != "calibration" else ())  # labels: not an input
    elif path.suffix == ".npy":
        if single_input is None:
            raise CalibrationError(
                f"'{path}': a .npy file can only feed a single-input model; use .npz with input names"
            )
        _check_magic(path, what)
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)  # memory-mapped: rows read as used
        except _READ_ERRORS as exc:
            raise _unreadable(path, what, exc) from None
        yield from _rows({single_input: array}, what)
    else:
        raise CalibrationError(f"'{path}': {what} files are .npz or .npy")


def _raw(source: Any, single_input: str | None, what: str, fed: list[str]) -> Iterator[Any]:
    """The samples of ``source`` as it gives them; an iterable's matched to the ``fed`` inputs (:func:`matched`)."""
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
                    yield _load_whole(file, what)
                elif single_input is None:
                    raise CalibrationError(
                        f"'{file}': a .npy file can only feed a single-input model; use .npz with input names"
                    )
                else:
                    yield {single_input: _load_whole(file, what)}
            return
        check_exists(path, what)
        yield from _from_file(path, single_input, what)
    elif isinstance(source, np.ndarray):
        if single_input is None:
            raise CalibrationError("one array can only feed a single-input model; give a dict of input name -> array")
        yield from _rows({single_input: source}, what)
    elif isinstance(source, Mapping):
        yield from _rows(source, what)
    elif isinstance(source, Iterable) and not isinstance(source, (str, bytes)):
        for count, raw in enumerate(source, start=1):  # in the user's forms: matched to the inputs
            yield matched(raw, fed, f"{what} sample {count}")
    else:
        raise CalibrationError(
            f"cannot read {what} data from a {type(source).__name__}: give a .npz/.npy file or a folder of them, "
            "a dict of input name -> array, an iterable of such dicts, or an ImageFolder"
        )


def iterable(source: Any) -> bool:
    """Whether ``source`` is data given as an iterable of samples in the user's forms (not a path, an array,
    a dict of arrays or an image folder)."""
    plain = (str, bytes, os.PathLike, np.ndarray, Mapping, ImageFolder)
    return isinstance(source, Iterable) and not isinstance(source, plain)


class Transformed:
    """The items of an iterable ``source`` each passed through ``transform`` (NNCF's ``transform_fn``), read
    again as often as the source can be; an error the transform raises names the sample."""

    def __init__(self, source: Iterable[Any], transform: Callable[[Any], Any], what: str) -> None:
        self.source, self.transform, self.what = source, transform, what

    def __iter__(self) -> Iterator[Any]:
        for count, item in enumerate(self.source, start=1):
            try:
                yield self.transform(item)
            except Exception as exc:
                said = f"{type(exc).__name__}: {exc}"
                raise CalibrationError(f"{self.what} sample {count}: transform raised {said}") from exc


def transformed(source: Any, transform: Callable[[Any], Any] | None, what: str) -> Any:
    """``source`` with ``transform`` applied to its items, when it is an iterable (:func:`iterable`); a
    generator stays one (read once)."""
    if transform is None or not iterable(source):
        return source
    items = Transformed(source, transform, what)
    return iter(items) if isinstance(source, Iterator) else items


def _array(value: Any) -> Any:
    """A torch tensor as an array (detached, on the CPU); anything else as it is."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    return value


class Labelled(dict[str, Any]):
    """A sample a data loader gave with a target after its inputs (``(x, y)``): ``target``, not fed (the
    evaluation reads integer targets, one per sample row, as class labels: :func:`labels_of`)."""

    target: Any = None


def labels_of(targets: list[Any], rows: list[int]) -> npt.NDArray[Any] | None:
    """A data loader's ``targets`` (one per sample: :class:`Labelled`) as class labels, where each is integer
    with one value per prediction of its sample (``rows``); None otherwise (no targets, or ones that are not
    class indices: a segmentation mask, a regression value)."""
    given = [np.asarray(t) for t in targets if t is not None]
    if not given or len(given) != len(rows):
        return None
    if any(t.dtype.kind not in "iu" or t.size != n for t, n in zip(given, rows, strict=True)):
        return None
    return np.concatenate([t.reshape(-1) for t in given])


def matched(raw: Any, names: list[str], where: str) -> Any:
    """An iterable's sample as ``{input name: array}`` (see the module's docstring), or as it came when it
    has no form this knows (the check says what was expected)."""
    if isinstance(raw, Mapping):
        sample = {str(key): _array(value) for key, value in raw.items()}
        if len(sample) == len(names) and not set(sample) & set(names):  # other names, one per input: by position
            return dict(zip(names, sample.values(), strict=True))
        return sample
    if isinstance(raw, (tuple, list)):
        values = [_array(value) for value in raw]
        if len(values) == len(names) + 1:  # (inputs..., target), as a data loader yields them: the target not fed
            labelled = Labelled(zip(names, values[:-1], strict=True))
            labelled.target = values[-1]
            return labelled
        if len(values) != len(names):
            raise CalibrationError(
                f"{where}: a {type(raw).__name__} of {len(raw)} values for a model of {len(names)} input(s) "
                f"({', '.join(names)}): give one value per input, in their order (one more, a target, is not fed)"
            )
        return dict(zip(names, values, strict=True))
    value = _array(raw)
    if len(names) == 1 and hasattr(value, "__array__"):  # an array (a tensor, already read as one)
        return {names[0]: value}
    return raw


def first_sample(source: Any, names: list[str], what: str = "calibration") -> dict[str, Any]:
    """The first sample of ``source`` as ``{name: array}`` before there is a model to check it against (a
    PyTorch module's example inputs): an iterable's matched to ``names`` (:func:`matched`), the first row of
    arrays. A generator's is kept for the passes that follow (give a :class:`Samples`' source)."""
    if isinstance(source, ImageFolder):
        raise CalibrationError("an image folder does not say the size its images are resized to before there is "
                               "a model: give the PyTorch module's example_inputs=")  # fmt: skip
    single = names[0] if len(names) == 1 else None
    first = next(_raw(source, single, what, names), None)
    if first is None:
        raise CalibrationError(f"the {what} data set is empty")
    if not isinstance(first, Mapping):
        raise CalibrationError(f"{what} sample 1: expected a dict of input name -> array, got {type(first).__name__}")
    return {str(name): np.asarray(_array(value)) for name, value in first.items()}


def check_exists(source: Any, what: str) -> None:
    """A path given as data must be there (a file or a folder): checked before any work is done."""
    if isinstance(source, (str, os.PathLike)) and not (Path(source).is_file() or Path(source).is_dir()):
        raise CalibrationError(f"no {what} data at '{source}'")


def _sliced(source: Any) -> bool:
    """Samples cut from arrays along their first axis (where a rank mismatch may be a missing batch axis)."""
    if isinstance(source, (str, os.PathLike)):
        return Path(source).is_file()
    return isinstance(source, (np.ndarray, Mapping))


def _check_outliers(peaks: dict[str, pyarray.array[float]], what: str) -> None:
    """One sample whose peak is more than ``OUTLIER_RATIO`` times the median sample's: an error naming it."""
    for name, values in peaks.items():
        if len(values) < 3:
            continue
        median = float(np.median(values))
        worst = int(np.argmax(values))
        if median > 0 and values[worst] > OUTLIER_RATIO * median:
            raise CalibrationError(
                f"{what} sample {worst + 1}: input '{name}' reaches {values[worst]:.3g}, "
                f"{values[worst] / median:.2g} times the median sample's largest magnitude ({median:.3g}); "
                "alone it would set the input's whole range (every other value would round to the zero "
                "point): fix or drop the sample"
            )


def checked_samples(model: ir.Model, source: Any, what: str = "calibration") -> Iterator[Sample]:
    """The samples of ``source`` (any form the module's docstring lists), each checked for ``model``;
    an empty source is an error, and so is an outlier sample (see the module's docstring), after the
    last one. ``what`` names the data in messages ("calibration", "evaluation")."""
    inputs = model_inputs(model)
    specs = input_specs(model)
    single = str(inputs[0].name) if len(inputs) == 1 else None
    hint = _BATCH_HINT if _sliced(source) else ""
    count = 0
    peaks: dict[str, pyarray.array[float]] = {}  # 8 bytes a sample
    fixed = fixed_inputs(model)
    fed = [str(v.name) for v in inputs if str(v.name) not in fixed]
    raws = source.samples(model, inputs) if isinstance(source, ImageFolder) else _raw(source, single, what, fed)
    for count, raw in enumerate(raws, start=1):
        target = getattr(raw, "target", None)  # a data loader's (x, y): y, kept beside the checked sample
        if fixed and isinstance(raw, Mapping):  # given once for all: not fed
            raw = {name: array for name, array in raw.items() if name not in fixed}
        sample = _check(specs, raw, f"{what} sample {count}", hint)
        if target is not None:
            sample = Labelled(sample)
            sample.target = target
        for name, value in sample.items():
            if _floating(value.dtype) and value.size:
                peaks.setdefault(name, pyarray.array("d")).append(_peak(value))
        yield sample
    if count == 0:
        raise CalibrationError(f"the {what} data set is empty")
    _check_outliers(peaks, what)
