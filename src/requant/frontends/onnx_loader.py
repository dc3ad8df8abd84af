"""The ONNX front door: load a model from a path, bytes, text or ``ModelProto``; save one safely.

Loading never modifies the input. Every failure is a :class:`LoadError` that
names the input and says what was wrong. Weights in external data files stay
memory-mapped (onnx-ir's lazy external tensors), so large models load fast and
small.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from requant.errors import RequantError
from requant.ir.annotations import load_annotations
from requant.ir.queries import DEFAULT_DOMAINS

__all__ = [
    "KNOWN_DOMAINS",
    "MIN_OPSET",
    "WORKING_OPSET",
    "LoadError",
    "SaveError",
    "has_external_data",
    "load_onnx",
    "load_onnx_text",
    "save_bytes",
    "save_onnx",
    "serialized_size",
    "weight_bytes",
]

log = logging.getLogger(__name__)

MIN_OPSET = 11  # the oldest default-domain opset requant takes as it is
WORKING_OPSET = 13  # older models are converted up to this one (per-axis QDQ needs 13)
KNOWN_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft", "ai.onnx.preview.training"})
TEXT_SUFFIXES = (".onnxtxt", ".txt")
_EXTERNAL_THRESHOLD = 1 << 30  # save weights to external data past 1 GiB (protobuf stops at 2 GiB)


class LoadError(RequantError):
    """A model could not be loaded; the message names the input."""


class SaveError(RequantError):
    """A model could not be saved; nothing was written at the destination."""


def _describe(source: object) -> str:
    if isinstance(source, (str, os.PathLike)):
        return f"'{os.fspath(source)}'"
    if isinstance(source, (bytes, bytearray)):
        return f"the {len(source)}-byte model"
    return "the model"


def load_onnx_text(text: str, name: str = "the text model") -> ir.Model:
    """A model written in ONNX's text syntax (``onnx.parser``), as tests and bug reports use."""
    try:
        proto = onnx.parser.parse_model(text)
    except onnx.parser.ParseError as exc:
        raise LoadError(f"could not parse {name} as ONNX text syntax: {exc}") from None
    return _finish(proto, name, path=None)


def load_onnx(source: str | os.PathLike[str] | bytes | onnx.ModelProto | ir.Model, checker: bool = True) -> ir.Model:
    """Load an ONNX model from a file path, serialized bytes, a ``ModelProto`` or an onnx-ir model.

    A path ending in ``.onnxtxt`` or ``.txt`` is read as ONNX text syntax. ``checker=False``: not ONNX's
    checker, for models of ONNX Runtime's own operators in the default domain (onnxruntime-genai's
    ``SimplifiedLayerNormalization``), which the caller checks by making a session.
    """
    what = _describe(source)
    if isinstance(source, ir.Model):
        load_annotations(source)
        return source
    if isinstance(source, onnx.ModelProto):  # a copy: onnx-ir's tensors write names through to their proto
        proto = onnx.ModelProto()
        proto.CopyFrom(source)
        return _finish(proto, what, None, checker)
    if isinstance(source, (bytes, bytearray)):
        proto = onnx.ModelProto()
        try:
            proto.ParseFromString(bytes(source))
        except DecodeError as exc:
            raise LoadError(f"could not parse {what} as an ONNX model (corrupt or not ONNX): {exc}") from None
        return _finish(proto, what, None, checker)
    if not isinstance(source, (str, os.PathLike)):
        raise LoadError(f"cannot load a {type(source).__name__}: give a path, bytes, an onnx.ModelProto or ir.Model")
    path = Path(source)
    if path.is_dir() and (path / "config.json").is_file():
        raise LoadError(f"no model file at {what}: it is a Hugging Face folder, which requant quantize exports; "
                        "this reads an ONNX file (quantize the folder with -o DIR, then give the .onnx it writes "
                        "there)")  # fmt: skip
    if not path.is_file():
        raise LoadError(f"no model file at {what}")
    if path.suffix in TEXT_SUFFIXES:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise LoadError(
                f"{what} is not UTF-8 text (ONNX text syntax is UTF-8): byte {exc.object[exc.start]:#04x} "
                f"at offset {exc.start}"
            ) from None
        return load_onnx_text(text, what)
    try:
        proto = onnx.load(os.fspath(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise LoadError(f"could not parse {what} as an ONNX model (corrupt or not ONNX): {exc}") from None
    _check_external_data(proto, path.parent, what)
    return _finish(proto, what, path, checker)


def _external_tensors(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    found = []
    for tensor in onnx.external_data_helper._get_all_tensors(proto):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            found.append(tensor)
    return found


def _check_external_data(proto: onnx.ModelProto, base: Path, what: str) -> None:
    for tensor in _external_tensors(proto):
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if os.path.isabs(location) or ".." in Path(location).parts:  # not even looked at: ONNX's rule
            raise LoadError(
                f"{what}: initializer '{tensor.name}' keeps its data at '{location}', outside the model's "
                "folder; ONNX external data must be a path relative to the model, inside its folder"
            )
        target = (base / location).resolve()
        if not location or not target.is_file():
            raise LoadError(
                f"{what}: initializer '{tensor.name}' keeps its data in '{location}', "
                f"which is missing next to the model (looked for {target})"
            )
        try:
            end = int(info.get("offset", "0")) + int(info.get("length", "0"))
        except ValueError:
            raise LoadError(
                f"{what}: initializer '{tensor.name}' has a non-numeric external-data offset or length "
                f"({info.get('offset')!r}, {info.get('length')!r})"
            ) from None
        if end > target.stat().st_size:
            raise LoadError(
                f"{what}: initializer '{tensor.name}' needs bytes up to {end} of '{location}', "
                f"which has only {target.stat().st_size}"
            )


def _finish(proto: onnx.ModelProto, what: str, path: Path | None, checker: bool = True) -> ir.Model:
    opset = next((o.version for o in proto.opset_import if o.domain in DEFAULT_DOMAINS), None)
    if opset is None:
        raise LoadError(f"{what} imports no version of the default ONNX domain")
    newest = onnx.defs.onnx_opset_version()
    if opset > newest:
        raise LoadError(
            f"{what} uses opset {opset} of the default ONNX domain; the newest requant knows is {newest} "
            f"(onnx {onnx.__version__})"
        )
    local = {f.domain for f in proto.functions}
    unknown = sorted({n.domain for n in proto.graph.node} - KNOWN_DOMAINS - local)
    if unknown:
        nodes = [f"'{n.name or n.op_type}' ({n.domain}.{n.op_type})" for n in proto.graph.node if n.domain in unknown]
        raise LoadError(
            f"{what} uses operators from unknown domain(s) {', '.join(repr(d) for d in unknown)}: "
            f"{', '.join(nodes[:5])}{' ...' if len(nodes) > 5 else ''}; requant knows {sorted(KNOWN_DOMAINS)}"
        )
    try:
        if checker and path is not None:  # the checker resolves external data (and > 2 GB models) from the path
            onnx.checker.check_model(os.fspath(path), full_check=False)
        elif checker:
            onnx.checker.check_model(proto, full_check=False)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0]
        raise LoadError(f"{what} fails ONNX's checker: {first}") from None
    if opset < WORKING_OPSET:
        try:
            proto = onnx.version_converter.convert_version(proto, WORKING_OPSET)
        except Exception as exc:  # the converter raises bare RuntimeErrors and more
            raise LoadError(
                f"{what} uses opset {opset}; requant needs {MIN_OPSET} or newer and could not convert it "
                f"to {WORKING_OPSET}: {exc}"
            ) from None
        log.info("%s: converted from opset %d to opset %d with ONNX's version converter", what, opset, WORKING_OPSET)
    _raise_ir_version(proto, what)
    _lower_ir_version(proto, what)
    model = ir.serde.deserialize_model(proto)
    if path is not None:
        ir.external_data.set_base_dir(model.graph, path.parent)
    _initializers_are_not_inputs(model.graph, what)
    load_annotations(model)
    return model


def _raise_ir_version(proto: onnx.ModelProto, what: str) -> None:
    """An IR version older than its opsets need (IR 3, what exporters of opset 7 and 8 wrote) raised to
    the oldest that holds them: from IR 4 on, an initializer need not be a graph input, and requant takes
    them as constants (:func:`_initializers_are_not_inputs`); ONNX Runtime refuses an IR-3 model whose
    initializers are not inputs ("initializer_arg was false")."""
    needed = onnx.helper.find_min_ir_version_for(list(proto.opset_import), ignore_unknown=True)
    if proto.ir_version < max(needed, 4):
        log.info("%s: IR version %d raised to %d (its opsets need it)", what, proto.ir_version, max(needed, 4))
        proto.ir_version = max(needed, 4)


@functools.cache
def runtime_ir_version() -> int:
    """The newest IR version the installed ONNX Runtime loads (its refusal of a newer one says; onnxruntime
    1.31: 13, where onnx 1.23's ``helper.make_model`` writes 14)."""
    import onnxruntime as ort  # type: ignore[import-untyped]

    graph = onnx.helper.make_graph([], "probe", [], [])
    probe = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)])
    probe.ir_version = onnx.IR_VERSION
    try:
        ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as exc:  # "Unsupported model IR version: 14, max supported IR version: 13", or another
        found = re.search(r"max supported IR version: (\d+)", str(exc))
        return int(found.group(1)) if found else onnx.IR_VERSION
    return onnx.IR_VERSION


def _lower_ir_version(proto: onnx.ModelProto, what: str) -> None:
    """An IR version newer than ONNX Runtime loads (onnx 1.23's ``helper.make_model`` writes 14; onnxruntime
    1.31 reads 13) lowered to the newest it loads, where the opsets allow and no element type is newer than
    FLOAT4E2M1 (IR 11's): the same model, which ONNX Runtime then calibrates and runs, and so does its output."""
    if proto.ir_version <= 13:  # no probe for what exporters write
        return
    newest = runtime_ir_version()
    needed = onnx.helper.find_min_ir_version_for(list(proto.opset_import), ignore_unknown=True)
    if proto.ir_version <= newest or needed > newest or _newest_type(proto) > onnx.TensorProto.FLOAT4E2M1:
        return
    log.info("%s: IR version %d lowered to %d (what ONNX Runtime loads)", what, proto.ir_version, newest)
    proto.ir_version = newest


def _newest_type(proto: onnx.ModelProto) -> int:
    """The largest element type number of the graph's initializers and declared values (0 for none)."""
    graph = proto.graph
    types = [t.data_type for t in graph.initializer]
    values = [*graph.input, *graph.output, *graph.value_info]
    types += [v.type.tensor_type.elem_type for v in values if v.type.HasField("tensor_type")]
    types += [a.t.data_type for n in graph.node for a in n.attribute if a.HasField("t")]
    return max(types, default=0)


def _initializers_are_not_inputs(graph: ir.Graph, what: str) -> None:
    """Initializers listed among the graph's inputs (IR 3 listed every weight there; later IRs read
    it as a default the caller may override) become plain initializers: requant quantizes them as
    constants, and a quantized weight cannot be overridden with float values anyway."""
    listed = [v for v in graph.inputs if v.name in graph.initializers]
    if listed:
        names = ", ".join(f"'{v.name}'" for v in listed[:5]) + (" ..." if len(listed) > 5 else "")
        log.info("%s: %d initializers listed as inputs are taken as constants: %s", what, len(listed), names)
        for value in listed:
            graph.inputs.remove(value)


def save_text(text: str, path: str | os.PathLike[str]) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file in its folder, then a rename)."""
    save_bytes(text.encode("utf-8"), path)


def save_bytes(data: bytes, path: str | os.PathLike[str]) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file in its folder, then a rename)."""
    target = Path(path)
    if not target.parent.is_dir():
        raise SaveError(f"cannot save to '{target}': the folder '{target.parent}' does not exist")
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, target)
    except OSError as exc:
        raise SaveError(f"could not save to '{target}': {exc.strerror or exc}") from None
    finally:
        partial.unlink(missing_ok=True)


def save_onnx(model: ir.Model, path: str | os.PathLike[str], *, external_data: bool | None = None) -> None:
    """Write ``model`` to ``path`` whole or not at all (a temporary file, then a rename).

    Weights go to ``<name>.data`` next to the model when ``external_data`` is
    True, or when it is None and the weights exceed 1 GiB or already came from
    external data.
    """
    target = Path(path)
    if not target.parent.is_dir():
        raise SaveError(f"cannot save to '{target}': the folder '{target.parent}' does not exist")
    if external_data is None:
        external_data = has_external_data(model) or weight_bytes(model) > _EXTERNAL_THRESHOLD
    data_name = target.name + ".data"
    try:
        tmp_dir = Path(tempfile.mkdtemp(prefix=".requant-save-", dir=target.parent))
    except OSError as exc:
        raise SaveError(f"cannot save to '{target}': cannot write in its folder: {exc.strerror or exc}") from None
    try:
        tmp_model = tmp_dir / target.name
        if external_data:
            ir.save(model, tmp_model, external_data=data_name)
            os.replace(tmp_dir / data_name, target.parent / data_name)
        else:
            ir.save(model, tmp_model)
        os.replace(tmp_model, target)
    except OSError as exc:
        raise SaveError(f"could not save the model to '{target}': {exc}") from None
    finally:
        for leftover in tmp_dir.iterdir():
            leftover.unlink()
        tmp_dir.rmdir()


def serialized_size(model: ir.Model) -> int:
    """``ModelProto.ByteSize()`` of ``model``, serializing one weight at a time.

    Serializing the whole model at once holds a second copy of every weight (all-MiniLM-L6-v2:
    +260 MB at the peak of ``requant.quantize``, for a number).
    """
    values = [v for v in model.graph.initializers.values() if v.const_value is not None]
    tensors = [v.const_value for v in values]
    serde_log = logging.getLogger("onnx_ir.serde")  # it warns about each initializer without data
    level = serde_log.level
    try:
        serde_log.setLevel(logging.ERROR)
        for v in values:
            v.const_value = None
        bare = ir.serde.serialize_model(model)
    finally:
        serde_log.setLevel(level)
        for v, t in zip(values, tensors, strict=True):
            v.const_value = t
    graph = int(bare.graph.ByteSize())
    full = graph
    for v, t in zip(values, tensors, strict=True):
        assert t is not None
        t.name = v.name  # as serialization does
        n = int(ir.serde.serialize_tensor(t).ByteSize())
        full += 1 + _varint_size(n) + n  # GraphProto.initializer: a one-byte tag, the length, the tensor
    return int(bare.ByteSize()) - _varint_size(graph) + _varint_size(full) + full - graph


def _varint_size(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def has_external_data(model: ir.Model) -> bool:
    """Whether some weight of ``model`` is still in an external data file (mapped, not read)."""
    return any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())


def weight_bytes(model: ir.Model) -> int:
    """The bytes of ``model``'s initializers."""
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
