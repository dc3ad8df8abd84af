"""Calibration: observers (pure statistics) and the streaming runner that feeds them."""

from requant.calibration.images import IMAGE_PRESETS, IMAGENET, UNIT, ImageFolder, ImagePreprocessing
from requant.calibration.observers import (
    CalibrationError,
    Histogram,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    Observer,
    make_observer,
    register_method,
)

__all__ = [
    "IMAGENET",
    "IMAGE_PRESETS",
    "UNIT",
    "CalibrationError",
    "Histogram",
    "HistogramObserver",
    "ImageFolder",
    "ImagePreprocessing",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "Observer",
    "make_observer",
    "register_method",
]
