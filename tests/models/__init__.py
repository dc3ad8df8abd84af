"""Model classes for the tests (ImageNet classifiers, a sentence encoder, the digits CNN), and the
bench's photo crops as calibration and evaluation samples of an image classifier."""

from __future__ import annotations

from typing import Any


def on_crops(net: Any, calibration: int, evaluation: int, seed: int) -> tuple[Any, list[dict], list[dict]]:
    """``net`` loaded through requant with a dynamic batch, and ``calibration`` then ``evaluation``
    crops of the bench's photos (``bench.bench_quantize.crops``, this ``seed``), one sample each."""
    import torch
    from bench.bench_quantize import crops

    import requant

    images = crops(calibration + evaluation, seed=seed)
    dims = ({0: torch.export.Dim("batch")},)
    model = requant.load(net, example_inputs=(torch.from_numpy(images[:2]),), dynamic_shapes=dims)
    key = str(model.graph.inputs[0].name)
    samples = [{key: images[i : i + 1]} for i in range(len(images))]
    return model, samples[:calibration], samples[calibration:]
