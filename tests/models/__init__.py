"""Model classes for the tests (ImageNet classifiers, a sentence encoder, the digits CNN), their exports
through requant's PyTorch front door (once per test run: :func:`exported`), and the bench's photo
crops as calibration and evaluation samples of an image classifier."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

_EXPORTS: dict[str, Any] = {}
EXPORT_SENTENCE = "A sentence to export with."


def _classifier(name: str) -> Any:
    import torch
    from bench.bench_quantize import crops

    import requant
    from tests.models.efficientnet import make_efficientnet_lite0
    from tests.models.mobilenet import make_mobilenet_v2

    net = {"mobilenet_v2": make_mobilenet_v2, "efficientnet_lite0": make_efficientnet_lite0}[name]()
    # a sharp edge of torch 2.13's exporter: the graph depends on the example's values, not only its
    # shape (MobileNetV2: 601 nodes from ImageNet-normalized crops of any seed, 563 from zeros, ones
    # or uniform noise in [0, 1)); crops, as the bench's models and the tests' data are
    images = torch.from_numpy(crops(2, seed=0))
    return requant.load(net, example_inputs=(images,), dynamic_shapes=({0: torch.export.Dim("batch")},))


def _minilm(dynamic: bool) -> Any:
    import torch

    import requant
    from tests.models.minilm import make_minilm, tokenize

    if not dynamic:  # the sequence fixed to one sentence's length
        ids, mask = tokenize([EXPORT_SENTENCE])
        return requant.load(make_minilm(), example_inputs=(torch.from_numpy(ids), torch.from_numpy(mask)))
    ids, mask = tokenize([EXPORT_SENTENCE, "Another, longer sentence to export the encoder with."])
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence", max=512)
    return requant.load(make_minilm(), example_inputs=(torch.from_numpy(ids), torch.from_numpy(mask)),
                        dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))  # fmt: skip


EXPORTERS: dict[str, Callable[[], Any]] = {
    "mobilenet_v2": lambda: _classifier("mobilenet_v2"),
    "efficientnet_lite0": lambda: _classifier("efficientnet_lite0"),
    "minilm": lambda: _minilm(dynamic=True),  # batch and sequence dynamic
    "minilm_static": lambda: _minilm(dynamic=False),  # the length of EXPORT_SENTENCE's tokens
}


# the folder the test run's processes share what they build once (tests/conftest.py makes it for the run)
EXPORTS_FOLDER = "REQUANT_TEST_EXPORTS"


def once_per_run(name: str, build: Callable[[Path], object]) -> Path:
    """``$REQUANT_TEST_EXPORTS/name``, built by ``build(path)`` in the first process of the test run that asks
    (pytest-xdist's workers wait for it under a lock), then only read: a model export, a folder of files.
    Built beside it and renamed, so no process sees half of it. Without the folder (outside pytest), built
    in a temporary folder of this process, removed when it exits."""
    folder = os.environ.get(EXPORTS_FOLDER)
    if not folder:
        import atexit
        import shutil
        import tempfile

        folder = os.environ[EXPORTS_FOLDER] = tempfile.mkdtemp(prefix="requant-test-exports-")
        atexit.register(shutil.rmtree, folder, True)
    path = Path(folder) / name
    with open(Path(folder) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.exists():
            part = Path(folder) / f"{name}.part"
            build(part)
            part.rename(path)
    return path


def _export_once(name: str) -> Any:
    """The model ``name`` exported once per test run (:func:`once_per_run`) and loaded back by every process,
    the one that exported it included: each sees the same model whichever exported it."""
    import onnx_ir as ir

    return ir.load(once_per_run(f"{name}.onnx", lambda path: ir.save(EXPORTERS[name](), path)))


def exported(name: str) -> Any:
    """The model ``name`` (of :data:`EXPORTERS`) as requant loads it from PyTorch: exported once per test
    run (a few seconds each; :func:`_export_once`), a copy each call (tests change models in place)."""
    if name not in _EXPORTS:
        _EXPORTS[name] = _export_once(name)
    return _EXPORTS[name].clone()


def on_crops(name: str, calibration: int, evaluation: int, seed: int) -> tuple[Any, list[dict], list[dict]]:
    """The classifier ``name`` with a dynamic batch (:func:`exported`), and ``calibration`` then
    ``evaluation`` crops of the bench's photos (``bench.bench_quantize.crops``, this ``seed``), one
    sample each."""
    from bench.bench_quantize import crops

    images = crops(calibration + evaluation, seed=seed)
    model = exported(name)
    key = str(model.graph.inputs[0].name)
    samples = [{key: images[i : i + 1]} for i in range(len(images))]
    return model, samples[:calibration], samples[calibration:]


def default_report(name: str, calibration: int, evaluation: int, seed: int) -> dict[str, Any]:
    """The report of requant's defaults (``requant.quantize(model, calib, eval_data=evaluation, measure=False)``)
    on the classifier ``name`` and the crops of :func:`on_crops`: quantized once per test run
    (:func:`once_per_run`) and read back as JSON by every test that compares with it (the tests of EfficientNet-
    Lite0's weights, of MobileNetV2's equalization and of both as integer TOSA ask for the same run)."""
    import json

    def build(path: Path) -> None:
        import requant

        model, calib, held_out = on_crops(name, calibration, evaluation, seed)
        path.write_text(json.dumps(requant.quantize(model, calib, eval_data=held_out, measure=False).report))

    made = once_per_run(f"{name}-default-{calibration}-{evaluation}-{seed}.json", build)
    return json.loads(made.read_text())  # type: ignore[no-any-return]
