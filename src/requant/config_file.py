"""The TOML config file of ``requant quantize --config FILE``: the flags, plus per-node and per-module settings.

```toml
calib = "calib/"                      # paths are relative to this file
eval = "eval.npz"
method = "mse"
preset = "UINT8_PER_CHANNEL_WEIGHTS" # the global config (default: chosen by the model)
strict = true                         # a node asked to be quantized that cannot be is an error

[images]                              # when calib/eval are folders of images
preset = "imagenet"                   # or: resize, crop, mean, std, scale, layout

[report]
json = "report.json"
markdown = "report.md"
html = "report.html"                  # one page with plots (needs matplotlib: requant[html])

[configs.W8_ONLY]                     # a named config: a preset to start from, then ports
base = "INT8_PER_CHANNEL_WEIGHTS"
input_activation = "float"
output_activation = "float"

[[override]]                          # later entries win over earlier ones
op_type = "Clip"                      # or: node, node_regex, module, module_type
config = "float"                      # a preset, a [configs] name, or "float"

[module_params."encoder.layer.0"]     # a module and its submodules (PyTorch module paths)
weights = "#requant.spec<int8, symmetric, per_axis = 0, observer = minmax>"
activations = { dtype = "uint16" }
```

A request is ``"float"``, its text form (``#requant.spec<...>``, ``#requant.fixed<...>``), or a
table of :class:`~requant.ir.requests.QuantizationSpec` fields. Unknown keys are errors that list
the known ones.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from requant.calibration.images import ImagePreprocessing
from requant.errors import RequantError
from requant.ir.requests import FixedSpec, NoQuant, QuantizationSpec, parse_request
from requant.options import OPTIONS, Option
from requant.quantizers.config import PRESETS, DerivedBias, QuantizationConfig
from requant.quantizers.finders import NodeName
from requant.quantizers.quantizer import Quantizer, QuantParams
from requant.targets.registry import DEFAULT_TARGET, get_target

__all__ = ["ConfigFileError", "RunSettings", "read_config"]

# the keys of the file besides the options' (requant.options.OPTIONS): the CLI's inputs and outputs, and
# what builds the quantizer
_OWN = ("calib", "preset", "images", "report", "configs", "override", "module_params")
_TOP = tuple(sorted((*_OWN, *(o.key for o in OPTIONS if o.key is not None))))
_SELECTORS = ("op_type", "node", "node_regex", "module", "module_type")
_PORTS = ("input_activation", "output_activation", "weight", "bias")


class ConfigFileError(RequantError):
    """A config file that cannot be read or says something requant does not know; names the file and the key."""


@dataclass
class RunSettings:
    """What one ``requant quantize`` run does, from a config file: the options it sets (by name, as
    :class:`~requant.options.Options` takes them), and the CLI's inputs, outputs and quantizer parts."""

    options: dict[str, Any] = field(default_factory=dict)
    calib: str | None = None
    preset: str | None = None  # None: the preset requant.quantizers.choose_preset picks for the model
    images: ImagePreprocessing | None = None
    report_json: str | None = None
    report_markdown: str | None = None
    report_html: str | None = None
    configs: dict[str, QuantizationConfig] = field(default_factory=dict)
    overrides: list[tuple[str, Any, QuantizationConfig | None]] = field(default_factory=list)
    module_params: dict[str, QuantParams] = field(default_factory=dict)

    def merged(self, flags: Mapping[str, Any]) -> dict[str, Any]:
        """The file's options with the command line's over them (a table's entries, ``fixed_inputs``,
        added to the file's)."""
        given = dict(self.options)
        for name, value in flags.items():
            before = given.get(name)
            given[name] = {**before, **value} if isinstance(before, Mapping) and isinstance(value, Mapping) else value
        return given

    def quantizer(self, target: str = DEFAULT_TARGET) -> Quantizer:
        """The composite quantizer: the preset globally, module parameters, then the overrides (last wins)."""
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigFileError(f"unknown preset {self.preset!r}; known: {', '.join(sorted(PRESETS))}")
        quantizer = Quantizer(get_target(target).table)
        if self.preset is None:
            quantizer.set_global_by_model()
        else:
            quantizer.set_global(PRESETS[self.preset])
        if self.module_params:
            quantizer.set_module_params(self.module_params)
        setters = {
            "op_type": lambda v, c: quantizer.set_op_type(v if isinstance(v, str) else tuple(v), c),
            "node": quantizer.set_node_name,
            "node_regex": lambda v, c: quantizer.set_node_name(v, c, regex=True),
            "module": quantizer.set_module_name,
            "module_type": quantizer.set_module_type,
        }
        for selector, value, config in self.overrides:
            setters[selector](value, config)
        return quantizer


def _check_keys(table: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigFileError(f"{where}: unknown key {', '.join(map(repr, unknown))}; known keys: {', '.join(known)}")


def _typed(value: Any, kind: type | tuple[type, ...], where: str, what: str) -> Any:
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ConfigFileError(f"{where}: expected {what}, got {value!r}")
    return value


def _request(value: Any, where: str) -> QuantizationSpec | FixedSpec | NoQuant:
    if value == "float":
        return NoQuant()
    try:
        if isinstance(value, str):
            request = parse_request(value)
        elif isinstance(value, Mapping):
            request = QuantizationSpec(**value)
        else:
            raise ConfigFileError(f'{where}: expected "float", a request text or a table, got {value!r}')
    except TypeError as exc:
        known = ", ".join(f.name for f in dataclasses.fields(QuantizationSpec))
        raise ConfigFileError(f"{where}: {exc}; a spec table takes {known}") from None
    except RequantError as exc:
        raise ConfigFileError(f"{where}: {exc}") from None
    if not isinstance(request, (QuantizationSpec, FixedSpec, NoQuant)):
        raise ConfigFileError(f"{where}: {value!r} is not a request a config can hold (a spec, fixed, or float)")
    return request


def _bias(value: Any, where: str) -> Any:
    if value == "derived":
        return DerivedBias()
    if isinstance(value, str) and value.startswith("derived<") and value.endswith(">"):
        return DerivedBias(value[len("derived<") : -1])
    return _request(value, where)


def _config(name: str, table: Any, where: str) -> QuantizationConfig:
    _typed(table, Mapping, where, "a table")
    _check_keys(table, ("base", *_PORTS), where)
    base_name = table.get("base")
    if base_name is not None and base_name not in PRESETS:
        raise ConfigFileError(f"{where}: unknown base {base_name!r}; known presets: {', '.join(sorted(PRESETS))}")
    ports: dict[str, Any] = {}
    for port in _PORTS:
        if port in table:
            ports[port] = (_bias if port == "bias" else _request)(table[port], f"{where}.{port}")
    try:
        if base_name is not None:
            return dataclasses.replace(PRESETS[base_name], name=name, **ports)
        return QuantizationConfig(name, **ports)
    except RequantError as exc:
        raise ConfigFileError(f"{where}: {exc}") from None


def _named_config(name: Any, configs: Mapping[str, QuantizationConfig], where: str) -> QuantizationConfig | None:
    if name == "float":
        return None
    if isinstance(name, str) and name in configs:
        return configs[name]
    if isinstance(name, str) and name in PRESETS:
        return PRESETS[name]
    known = ", ".join(["float", *sorted(PRESETS), *sorted(configs)])
    raise ConfigFileError(f"{where}: unknown config {name!r}; known: {known}")


def _option(option: Option, value: Any, base: Path, where: str) -> Any:
    """The file's ``value`` for ``option``, checked as the API checks it (requant.options), a path made
    relative to the file's folder."""
    if option.path:
        value = _path(value, base, f"{where}: {option.key}")
    if option.name == "fixed_inputs":
        value = _fixed_inputs(value, where)
    try:
        return option.checked(value, f"{where}: ")
    except RequantError as exc:
        raise ConfigFileError(str(exc)) from None


def _fixed_inputs(value: Any, where: str) -> dict[str, Any]:
    fixed = _typed(value, Mapping, f"{where}: fixed_inputs", "a table of input = value")
    for name, given in fixed.items():
        numbers = given if isinstance(given, list) else [given]
        if not numbers or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
            raise ConfigFileError(
                f"{where}: fixed_inputs.{name}: expected a number or an array of numbers, got {given!r}"
            )
    return dict(fixed)


def _path(value: Any, base: Path, where: str) -> str:
    _typed(value, str, where, "a path (a string)")
    return str(base / value) if not os.path.isabs(value) else value


def read_config(path: str | os.PathLike[str]) -> RunSettings:
    """Read a config file; every mistake is a :class:`ConfigFileError` naming the file and the key."""
    file = Path(path)
    data = _read_toml(file)
    where = str(file)
    _check_keys(data, _TOP, where)
    base = file.parent
    settings = RunSettings()
    if "calib" in data:
        settings.calib = _path(data["calib"], base, f"{where}: calib")
    if "preset" in data:
        settings.preset = _typed(data["preset"], str, f"{where}: preset", "a string")
    if settings.preset is not None and settings.preset not in PRESETS:
        raise ConfigFileError(
            f"{where}: preset: unknown preset {settings.preset!r}; known: {', '.join(sorted(PRESETS))}"
        )
    for option in OPTIONS:
        if option.key is not None and option.key in data:
            settings.options[option.name] = _option(option, data[option.key], base, where)
    if "images" in data:
        try:
            settings.images = ImagePreprocessing.from_settings(
                _typed(data["images"], Mapping, f"{where}: images", "a table"), f"{where}: images"
            )
        except (RequantError, TypeError) as exc:
            raise ConfigFileError(str(exc)) from None
    report = _typed(data.get("report", {}), Mapping, f"{where}: report", "a table")
    _check_keys(report, ("json", "markdown", "html"), f"{where}: report")
    for key, attribute in (("json", "report_json"), ("markdown", "report_markdown"), ("html", "report_html")):
        if key in report:
            setattr(settings, attribute, _path(report[key], base, f"{where}: report.{key}"))
    configs = _typed(data.get("configs", {}), Mapping, f"{where}: configs", "a table of named configs")
    for name, table in configs.items():
        settings.configs[name] = _config(name, table, f"{where}: configs.{name}")
    _read_overrides(data, settings, where)
    _read_module_params(data, settings, where)
    return settings


def _read_toml(file: Path) -> dict[str, Any]:
    try:
        with open(file, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigFileError(f"no config file at '{file}'") from None
    except IsADirectoryError:
        raise ConfigFileError(f"'{file}' is a folder, not a config file") from None
    except OSError as exc:
        raise ConfigFileError(f"cannot read the config file '{file}': {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigFileError(
            f"'{file}' is not UTF-8 text (TOML is UTF-8): byte {exc.object[exc.start]:#04x} at offset {exc.start}"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"'{file}' is not valid TOML: {exc}") from None


def _read_overrides(data: Mapping[str, Any], settings: RunSettings, where: str) -> None:
    """The ``[[override]]`` entries, in order (later ones win)."""
    overrides = _typed(data.get("override", []), list, f"{where}: override", "an array of tables ([[override]])")
    for i, entry in enumerate(overrides, start=1):
        at = f"{where}: override {i}"
        _typed(entry, Mapping, at, "a table")
        _check_keys(entry, (*_SELECTORS, "config"), at)
        selectors = [s for s in _SELECTORS if s in entry]
        if len(selectors) != 1:
            raise ConfigFileError(f"{at}: needs exactly one of {', '.join(_SELECTORS)}, got {selectors or 'none'}")
        selector = selectors[0]
        value = entry[selector]
        if selector == "op_type" and isinstance(value, list):
            for v in value:
                _typed(v, str, f"{at}.op_type", "op type names")
        else:
            _typed(value, str, f"{at}.{selector}", "a string")
        if selector == "node_regex":
            try:
                NodeName(value, regex=True)  # its pattern is checked now, not when the quantizer is built
            except RequantError as exc:
                raise ConfigFileError(f"{at}.node_regex: {exc}") from None
        if "config" not in entry:
            raise ConfigFileError(f'{at}: needs a config (a preset, a [configs] name, or "float")')
        settings.overrides.append((selector, value, _named_config(entry["config"], settings.configs, f"{at}.config")))


def _read_module_params(data: Mapping[str, Any], settings: RunSettings, where: str) -> None:
    """The ``[module_params."path"]`` tables: a module's (and its submodules') weights and activations."""
    params = _typed(data.get("module_params", {}), Mapping, f"{where}: module_params", "a table of module paths")
    for module, table in params.items():
        at = f"{where}: module_params.{module}"
        _typed(table, Mapping, at, "a table")
        _check_keys(table, ("weights", "activations"), at)
        ports = {k: _request(v, f"{at}.{k}") for k, v in table.items()}
        if any(isinstance(v, FixedSpec) for v in ports.values()):
            raise ConfigFileError(f'{at}: module parameters take a spec or "float", not a fixed request')
        settings.module_params[module] = QuantParams(**ports)  # type: ignore[arg-type]
