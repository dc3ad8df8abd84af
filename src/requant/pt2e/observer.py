"""requant's calibration methods as PT2E observers: ``prepare_pt2e`` inserts them, ``convert_pt2e`` reads them.

An observer holds one of requant's statistics (:mod:`requant.calibration.observers`) per method it was
asked to keep: calibrated once, a model can then be converted with each method in turn (the choice of
:mod:`requant.stages.pt2e`). ``calculate_qparams`` gives the scale and zero point requant's types give
(:func:`requant.types.from_range`), so a PT2E model and a QDQ model calibrated on the same samples by
the same method read the same parameters.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import torch
from torchao.quantization.pt2e import ObserverBase

from requant.calibration.observers import CalibrationError, HistogramObserver, Observer, make_observer, observe
from requant.ir.requests import FixedSpec, QuantizationSpec

__all__ = ["RequantObserver", "RequantPerChannelObserver", "torch_dtype"]

_TORCH_DTYPES = {"int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "uint16": torch.uint16}


def torch_dtype(spec: QuantizationSpec | FixedSpec) -> torch.dtype:
    """The torch dtype of a spec's storage; an error for one PT2E has no quantize op for."""
    found = _TORCH_DTYPES.get(spec.dtype)
    if found is None:
        raise CalibrationError(f"PT2E quantizes to {', '.join(_TORCH_DTYPES)}, not {spec.dtype}")
    return found


def _key(observer: Observer) -> int:
    return id(observer.histogram) if isinstance(observer, HistogramObserver) else id(observer)


def _same_histogram(a: Observer, b: Observer) -> bool:
    both = isinstance(a, HistogramObserver) and isinstance(b, HistogramObserver)
    return both and a.histogram.bins == b.histogram.bins  # type: ignore[attr-defined]


class RequantObserver(ObserverBase):  # type: ignore[misc]
    """One tensor's statistics for each method in ``methods`` (the spec's own first); ``method`` is the
    one ``calculate_qparams`` uses (set it to convert with another)."""

    def __init__(self, dtype: torch.dtype, spec: QuantizationSpec, methods: tuple[str, ...] = (), **kwargs: Any):
        super().__init__(dtype=dtype)
        self.qscheme, self.quant_min, self.quant_max = kwargs["qscheme"], kwargs["quant_min"], kwargs["quant_max"]
        self.ch_axis = kwargs.get("ch_axis")
        self.spec, self.method = spec, spec.observer
        axis = spec.axis if spec.granularity == "per_axis" else None
        self.statistics: dict[str, Observer] = {}
        for method in dict.fromkeys((spec.observer, *methods)):
            made = make_observer(dataclasses.replace(spec, observer=method), axis)
            # the histogram rules (percentile, mse, entropy) read one histogram: it is kept once
            shared = next((o for o in self.statistics.values() if _same_histogram(o, made)), None)
            if shared is not None:
                made.histogram = shared.histogram  # type: ignore[attr-defined]
            self.statistics[method] = made
        # what forward updates: each histogram once, through the first observer reading it
        self._updated = {_key(o): o for o in reversed(self.statistics.values())}
        self.paused = False  # passes values through without counting them (a run that only looks at values)
        self._types: dict[str, Any] = {}  # each method's type, until the statistics change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.paused:
            observe(list(self._updated.values()), x.detach().float().cpu().numpy())
            self._types.clear()
        return x

    def __deepcopy__(self, memo: dict[int, Any]) -> RequantObserver:
        """A copy that shares the statistics (they are read, not changed, once calibrated): method
        ``auto`` converts a copy of the prepared program per candidate."""
        other = copy.copy(self)
        other._modules, other._parameters, other._buffers = {}, {}, {}
        memo[id(self)] = other
        return other

    def quantized_type(self) -> Any:
        """The requant type the current method gives (scale, zero point), computed once per method (the method
        choice reads each candidate's, then converts with the chosen one's)."""
        if self.method not in self._types:
            spec = dataclasses.replace(self.spec, observer=self.method)
            self._types[self.method] = self.statistics[self.method].compute(spec)
        return self._types[self.method]

    def calculate_qparams(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        qtype = self.quantized_type()
        scales = getattr(qtype, "scales", None)
        if scales is not None:
            return (torch.tensor(np.asarray(scales), dtype=torch.float32),
                    torch.tensor(np.asarray(qtype.zero_points), dtype=torch.int64))  # fmt: skip
        return torch.tensor([qtype.scale], dtype=torch.float32), torch.tensor([qtype.zero_point], dtype=torch.int64)

    def extra_repr(self) -> str:
        return f"{self.spec}, method={self.method}"


class RequantPerChannelObserver(RequantObserver):
    """The same, per channel (``prepare_pt2e`` passes ``ch_axis`` only to a class named per channel). It
    observes weights: a forward given the tensor it saw last (a module's constant, each calibration
    sample) does nothing again; a replaced one (equalized, rounded) is observed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.paused and x is not self.__dict__.get("_last"):
            super().forward(x)
            object.__setattr__(self, "_last", x)  # not registered: a parameter of the model, not the observer's
        return x
