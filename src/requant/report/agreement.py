"""How close a quantized model's first output is to the float model's, sample by sample: top-1
agreement (and accuracy, with labels), cosine similarity and SQNR. ``method="auto"`` compares its
candidates with it, the accuracy budget each try, and the report the final model (and a TOSA program).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnx_ir as ir

from requant.calibration.data import labels_of
from requant.calibration.observers import CalibrationError
from requant.calibration.samples import iter_samples, split_labels
from requant.report.latency import session

__all__ = ["Reference", "agreement", "overlap", "predictions"]


@dataclass
class Reference:
    """The float model and, once computed (or known from a probe), its first output on each evaluation
    sample: the accuracy budget evaluates every try, and the report the final model, against the same
    outputs. Its session is made when an output is not known yet."""

    proto: onnx.ModelProto | None
    outputs: list[npt.NDArray[Any]] | None = None
    session: Any = None

    def float_session(self) -> Any:
        if self.session is None:
            self.session = session(self.proto)
        return self.session

    def run(self, sample: Mapping[str, Any]) -> npt.NDArray[Any]:
        return np.asarray(self.float_session().run(None, sample)[0])

    def outputs_of(self, samples: list[Mapping[str, Any]]) -> list[npt.NDArray[Any]]:
        """Its outputs on ``samples``, the first ones of its data set: those known, the others run and kept."""
        known = list(self.outputs or [])
        known += [self.run(sample) for sample in samples[len(known) :]]
        self.outputs = known
        return known[: len(samples)]

    def release(self) -> None:
        """Drop the float model and its session (the outputs stay)."""
        self.proto = self.session = None


def predictions(output: npt.NDArray[Any]) -> npt.NDArray[np.intp]:
    """The top-1 classes of a first output: one per sample, or, for a ``[N, T, classes]`` output (a
    sequence: a CTC text recognizer's, a token classifier's), one per position (the argmax of a
    whole ``[T, classes]`` sample says nothing: PP-OCRv4's recognizer's is one of 40 x 6,625)."""
    array = np.asarray(output)
    return (array.reshape(-1, array.shape[-1]) if array.ndim == 3 else per_sample(array)).argmax(1)  # type: ignore[no-any-return]


def per_sample(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``array`` as rows, one per sample along its first axis; a scalar output (PLCMOS's score: a
    0-d tensor) is one row of one value."""
    return array.reshape(len(array), -1) if array.ndim else array.reshape(1, 1)


def overlap(f: npt.NDArray[Any], q: npt.NDArray[Any]) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """``f`` and ``q`` cut to the extent they share along each axis. A model whose output's size depends
    on what it computes (a text-to-speech model's waveform, as long as its predicted durations) can give
    int8 a shape other than float's; their figures then compare what both computed."""
    f, q = np.asarray(f), np.asarray(q)
    if f.shape == q.shape or f.ndim != q.ndim:
        return f, q
    common = tuple(slice(0, min(a, b)) for a, b in zip(f.shape, q.shape, strict=True))
    return f[common], q[common]


@dataclass
class _Sums:
    """What :func:`agreement` adds up over the samples."""

    cosines: list[npt.NDArray[Any]]
    tops_f: list[npt.NDArray[Any]]
    tops_q: list[npt.NDArray[Any]]
    energy: float = 0.0
    noise: float = 0.0
    reshaped: int = 0  # samples whose int8 output's shape is not float's

    def add(self, f: npt.NDArray[Any], q: npt.NDArray[Any]) -> None:
        if np.shape(f) != np.shape(q):
            self.reshaped += 1
            f, q = overlap(f, q)
            if f.shape != q.shape:
                raise CalibrationError(f"the quantized model's first output has rank {q.ndim}, float's {f.ndim}")
        f2 = per_sample(f).astype(np.float64)
        q2 = per_sample(q).astype(np.float64)
        norms = np.linalg.norm(f2, axis=1) * np.linalg.norm(q2, axis=1) + 1e-12
        self.cosines.append(np.einsum("ij,ij->i", f2, q2) / norms)
        self.tops_f.append(predictions(f))
        self.tops_q.append(predictions(q))
        self.energy += float(np.einsum("ij,ij->", f2, f2))
        self.noise += float(np.einsum("ij,ij->", f2 - q2, f2 - q2))


def agreement(model: ir.Model, reference: Reference, q_session: Any, data: Any) -> dict[str, float]:
    """Top-1 agreement (and accuracy, with labels), cosine similarity and SQNR of the first output,
    a sample at a time (a 736x992 probability map's worth of float64 copies is not kept)."""
    data, labels = split_labels(data, {str(v.name) for v in model.graph.inputs})
    known = reference.outputs or []
    outs_f: list[npt.NDArray[Any]] = []
    sums = _Sums([], [], [])
    targets: list[Any] = []  # a data loader's (x, y): its y
    for i, sample in enumerate(iter_samples(model, data, "evaluation"), start=1):
        targets.append(getattr(sample, "target", None))
        outs_f.append(reference.run(sample) if i > len(known) else known[i - 1])
        q = np.asarray(q_session.run(None, sample)[0])
        for what, output in (("float", outs_f[-1]), ("quantized", q)):
            if not np.isfinite(output).all():  # agreement figures would be NaN: say where instead
                raise CalibrationError(f"evaluation sample {i}: the {what} model's first output is not finite")
        sums.add(outs_f[-1], q)
    reference.outputs = outs_f + known[len(outs_f) :]  # a shorter run keeps what a longer one computed
    top_f, top_q = np.concatenate(sums.tops_f), np.concatenate(sums.tops_q)
    samples = sum(len(per_sample(o)) for o in outs_f)
    if labels is None:  # class indices a data loader gave beside its inputs, one per prediction
        labels = labels_of(targets, [len(t) for t in sums.tops_f])
    if labels is not None:
        labels = _checked_labels(labels, len(top_f), samples)
    first = np.asarray(outs_f[0]) if outs_f else np.zeros((0, 0))
    metrics = {
        "samples": float(samples),
        # class scores ([N, classes], or [N, T, classes] per position) have a top-1; a map or a value does not
        "class_scores": float(first.ndim in (2, 3) and first.shape[-1] > 1),
        "top1_agreement": float(np.mean(top_f == top_q)),
        "cosine_similarity": float(np.mean(np.concatenate(sums.cosines))),
        "sqnr_db": float(10 * np.log10(sums.energy / sums.noise)) if sums.noise > 0 else float("inf"),
    }
    if sums.reshaped:  # compared on the extent both computed (overlap)
        metrics["shapes_differ"] = float(sums.reshaped)
    if labels is not None:
        metrics["float_accuracy"] = float(np.mean(top_f == labels))
        metrics["int8_accuracy"] = float(np.mean(top_q == labels))
    return metrics


def _checked_labels(labels: npt.NDArray[Any], predicted: int, samples: int) -> npt.NDArray[Any]:
    """The labels, one per prediction, or an error saying how many there should be."""
    labels = np.asarray(labels).reshape(-1)
    if len(labels) != predicted and predicted == samples:
        raise CalibrationError(
            f"the evaluation data has {predicted} samples (first output rows) but {len(labels)} labels: "
            "'labels' needs one class index per sample"
        )
    if len(labels) != predicted:
        raise CalibrationError(
            f"the evaluation data has {predicted} predictions ({samples} samples of a [N, T, classes] first "
            f"output, one at each of its T positions) but {len(labels)} labels: 'labels' needs one class index "
            "per position"
        )
    return labels
