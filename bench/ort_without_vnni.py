"""A copy of the installed ONNX Runtime that runs the kernels of an AVX2 CPU without VNNI, on any x86 CPU.

What for: requant's default weights are chosen so that ONNX Runtime's uint8 x int8 kernels cannot
saturate on CPUs without VNNI, and its latency goals are for those CPUs; on a machine with VNNI or AMX
neither can be observed, because MLAS picks its kernels from CPUID at load time and has no switch.
This copy has that choice changed, nothing else. ONNX Runtime 1.31.1's Python module inlines
``MLAS_PLATFORM``'s constructor four times (one per translation unit); in each, after the AVX2 + FMA3
kernels are chosen, the CPUID tests that pick other int8 kernels follow one another, each ``je``
landing on the next test (MLAS's ``platform.cpp``):

1. AVX-VNNI (leaf 7.1, EAX bit 4): the ``vpdpbusd`` QGEMM and ConvSym kernels. Made a ``jmp``.
2. AVX512F (leaf 7, EBX bit 16), under which the AVX512-core and AVX512-VNNI kernels are chosen.
   Made a ``jmp``.
3. AVX-VNNI-INT8 (leaf 7.1, EDX bit 4): the uint8 x uint8 and int8 x int8 GEMMs. Made a ``jmp``.
4. AVX-NE-CONVERT (leaf 7.1, EDX bit 5): a float16 conversion, no int8 kernel. Left as it is.
5. AMX-TILE and AMX-INT8 (leaf 7, EDX bits 24 and 25; then the OS's permission through
   ``arch_prctl``): the AMX QGEMM dispatch, which takes every uint8 x int8 GEMM (Intel Sapphire
   Rapids and later). Its ``jne`` past the block (6 bytes) becomes ``nop; jmp`` to the same place.

MLAS then keeps what it chose for AVX2 + FMA3, as on a Zen 2/3 EPYC or a Haswell-Skylake client: the
``vpmaddubsw`` uint8 x int8 kernels (int16 pair sums) and the AVX2/FMA3 float kernels. The kernels
are ONNX Runtime's own, on this CPU's cores; latencies are this CPU's, running AVX2 code (not an
older CPU's), so ratios carry over only approximately (MobileNetV2, requant's default: 0.72 of float
here, 0.68 on the AVX2 EPYC of earlier runs).

Every byte pattern is checked exactly, at the place the test before it jumps to; anything else, or a
count of constructors other than four, is an error, not a guess. The copy carries a marker file
(``REQUANT_WITHOUT_VNNI``) that the tests read. Whether the patch took is checked by running one
saturating ``MatMulInteger`` in it. Where it did not, and the CPU has int8 extensions this script does
not know (``KNOWN_FLAGS``), it exits with ``UNKNOWN_CPU`` (3) and names them: a CPU with a branch
this script has not read, which the tests skip; on a CPU whose extensions it knows, that is an error.
A CPU without AVX2 + FMA3 has no AVX2 kernels to run: also ``UNKNOWN_CPU``.

    .venv/bin/python bench/ort_without_vnni.py DIR        # writes DIR/onnxruntime, prints the PYTHONPATH
    PYTHONPATH=DIR .venv/bin/python bench/bench_quantize.py ...
    PYTHONPATH=DIR .venv/bin/pytest -q                     # the test suite, as on an AVX2 CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MARKER = "REQUANT_WITHOUT_VNNI"  # tests/host.py reads it
ROOT = Path(__file__).parent.parent
COPIES = 4  # MLAS_PLATFORM's constructor, inlined four times in ONNX Runtime 1.31.1's Python module
UNKNOWN_CPU = 3  # the exit status for a CPU whose int8 kernels this script cannot turn into the AVX2 ones

# The int8 extensions of MLAS's x86 dispatch, as Linux names them in /proc/cpuinfo, whose branches this
# script has read (AVX-VNNI, AVX512-VNNI, AMX); a CPU with another flag matching INT8_EXTENSION whose
# copy does not saturate has a branch this script does not know
KNOWN_FLAGS = frozenset({"avx_vnni", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16", "avx_vnni_int8"})
INT8_EXTENSION = re.compile(r"vnni|amx|avx10")


@dataclass(frozen=True)
class Branch:
    """One CPUID test of the chain: its bytes, ending in a conditional jump whose displacement is the
    pattern's one group; ``jump``, what replaces the jump's opcode so that the block the test guards
    never runs (empty: the test is left as it is)."""

    name: str
    pattern: re.Pattern[bytes]
    jump: bytes

    def target(self, match: re.Match[bytes]) -> int:
        """Where the test's jump lands: the next test of the chain."""
        return match.end() + int.from_bytes(match.group(1), "little", signed=True)

    def patch(self, out: bytearray, match: re.Match[bytes]) -> None:
        at = match.start(1) - len(self.jump)
        out[at : match.start(1)] = self.jump


JMP8 = b"\xeb"  # jmp rel8 for je rel8 (74): the same length, the same displacement
JMP32 = b"\x90\xe9"  # nop; jmp rel32 for jne rel32 (0f 85): the same length, the same target
_CHAIN = (
    # mov eax, 7; mov ecx, 1; cpuid; test al, 0x10 (AVX-VNNI: EAX of leaf 7.1); je rel8
    Branch(
        "AVX-VNNI", re.compile(rb"\xb8\x07\x00\x00\x00\xb9\x01\x00\x00\x00\x0f\xa2\xa8\x10\x74(.)", re.DOTALL), JMP8
    ),
    # test r32, 0x10000 (AVX512F: EBX of leaf 7; a REX prefix for r8-r15); je rel8
    Branch("AVX512F", re.compile(rb"(?:\x41)?\xf7[\xc0-\xc7]\x00\x00\x01\x00\x74(.)", re.DOTALL), JMP8),
    # test dl, 0x10 (AVX-VNNI-INT8: EDX of leaf 7.1); je rel8
    Branch("AVX-VNNI-INT8", re.compile(rb"\xf6\xc2\x10\x74(.)", re.DOTALL), JMP8),
    # and dl, 0x20 or and edx, 0x20 (AVX-NE-CONVERT: a float16 conversion); je rel8: left as it is
    Branch("AVX-NE-CONVERT", re.compile(rb"(?:\x80\xe2|\x83\xe2)\x20\x74(.)", re.DOTALL), b""),
    # not r32 (EDX of leaf 7); [lea rax, [rsp + disp32]]; and r32, 0x3000000 (AMX-TILE and AMX-INT8);
    # [mov [rsp + disp8], rax]; jne rel32 past the block (the compiler interleaves the bracketed ones)
    Branch(
        "AMX",
        re.compile(
            rb"(?:\x41)?\xf7[\xd0-\xd7](?:\x48\x8d\x84\x24....)?(?:\x41)?\x81[\xe0-\xe7]\x00\x00\x00\x03"
            rb"(?:\x48\x89\x44\x24.)?\x0f\x85(....)",
            re.DOTALL,
        ),
        JMP32,
    ),
)


def chains(module: bytes) -> list[dict[str, re.Match[bytes]]]:
    """Each copy of the constructor's chain of tests, by ``Branch.name``: each test is looked for where
    the one before it lands (the first, AVX-VNNI's, by its bytes); the AMX test is the last."""
    first, *rest = _CHAIN
    found = []
    for match in first.pattern.finditer(module):
        chain = {first.name: match}
        at = first.target(match)
        for branch in rest:
            test = branch.pattern.match(module, at)
            if test is None:
                raise SystemExit(f"at {at:#x}: not the {branch.name} test this script knows; ONNX Runtime changed")
            chain[branch.name] = test
            at = branch.target(test)
        found.append(chain)
    return found


def patch(module: bytes) -> tuple[bytes, int]:
    """The module with every int8 test of ``_CHAIN`` (but AVX-NE-CONVERT's) jumping past its block in every
    copy of the constructor, and the count of copies."""
    out = bytearray(module)
    found = chains(module)
    for chain in found:
        for branch in _CHAIN:
            branch.patch(out, chain[branch.name])
    return bytes(out), len(found)


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's flags as Linux lists them (``cpuinfo``: the text of ``/proc/cpuinfo``; read when None)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(errors="replace") if path.is_file() else ""
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "flags:")
    return frozenset(line.split(":", 1)[1].split())


def unknown_extensions(flags: frozenset[str]) -> list[str]:
    """The CPU's int8 extensions whose MLAS branches this script has not read (sorted)."""
    return sorted(f for f in flags if INT8_EXTENSION.search(f) and f not in KNOWN_FLAGS)


def saturates(pythonpath: Path) -> bool:
    """In a fresh interpreter with ``pythonpath`` first: does MatMulInteger add in int16 pairs? (The
    tests' probe, ``tests/host.py``.)"""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    probe = "from tests.host import PAIRS_SATURATE; print(PAIRS_SATURATE)"
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True, capture_output=True, text=True, env=env)
    return run.stdout.strip() == "True"


def _refuse_cpu(flags: frozenset[str]) -> None:
    """Exit with UNKNOWN_CPU where this CPU has no AVX2 kernels to run (not x86-64, or no AVX2 + FMA3)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        print(f"not an x86-64 CPU ({platform.machine()}): MLAS has no AVX2 kernels here", file=sys.stderr)
        raise SystemExit(UNKNOWN_CPU)
    if not {"avx2", "fma"} <= flags:
        print(
            f"this CPU has no AVX2 + FMA3 (int8-related flags: {' '.join(sorted(f for f in flags if 'avx' in f or 'sse' in f)) or 'none'}): MLAS runs other kernels than an AVX2 CPU's",
            file=sys.stderr,
        )
        raise SystemExit(UNKNOWN_CPU)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where to write the copy (DIR/onnxruntime)")
    args = parser.parse_args()
    flags = cpu_flags()
    _refuse_cpu(flags)
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
    (target / MARKER).write_text(
        "MLAS's AVX-VNNI, AVX-512, AVX-VNNI-INT8 and AMX kernels disabled by bench/ort_without_vnni.py\n"
    )
    if not saturates(args.folder.resolve()):
        shutil.rmtree(target)
        unknown = unknown_extensions(flags)
        vnni = " ".join(sorted(f for f in flags if INT8_EXTENSION.search(f))) or "none"
        if unknown:
            print(f"{target}: patched, but MatMulInteger still adds in int32 on this CPU, whose int8 extensions "
                  f"{' '.join(unknown)} this script does not know (its flags: {vnni}); removed", file=sys.stderr)  # fmt: skip
            raise SystemExit(UNKNOWN_CPU)
        raise SystemExit(f"{target}: patched, but MatMulInteger still adds in int32 (this CPU's int8 extensions: "
                         f"{vnni}, all known to this script); removed")  # fmt: skip
    print(f"PYTHONPATH={args.folder.resolve()}")


if __name__ == "__main__":
    main()
