"""Quantization requests: what a quantizer asks for a value, before calibration answers with a type.

These are the *model constraints* of the MLIR quantization RFC, put on kernel ports:

- :class:`QuantizationSpec`: quantize with this storage type, symmetric or affine, this
  granularity, calibrated by this observer;
- :class:`SharedSpec`: use exactly the parameters of another value (Concat, MaxPool...);
- :class:`DerivedSpec`: parameters computed from other values (a bias's scale is the input's
  scale times the weight's, in int32);
- :class:`FixedSpec`: these parameters, whatever calibration sees (a sigmoid's output);
- :class:`NoQuant`: keep this value in float.

They are frozen and validated on construction (errors list the allowed values), and have a
text form (``#requant.spec<...>``) that the printer shows and ``parse_request`` reads back, so a
saved model keeps them. The calibration and propagation stages turn them into ``!quant`` types.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypedDict

from requant.errors import RequantError
from requant.types import UniformQuantizedType

__all__ = [
    "DTYPES",
    "GRANULARITIES",
    "KNOWN_OBSERVERS",
    "DerivedSpec",
    "FixedSpec",
    "NoQuant",
    "QuantizationSpec",
    "Request",
    "RequestError",
    "SharedSpec",
    "parse_request",
    "register_observer",
]

DTYPES: dict[str, str] = {
    "int8": "i8",
    "uint8": "u8",
    "int16": "i16",
    "uint16": "u16",
    "int4": "i4",
    "uint4": "u4",
    "int32": "i32",
}
GRANULARITIES = ("per_tensor", "per_axis", "blockwise")
# Calibration methods by name; requant.calibration adds the ones users register.
KNOWN_OBSERVERS: set[str] = {
    *("minmax", "mean_minmax", "moving_average_minmax", "percentile", "stem_percentile", "entropy", "mse")
}
DERIVATION_RULES = ("product_of_scales",)
_NAME = re.compile(r"[A-Za-z0-9_.:/\-]+")


class RequestError(RequantError, ValueError):
    """An invalid quantization request; the message lists the allowed values."""


def register_observer(name: str) -> None:
    """Make ``name`` a valid observer for :class:`QuantizationSpec` (calibration registers its methods)."""
    if not name or not _NAME.fullmatch(name):
        raise RequestError(f"observer name {name!r} must be letters, digits, '_', '.', ':', '/' or '-'")
    KNOWN_OBSERVERS.add(name)


def _one_of(what: str, value: object, allowed: object) -> None:
    values = list(allowed)  # type: ignore[call-overload]
    if value not in values:
        raise RequestError(f"{what} {value!r} is not one of {', '.join(map(str, sorted(values, key=str)))}")


OptionValue: TypeAlias = bool | int | float | str


class RangeFlags(TypedDict):
    """How a spec shapes the storage range (``requant.types.from_range``'s keyword arguments)."""

    symmetric: bool
    narrow_range: bool
    reduce_range: bool


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# The built-in observers' options: which observers take each, and what it accepts. (Observers
# registered by users take whatever options they like.)
_OPTIONS: dict[str, tuple[tuple[str, ...], Callable[[Any], bool], str]] = {
    "bins": (("percentile", "entropy", "mse"), lambda v: _number(v) and v == int(v) and v >= 2, "an integer >= 2"),
    "percentile": (("percentile",), lambda v: _number(v) and 50 < v <= 100, "a number in (50, 100]"),
    "averaging_constant": (("moving_average_minmax",), lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
}
_BUILT_IN = {"minmax", "moving_average_minmax", "percentile", "entropy", "mse"}


def _check_observer_options(observer: str, options: Mapping[str, Any]) -> None:
    if observer not in _BUILT_IN:
        return
    takes = sorted(k for k, (observers, _, _) in _OPTIONS.items() if observer in observers)
    for key, value in options.items():
        if key not in takes:
            accepted = ", ".join(takes) if takes else "no options"
            raise RequestError(f"observer '{observer}' takes {accepted}; got option {key!r}")
        _, ok, what = _OPTIONS[key]
        if not ok(value):
            raise RequestError(f"observer '{observer}': option {key!r} must be {what}, got {value!r}")


@dataclass(frozen=True)
class QuantizationSpec:
    """How to quantize one value.

    ``granularity``: ``"per_tensor"``; ``"per_axis"`` with ``axis``; ``"blockwise"`` with
    ``axis`` (the blocked axis) and ``block_size``. ``observer`` names a calibration method,
    ``observer_options`` its options (e.g. ``{"percentile": 99.99}``). ``dynamic``: the parameters are
    computed at run time from each input, not calibrated (an activation of a kernel, on targets that
    have such kernels: ``executorch-xnnpack``'s linear layers).
    """

    dtype: str = "int8"
    symmetric: bool = False
    narrow_range: bool = False
    reduce_range: bool = False
    granularity: str = "per_tensor"
    axis: int | None = None
    block_size: int | None = None
    observer: str = "minmax"
    observer_options: Mapping[str, OptionValue] = field(default_factory=dict)
    dynamic: bool = False

    def __post_init__(self) -> None:
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("granularity", self.granularity, GRANULARITIES)
        _one_of("observer", self.observer, KNOWN_OBSERVERS)
        for flag in ("symmetric", "narrow_range", "reduce_range", "dynamic"):
            if not isinstance(getattr(self, flag), bool):
                raise RequestError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        needs_axis = self.granularity != "per_tensor"
        if needs_axis and (not isinstance(self.axis, int) or isinstance(self.axis, bool)):
            raise RequestError(f"granularity {self.granularity!r} needs an integer axis, got {self.axis!r}")
        if not needs_axis and self.axis is not None:
            raise RequestError(f"granularity 'per_tensor' takes no axis (got axis={self.axis})")
        if self.granularity == "blockwise":
            if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
                raise RequestError(f"granularity 'blockwise' needs a block_size of at least 1, got {self.block_size!r}")
        elif self.block_size is not None:
            raise RequestError(f"block_size is only for granularity 'blockwise' (got {self.granularity!r})")
        options = dict(self.observer_options)
        for key, value in options.items():
            if not isinstance(key, str) or not _NAME.fullmatch(key):
                raise RequestError(f"observer option names must be identifiers, got {key!r}")
            if not isinstance(value, (bool, int, float, str)):
                raise RequestError(f"observer option {key!r} must be a number, a string or a bool, got {value!r}")
        _check_observer_options(self.observer, options)
        object.__setattr__(self, "observer_options", _FrozenOptions(sorted(options.items())))

    @property
    def range_flags(self) -> RangeFlags:
        """The keyword arguments of ``requant.types.from_range`` that shape the storage range."""
        return RangeFlags(symmetric=self.symmetric, narrow_range=self.narrow_range, reduce_range=self.reduce_range)

    @property
    def storage(self) -> str:
        """The storage type in MLIR's spelling (``"i8"``)."""
        return DTYPES[self.dtype]

    def __str__(self) -> str:
        parts = [self.dtype, "symmetric" if self.symmetric else "affine"]
        if self.narrow_range:
            parts.append("narrow")
        if self.reduce_range:
            parts.append("reduced")
        if self.dynamic:
            parts.append("dynamic")
        if self.granularity == "per_axis":
            parts.append(f"per_axis = {self.axis}")
        elif self.granularity == "blockwise":
            parts.append(f"blockwise = {self.axis}:{self.block_size}")
        observer = self.observer
        if self.observer_options:
            observer += "{" + ", ".join(f"{k} = {_option_text(v)}" for k, v in self.observer_options.items()) + "}"
        parts.append(f"observer = {observer}")
        return "#requant.spec<" + ", ".join(parts) + ">"


class _FrozenOptions(dict[str, OptionValue]):
    """A read-only, hashable options mapping (so specs stay frozen and hashable)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("observer options are frozen")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]


def _option_text(value: OptionValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _value_name(what: str, name: object) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RequestError(f"{what} must name a value (letters, digits, '_', '.', ':', '/', '-'), got {name!r}")
    return name


@dataclass(frozen=True)
class SharedSpec:
    """The same quantization parameters as the value named ``other``."""

    other: str

    def __post_init__(self) -> None:
        _value_name("SharedSpec", self.other)

    def __str__(self) -> str:
        return f"#requant.shared<%{self.other}>"


@dataclass(frozen=True)
class DerivedSpec:
    """Parameters computed from the values named in ``sources`` by ``rule``.

    ``"product_of_scales"``: scale = product of the sources' scales, zero point 0 (a bias
    from its input and weight), stored as ``dtype`` (int32 by default).
    """

    sources: tuple[str, ...]
    rule: str = "product_of_scales"
    dtype: str = "int32"

    def __post_init__(self) -> None:
        sources = tuple(self.sources) if not isinstance(self.sources, str) else (self.sources,)
        if len(sources) < 1:
            raise RequestError("DerivedSpec needs at least one source value")
        for name in sources:
            _value_name("DerivedSpec source", name)
        object.__setattr__(self, "sources", sources)
        _one_of("derivation rule", self.rule, DERIVATION_RULES)
        _one_of("dtype", self.dtype, DTYPES)

    def __str__(self) -> str:
        sources = ", ".join(f"%{s}" for s in self.sources)
        return f"#requant.derived<{self.dtype}, {self.rule}({sources})>"


@dataclass(frozen=True)
class FixedSpec:
    """Fixed parameters (e.g. a sigmoid's output: scale 1/256, zero point 0, uint8)."""

    scale: float
    zero_point: int = 0
    dtype: str = "uint8"

    def __post_init__(self) -> None:
        _one_of("dtype", self.dtype, DTYPES)
        try:
            problems = self.quant_type("f32").problems()  # a request is for a target: MLIR's leeway is not
        except RequantError as exc:
            raise RequestError(f"FixedSpec: {exc}") from None
        if problems:
            raise RequestError(f"FixedSpec: {problems[0]}")

    def quant_type(self, expressed: str = "f32") -> UniformQuantizedType:
        """The quantized type these parameters make for a value of the given float type."""
        return UniformQuantizedType(DTYPES[self.dtype], expressed, self.scale, self.zero_point)

    def __str__(self) -> str:
        zp = f":{self.zero_point}" if self.zero_point else ""
        return f"#requant.fixed<{self.dtype}, {float(self.scale)!r}{zp}>"


@dataclass(frozen=True)
class NoQuant:
    """Keep the value in float."""

    def __str__(self) -> str:
        return "#requant.float"


Request: TypeAlias = QuantizationSpec | SharedSpec | DerivedSpec | FixedSpec | NoQuant

_SPEC = re.compile(r"#requant\.spec<(?P<body>.*)>")
_SHARED = re.compile(r"#requant\.shared<%(?P<name>[^>]+)>")
_DERIVED = re.compile(r"#requant\.derived<(?P<dtype>\w+), (?P<rule>\w+)\((?P<sources>[^)]*)\)>")
_FIXED = re.compile(r"#requant\.fixed<(?P<dtype>\w+), (?P<scale>[^:>]+)(?::(?P<zp>-?\d+))?>")
_OBSERVER = re.compile(r"(?P<name>[A-Za-z0-9_.:/\-]+)(?:\{(?P<options>.*)\})?")
_OPTION = re.compile(r'\s*(?P<key>[A-Za-z0-9_.:/\-]+) = (?P<value>"(?:[^"\\]|\\.)*"|[^,]+)\s*(?:,|$)')


def _parse_option(text: str) -> OptionValue:
    if text.startswith('"'):
        return text[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return float(text)


def _parse_spec(body: str) -> QuantizationSpec:
    head, _, observer_text = body.partition(", observer = ")
    words = [w.strip() for w in head.split(",")]
    kwargs: dict[str, object] = {"dtype": words[0], "symmetric": words[1] == "symmetric"}
    if words[1] not in ("symmetric", "affine"):
        raise RequestError(f"expected 'symmetric' or 'affine', got {words[1]!r}")
    for word in words[2:]:
        if word == "narrow":
            kwargs["narrow_range"] = True
        elif word == "reduced":
            kwargs["reduce_range"] = True
        elif word == "dynamic":
            kwargs["dynamic"] = True
        elif word.startswith("per_axis = "):
            kwargs.update(granularity="per_axis", axis=int(word.split("= ")[1]))
        elif word.startswith("blockwise = "):
            axis, size = word.split("= ")[1].split(":")
            kwargs.update(granularity="blockwise", axis=int(axis), block_size=int(size))
        else:
            raise RequestError(f"unexpected {word!r} in a quantization spec")
    observer = _OBSERVER.fullmatch(observer_text)
    if observer is None:
        raise RequestError(f"cannot read the observer {observer_text!r}")
    options: dict[str, OptionValue] = {}
    rest = observer.group("options") or ""
    while rest.strip():
        match = _OPTION.match(rest)
        if match is None:
            raise RequestError(f"cannot read observer options {rest!r}")
        options[match.group("key")] = _parse_option(match.group("value").strip())
        rest = rest[match.end() :]
    return QuantizationSpec(**kwargs, observer=observer.group("name"), observer_options=options)  # type: ignore[arg-type]


def parse_request(text: str) -> Request:
    """Read a request back from its text form (as printed, or stored in ``metadata_props``)."""
    text = text.strip()
    try:
        if text == "#requant.float":
            return NoQuant()
        if m := _SPEC.fullmatch(text):
            return _parse_spec(m.group("body"))
        if m := _SHARED.fullmatch(text):
            return SharedSpec(m.group("name"))
        if m := _DERIVED.fullmatch(text):
            sources = tuple(s.strip().lstrip("%") for s in m.group("sources").split(","))
            return DerivedSpec(sources, m.group("rule"), m.group("dtype"))
        if m := _FIXED.fullmatch(text):
            return FixedSpec(float(m.group("scale")), int(m.group("zp") or 0), m.group("dtype"))
    except (ValueError, IndexError) as exc:
        raise RequestError(f"invalid quantization request {text!r}: {exc}") from None
    raise RequestError(
        f"invalid quantization request {text!r}: expected #requant.spec<...>, #requant.shared<...>, "
        "#requant.derived<...>, #requant.fixed<...> or #requant.float"
    )
