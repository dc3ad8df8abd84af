"""Calibration: observers (pure statistics) and the streaming runner that feeds them."""

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
    "CalibrationError",
    "Histogram",
    "HistogramObserver",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "Observer",
    "make_observer",
    "register_method",
]
