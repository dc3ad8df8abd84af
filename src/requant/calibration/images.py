"""Calibration data from a folder of images, with the preprocessing stated, never guessed.

``ImageFolder("photos/", IMAGENET)`` yields one sample per image, in file-name order: the image
is decoded (Pillow), converted to RGB (or grey, for a one-channel input), its shorter side resized
to ``resize`` (bilinear, antialiased), centre-cropped to ``crop``, scaled by ``scale``, normalized
with ``mean``/``std`` per channel, laid out as ``NCHW`` or ``NHWC`` with a batch dimension of 1,
and cast to the model input's float type.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx_ir as ir

from requant.calibration.observers import CalibrationError

__all__ = ["IMAGENET", "IMAGE_PRESETS", "IMAGE_SUFFIXES", "UNIT", "ImageFolder", "ImagePreprocessing"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
LAYOUTS = ("NCHW", "NHWC")


class FieldError(CalibrationError):
    """A preprocessing field with a value it cannot take; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ImagePreprocessing:
    """How an image becomes an input tensor.

    ``resize``: the shorter side's length after resizing (``None``: the crop's longer side, so the
    crop covers as much of the image as it can). ``crop``: the centre crop, one size or
    ``(height, width)`` (``None``: the model input's static height and width). Values are
    ``pixel * scale``, then ``(value - mean) / std`` per channel.
    """

    resize: int | None = None
    crop: int | tuple[int, int] | None = None
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    scale: float = 1 / 255
    layout: str = "NCHW"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise FieldError("layout", f"image layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        crop = self.crop
        if isinstance(crop, Sequence) and len(crop) != 2:
            raise FieldError("crop", f"image crop must be one size or (height, width), got {crop!r}")
        crops = [] if crop is None else list(crop) if isinstance(crop, Sequence) else [crop]
        for name, size in (("resize", self.resize), *(("crop", c) for c in crops)):
            if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
                raise FieldError(name, f"image {name} must be a positive integer (pixels), got {size!r}")
        object.__setattr__(self, "crop", tuple(crop) if isinstance(crop, Sequence) else crop)
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        if len(self.mean) != len(self.std) or len(self.mean) not in (1, 3):
            raise FieldError("mean", f"image mean and std need 1 or 3 values each, got {self.mean} and {self.std}")
        if any(s <= 0 for s in self.std):
            raise FieldError("std", f"image std values must be positive, got {self.std}")

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], where: str = "images") -> ImagePreprocessing:
        """From a dict (a config file's ``[images]`` table): ``preset = "imagenet"`` plus any field to override."""
        settings = dict(settings)
        preset = settings.pop("preset", None)
        if preset is not None and preset not in IMAGE_PRESETS:
            raise CalibrationError(f"{where}: unknown preset {preset!r}; known: {', '.join(IMAGE_PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - fields)
        if unknown:
            raise CalibrationError(
                f"{where}: unknown key {', '.join(map(repr, unknown))}; known: preset, {', '.join(sorted(fields))}"
            )
        for key in ("mean", "std", "crop"):
            if isinstance(settings.get(key), list):
                settings[key] = tuple(settings[key])
        base = IMAGE_PRESETS[preset] if preset else cls()
        try:
            return dataclasses.replace(base, **settings)
        except FieldError as exc:  # the table's key named: "run.toml: images.crop: ..."
            raise CalibrationError(f"{where}.{exc.field}: {exc}") from None
        except CalibrationError as exc:
            raise CalibrationError(f"{where}: {exc}") from None
        except (TypeError, ValueError) as exc:  # mean = "abc", std = [true]...
            raise CalibrationError(f"{where}: {exc}; mean and std take numbers, crop and resize integers") from None


IMAGENET = ImagePreprocessing(resize=256, crop=224, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
UNIT = ImagePreprocessing()  # the model input's size, values in [0, 1]
IMAGE_PRESETS: dict[str, ImagePreprocessing] = {"imagenet": IMAGENET, "unit": UNIT}


def image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)


@dataclass(frozen=True)
class ImageFolder:
    """A folder of images as calibration (or evaluation) samples for a single-image-input model."""

    path: str | os.PathLike[str]
    preprocessing: ImagePreprocessing

    def samples(self, model: ir.Model, inputs: Sequence[ir.Value]) -> Iterator[dict[str, npt.NDArray[Any]]]:
        folder = Path(self.path)
        if not folder.is_dir():
            raise CalibrationError(f"no image folder at '{folder}'")
        files = image_files(folder)
        if not files:
            raise CalibrationError(f"'{folder}' holds no images ({', '.join(IMAGE_SUFFIXES)})")
        if len(inputs) != 1:
            names = ", ".join(str(v.name) for v in inputs)
            raise CalibrationError(f"an image folder can only feed a single-input model; this one has {names}")
        value = inputs[0]
        height, width, channels = self._geometry(value)
        dtype = np.dtype(value.dtype.numpy()) if value.dtype is not None else np.dtype(np.float32)
        for file in files:
            yield {str(value.name): self.load(file, height, width, channels).astype(dtype)}

    def _geometry(self, value: ir.Value) -> tuple[int, int, int]:
        shape = list(value.shape) if value.shape is not None else []
        if len(shape) != 4:
            raise CalibrationError(
                f"input '{value.name}' has shape {value.shape}; an image folder feeds rank-4 inputs "
                f"({self.preprocessing.layout})"
            )
        h, w, c = (shape[2], shape[3], shape[1]) if self.preprocessing.layout == "NCHW" else shape[1:4]
        channels = c if isinstance(c, int) else 3
        if channels not in (1, 3):
            raise CalibrationError(
                f"input '{value.name}' has {channels} channels in layout {self.preprocessing.layout} "
                f"(shape {value.shape}); images give 1 or 3: check the layout"
            )
        crop = self.preprocessing.crop
        if crop is None:
            if not (isinstance(h, int) and isinstance(w, int)):
                raise CalibrationError(
                    f"input '{value.name}' has symbolic height/width (shape {value.shape}): state the image crop size"
                )
            return h, w, channels
        ch, cw = crop if isinstance(crop, tuple) else (crop, crop)
        for want, got, axis in ((h, ch, "height"), (w, cw, "width")):
            if isinstance(want, int) and want != got:
                raise CalibrationError(
                    f"input '{value.name}' expects {axis} {want} (shape {value.shape}); the image crop gives {got}"
                )
        return ch, cw, channels

    def load(self, file: Path, height: int, width: int, channels: int) -> npt.NDArray[np.float32]:
        """One image as a ``[1, C, H, W]`` (or ``[1, H, W, C]``) float32 array."""
        try:
            from PIL import Image
        except ImportError as exc:  # pragma: no cover - Pillow is a dependency
            raise CalibrationError("reading images needs Pillow (pip install pillow)") from exc
        p = self.preprocessing
        try:
            with Image.open(file) as opened:
                image = opened.convert("L" if channels == 1 else "RGB")
        except OSError as exc:
            raise CalibrationError(f"cannot read image '{file}': {exc}") from None
        resize = p.resize if p.resize is not None else max(height, width)
        short = min(image.size)
        size = (max(round(image.width * resize / short), width), max(round(image.height * resize / short), height))
        image = image.resize(size, Image.Resampling.BILINEAR)
        left, top = (image.width - width) // 2, (image.height - height) // 2
        image = image.crop((left, top, left + width, top + height))
        array = np.asarray(image, dtype=np.float32).reshape(height, width, channels) * np.float32(p.scale)
        mean = np.asarray(p.mean[:channels], np.float32)
        std = np.asarray(p.std[:channels], np.float32)
        array = (array - mean) / std
        if p.layout == "NCHW":
            array = array.transpose(2, 0, 1)
        return np.ascontiguousarray(array[None])
