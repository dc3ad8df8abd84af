"""Calibration from a folder of images, with the preprocessing stated."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image

import requant.api
from requant.calibration import IMAGENET, CalibrationError, ImageFolder, ImagePreprocessing
from requant.calibration.samples import iter_samples
from requant.frontends import load_onnx

DIGITS = Path(__file__).parent.parent / "examples" / "digits"
# The digits are k/16 for k in 0..16: as pixels k*8 (0..128) and scale 1/128 they come back exact.
DIGITS_PIXELS = ImagePreprocessing(scale=1 / 128, mean=(0.0,), std=(1.0,))


def write_digits(folder: Path, count: int) -> np.ndarray:
    """The first ``count`` calibration digits as grey PNG files; returns the arrays."""
    folder.mkdir(exist_ok=True)
    with np.load(DIGITS / "calib.npz") as data:
        x = data["x"][:count]
    for i, image in enumerate(x):
        Image.fromarray(np.round(image[0] * 128).astype(np.uint8), "L").save(folder / f"{i:03d}.png")
    return x


def test_image_folder_gives_the_arrays_the_images_hold(tmp_path: Path) -> None:
    x = write_digits(tmp_path / "digits", 12)
    model = load_onnx(DIGITS / "digits_cnn.onnx")
    samples = list(iter_samples(model, ImageFolder(tmp_path / "digits", DIGITS_PIXELS)))
    assert len(samples) == 12
    np.testing.assert_array_equal(np.concatenate([s["x"] for s in samples]), x)
    assert samples[0]["x"].dtype == np.float32


def test_quantizing_from_images_equals_quantizing_from_the_same_arrays(tmp_path: Path) -> None:
    x = write_digits(tmp_path / "digits", 40)
    from_images = requant.api.quantize(
        DIGITS / "digits_cnn.onnx", ImageFolder(tmp_path / "digits", DIGITS_PIXELS), measure=False
    )
    from_arrays = requant.api.quantize(DIGITS / "digits_cnn.onnx", {"x": x}, measure=False)
    assert from_images.report["calibrated"] == from_arrays.report["calibrated"]
    assert from_images.report["lint"]["int8_kernels"] == {"QLinearConv": 2, "QGemm": 1}


MODEL_224 = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[N, 3, 224, 224] image) => (float[N, 3, 1, 1] y) {
  y = GlobalAveragePool(image)
}
"""


def test_imagenet_preprocessing_of_a_real_photo(tmp_path: Path) -> None:
    from sklearn.datasets import load_sample_image

    photo = load_sample_image("flower.jpg")  # 427 x 640 RGB
    Image.fromarray(photo).save(tmp_path / "flower.png")
    model = load_onnx(onnx.parser.parse_model(MODEL_224))
    (sample,) = iter_samples(model, ImageFolder(tmp_path, IMAGENET))
    image = sample["image"]
    assert image.shape == (1, 3, 224, 224) and image.dtype == np.float32
    # undo the normalization: pixels in [0, 1], and the channel means of the photo's centre
    std = np.array(IMAGENET.std, np.float32)[:, None, None]
    mean = np.array(IMAGENET.mean, np.float32)[:, None, None]
    pixels = image[0] * std + mean
    assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5
    # resize 427 -> 256 on the short side (x 0.5995), centre 224 x 224 = centre 374 x 374 of the photo
    centre = photo[427 // 2 - 187 : 427 // 2 + 187, 320 - 187 : 320 + 187] / 255.0
    np.testing.assert_allclose(pixels.mean(axis=(1, 2)), centre.mean(axis=(0, 1)), atol=0.01)


@pytest.mark.parametrize(
    ("preprocessing", "message"),
    [
        (ImagePreprocessing(crop=10), "input 'x' expects height 8 (shape [batch,1,8,8]); the image crop gives 10"),
        (ImagePreprocessing(layout="NHWC"), "input 'x' has 8 channels in layout NHWC"),
    ],
)
def test_preprocessing_that_does_not_fit_the_input(
    tmp_path: Path, preprocessing: ImagePreprocessing, message: str
) -> None:
    write_digits(tmp_path / "digits", 2)
    model = load_onnx(DIGITS / "digits_cnn.onnx")
    with pytest.raises(CalibrationError, match=re.escape(message)):
        list(iter_samples(model, ImageFolder(tmp_path / "digits", preprocessing)))


def test_an_unreadable_image_is_named(tmp_path: Path) -> None:
    write_digits(tmp_path / "digits", 2)
    (tmp_path / "digits" / "001.png").write_bytes(b"not a png")
    model = load_onnx(DIGITS / "digits_cnn.onnx")
    with pytest.raises(CalibrationError, match="cannot read image '.*001.png'"):
        list(iter_samples(model, ImageFolder(tmp_path / "digits", DIGITS_PIXELS)))


def test_a_plain_folder_of_images_asks_for_the_preprocessing(tmp_path: Path) -> None:
    write_digits(tmp_path / "digits", 2)
    model = load_onnx(DIGITS / "digits_cnn.onnx")
    with pytest.raises(CalibrationError, match="holds images: state how to preprocess them"):
        list(iter_samples(model, tmp_path / "digits"))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"preset": "imagenet", "crop": [200, 180]}, None),
        ({"preset": "vgg"}, "unknown preset 'vgg'; known: imagenet, unit"),
        ({"size": 3}, "unknown key 'size'"),
        ({"layout": "CHW"}, "images.layout: image layout must be one of NCHW, NHWC"),
        ({"std": [0.5, 0.0, 1.0]}, "images.std: image std values must be positive"),
        ({"crop": 0}, "images.crop: image crop must be a positive integer \\(pixels\\), got 0"),
        ({"resize": -8}, "images.resize: image resize must be a positive integer \\(pixels\\), got -8"),
    ],
)
def test_preprocessing_from_settings(settings: dict[str, object], message: str | None) -> None:
    if message is None:
        p = ImagePreprocessing.from_settings(settings)
        assert p.crop == (200, 180) and p.resize == 256 and p.mean == IMAGENET.mean
        return
    with pytest.raises(CalibrationError, match=message):
        ImagePreprocessing.from_settings(settings)
