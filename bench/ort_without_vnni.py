"""A copy of the installed ONNX Runtime that runs the kernels of an AVX2 CPU without VNNI, on any x86 CPU.

What for: requant's default weights are chosen so that ONNX Runtime's uint8 x int8 kernels cannot
saturate on CPUs without VNNI, and its latency goals are for those CPUs; on a machine with VNNI
neither can be observed, because MLAS picks its kernels from CPUID at load time and has no switch.
This copy has that choice changed, nothing else: in each copy of ``MLAS_PLATFORM``'s constructor
(ONNX Runtime 1.31.1's Python module has four, one per translation unit that inlines it) the two
branches that take the AVX-VNNI kernels (CPUID leaf 7.1, EAX bit 4) and the AVX-512 ones (leaf 7,
EBX bit 16: AVX512F, under which the AVX512-core and AVX512-VNNI kernels are chosen) are made
unconditional jumps past them. MLAS then keeps what it chose for AVX2 + FMA3, as on a Zen 2/3 EPYC
or a Haswell-Skylake client: the ``vpmaddubsw`` uint8 x int8 kernels (int16 pair sums) and the
AVX2/FMA3 float kernels. The kernels are ONNX Runtime's own, on this CPU's cores; latencies are this
CPU's, running AVX2 code (not an older CPU's), so ratios carry over only approximately (MobileNetV2,
requant's default: 0.72 of float here, 0.68 on the AVX2 EPYC of earlier runs).

The byte patterns are checked exactly (the ``cpuid`` with EAX=7, ECX=1, ``test al, 0x10``, ``je``,
and at its target ``test reg, 0x10000``, ``je``); anything else, or a count other than four, is an
error, not a guess. The copy carries a marker file (``REQUANT_WITHOUT_VNNI``) that the tests read.
Whether the patch took is checked by running one saturating ``MatMulInteger`` in it.

    .venv/bin/python bench/ort_without_vnni.py DIR        # writes DIR/onnxruntime, prints the PYTHONPATH
    PYTHONPATH=DIR .venv/bin/python bench/bench_quantize.py ...
    PYTHONPATH=DIR .venv/bin/pytest -q                     # the test suite, as on an AVX2 CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

MARKER = "REQUANT_WITHOUT_VNNI"  # tests/host.py reads it
ROOT = Path(__file__).parent.parent
COPIES = 4  # MLAS_PLATFORM's constructor, inlined four times in ONNX Runtime 1.31.1's Python module

# mov eax, 7; mov ecx, 1; cpuid; test al, 0x10 (AVX-VNNI); je rel8
_AVX_VNNI = re.compile(rb"\xb8\x07\x00\x00\x00\xb9\x01\x00\x00\x00\x0f\xa2\xa8\x10\x74(.)", re.DOTALL)
# at that je's target: test r32, 0x10000 (AVX512F; with a REX prefix for r8-r15); je rel8
_AVX512F = re.compile(rb"(\x41)?\xf7[\xc0-\xc7]\x00\x00\x01\x00\x74", re.DOTALL)
JMP = 0xEB  # jmp rel8: the same length as je rel8, the same displacement


def patch(module: bytes) -> tuple[bytes, int]:
    """The module with both branches unconditional in every copy of the constructor, and the count."""
    out = bytearray(module)
    count = 0
    for match in _AVX_VNNI.finditer(module):
        je = match.end() - 2
        target = je + 2 + match.group(1)[0]
        avx512 = _AVX512F.match(module, target)
        if avx512 is None:
            raise SystemExit(f"at {target:#x}: not the AVX512F test this script knows; ONNX Runtime changed")
        out[je] = JMP
        out[avx512.end() - 1] = JMP
        count += 1
    return bytes(out), count


def saturates(pythonpath: Path) -> bool:
    """In a fresh interpreter with ``pythonpath`` first: does MatMulInteger add in int16 pairs? (The
    tests' probe, ``tests/host.py``.)"""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    probe = "from tests.host import PAIRS_SATURATE; print(PAIRS_SATURATE)"
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True, capture_output=True, text=True, env=env)
    return run.stdout.strip() == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where to write the copy (DIR/onnxruntime)")
    args = parser.parse_args()
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or spec.origin is None:
        raise SystemExit("onnxruntime is not installed in this interpreter")
    source = Path(spec.origin).parent
    if (source / MARKER).exists():
        raise SystemExit(f"{source} is already a patched copy: run this with the installed onnxruntime")
    module = next((source / "capi").glob("onnxruntime_pybind11_state*.so"))
    patched, count = patch(module.read_bytes())  # before anything is written: a refusal leaves nothing
    if count != COPIES:
        raise SystemExit(f"found {count} copies of MLAS's CPU dispatch, expected {COPIES}: ONNX Runtime changed")
    target = args.folder / "onnxruntime"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    (target / module.relative_to(source)).write_bytes(patched)
    (target / MARKER).write_text("MLAS's AVX-VNNI and AVX-512 kernels disabled by bench/ort_without_vnni.py\n")
    if not saturates(args.folder.resolve()):
        shutil.rmtree(target)
        raise SystemExit(f"{target}: patched, but MatMulInteger still adds in int32; removed")
    print(f"PYTHONPATH={args.folder.resolve()}")


if __name__ == "__main__":
    main()
