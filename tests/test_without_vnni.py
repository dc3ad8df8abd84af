"""The tests whose outcome depends on the CPU, run again as on a CPU without VNNI.

On a CPU with VNNI or AMX, ONNX Runtime's uint8 x int8 kernels add exactly, so the tests that check
requant's model of int16 pair saturation against ONNX Runtime (``tests/host.py``) would only ever
check the exact side there. This runs them once more in a child pytest under
``bench/ort_without_vnni.py``'s copy of ONNX Runtime, whose CPU dispatch takes the AVX2 kernels:
every CI machine then checks both kernel models against ONNX Runtime's own kernels. On a CPU without
VNNI the suite itself already runs them that way (skipped here). Where the CPU has int8 extensions
the script does not know and its copy does not saturate, or no AVX2 at all, the script says so
(exit ``UNKNOWN_CPU``) and the test skips with its words: the verdict never depends on the CPU.

The copy's AMX branch is checked on any CPU under gdb: MLAS's dispatch is made to see AMX
(``tests/amx_under_gdb.py``); the installed ONNX Runtime then takes the AMX QGEMM, the copy does not."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest
from bench.ort_without_vnni import UNKNOWN_CPU, chains, cpu_flags, patch, unknown_extensions

from tests.host import MASKED, PAIRS_SATURATE

ROOT = Path(__file__).parent.parent
DEPENDS_ON_THE_CPU = [
    "tests/test_kernel_model.py",
    "tests/test_budget.py::test_a_budget_keeps_the_fewest_worst_kernels_float",
    "tests/test_compare.py::test_it_sees_what_the_int8_kernels_compute_saturation_included",
    "tests/test_lstm.py::test_lstm_weights_are_encoded_so_no_pair_saturates_without_vnni",
    "tests/test_quantize.py::test_lint_finds_the_kernels_that_can_saturate_and_their_worst_error",
]
# what the program under gdb answers, in a file of its own (gdb writes to the same standard output)
PROBE = "import os, tests.host as h; open(os.environ['ANSWER'], 'w').write(f'pairs saturate: {h.PAIRS_SATURATE}')"


def _copy(folder: Path) -> None:
    """bench/ort_without_vnni.py's copy in ``folder``; a skip naming the CPU where the script cannot make one."""
    made = subprocess.run([sys.executable, str(ROOT / "bench" / "ort_without_vnni.py"), str(folder)],
                          capture_output=True, text=True)  # fmt: skip
    if made.returncode == UNKNOWN_CPU:
        pytest.skip(made.stderr.strip())
    assert made.returncode == 0, made.stderr


@pytest.mark.skipif(PAIRS_SATURATE or MASKED, reason="this ONNX Runtime already runs the kernels without VNNI")
def test_the_cpu_dependent_tests_pass_with_the_kernels_of_a_cpu_without_vnni(tmp_path: Path) -> None:
    _copy(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *DEPENDS_ON_THE_CPU],
                         cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
    # under the copy, the VNNI-only skip is gone and the saturating budget test runs
    assert "saturate only on CPUs without VNNI" not in run.stdout
    assert " passed" in run.stdout.splitlines()[-1]


def _amx_sites(module: Path) -> str:
    """For tests/amx_under_gdb.py: per copy of the constructor, the offsets of its AMX test's ``not`` of
    leaf 7's EDX, the ``not`` of XCR0 after it, the return of the first ``arch_prctl`` and the AMX
    dispatch's assignment (after the permission's last ``je``)."""
    data = module.read_bytes()
    lines = []
    for chain in chains(data):
        amx = chain["AMX"]
        after = data[amx.end() : amx.end() + 0x80]
        xcr0 = re.search(rb"[\x48\x49]\xf7[\xd0-\xd7]", after)
        prctl = re.search(rb"\xe8....(?=\x48\x85\xc0)", after, re.DOTALL)
        assign = re.search(rb"\x0f\x84....(?=\x48\x8d\x05)", after, re.DOTALL)
        assert xcr0 and prctl and assign, (
            f"the AMX block at {amx.start():#x} is not the one tests/amx_under_gdb.py knows"
        )
        offsets = (amx.start(), amx.end() + xcr0.start(), amx.end() + prctl.end(), amx.end() + assign.end())
        lines.append(" ".join(f"{offset:#x}" for offset in offsets))
    return "\n".join(lines)


def _under_gdb(pythonpath: str, sites: str, answer: Path) -> str:
    """What gdb says (tests/amx_under_gdb.py's lines), then the probe's answer when it gave one."""
    env = {**os.environ, "PYTHONPATH": pythonpath, "REQUANT_AMX_SITES": sites, "ANSWER": str(answer)}
    run = subprocess.run(["gdb", "-q", "-batch", "-nx", "-iex", "set auto-load python-scripts off", "-x", str(ROOT / "tests" / "amx_under_gdb.py"),
                          "--args", sys.executable, "-c", PROBE],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    return run.stdout + "\n" + (answer.read_text() if answer.is_file() else "no answer")


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed (Debian's gdb)")
@pytest.mark.skipif(MASKED, reason="this ONNX Runtime is already bench/ort_without_vnni.py's copy")
def test_the_copy_keeps_the_avx2_kernels_where_mlas_would_take_amx(tmp_path: Path) -> None:
    """On any CPU: with AMX-TILE, AMX-INT8, the tile state and Linux's permission made visible to MLAS,
    the installed ONNX Runtime takes the AMX QGEMM (a tile instruction: SIGILL on a CPU without AMX, exact
    sums on one with it), and the copy still adds in int16 pairs."""
    _copy(tmp_path)
    module = next((Path(ort.__file__).parent / "capi").glob("onnxruntime_pybind11_state*.so"))
    sites = _amx_sites(module)
    installed = _under_gdb(os.environ.get("PYTHONPATH", ""), sites, tmp_path / "installed.txt")
    assert "amx test reached" in installed, installed[-2000:]
    assert "pairs saturate: True" not in installed, installed[-2000:]
    assert re.search(r"SIGNAL 4 at .*tile|pairs saturate: False", installed), installed[-2000:]
    copied = _under_gdb(str(tmp_path), sites, tmp_path / "copied.txt")
    assert "amx test reached" in copied, copied[-2000:]
    assert "pairs saturate: True" in copied, copied[-2000:]


def test_the_patch_follows_the_chain_of_tests_and_refuses_other_bytes() -> None:
    """Each test is looked for where the one before jumps; bytes the script does not know there are an
    error naming the test, not a guess. The installed module: four copies, four tests patched in each."""
    avx_vnni = b"\xb8\x07\x00\x00\x00\xb9\x01\x00\x00\x00\x0f\xa2\xa8\x10\x74\x02" + b"\x90\x90"
    avx512f = b"\x41\xf7\xc2\x00\x00\x01\x00\x74\x00"
    vnni_int8, ne_convert = b"\xf6\xc2\x10\x74\x00", b"\x83\xe2\x20\x74\x00"
    amx = b"\x41\xf7\xd1\x41\x81\xe1\x00\x00\x00\x03\x0f\x85\x10\x00\x00\x00"
    module = b"\xcc" * 8 + avx_vnni + avx512f + vnni_int8 + ne_convert + amx + b"\xcc" * 8
    patched, copies = patch(module)
    assert copies == 1 and len(patched) == len(module)
    changed = [i for i, (a, b) in enumerate(zip(module, patched, strict=True)) if a != b]
    starts = [8 + len(avx_vnni) - 4, 8 + len(avx_vnni) + len(avx512f) - 2]  # the two je rel8 (74 -> eb)
    starts += [starts[1] + 2 + len(vnni_int8) - 2]
    jne = len(module) - 8 - 6  # 0f 85 -> 90 e9
    assert changed == [*starts, jne, jne + 1], changed
    assert patched[jne : jne + 6] == b"\x90\xe9\x10\x00\x00\x00"  # the same displacement: the same target
    with pytest.raises(SystemExit, match="not the AMX test this script knows"):
        patch(module.replace(amx, b"\x90" * len(amx)))
    installed = next((Path(ort.__file__).parent / "capi").glob("onnxruntime_pybind11_state*.so")).read_bytes()
    if not MASKED:
        ours, copies = patch(installed)
        assert copies == 4 and sum(a != b for a, b in zip(installed, ours, strict=True)) == 4 * 5


def test_a_cpu_with_int8_extensions_the_script_does_not_know_is_named() -> None:
    sapphire_rapids = cpu_flags("processor\t: 0\nflags\t\t: avx2 fma avx512_vnni avx_vnni amx_bf16 amx_tile amx_int8\n")
    assert {"amx_tile", "avx2"} <= sapphire_rapids and unknown_extensions(sapphire_rapids) == []
    assert unknown_extensions(cpu_flags("flags\t: avx2 fma avx10_2 amx_fp8 avx512_vnni\n")) == ["amx_fp8", "avx10_2"]
    assert cpu_flags("") == frozenset()
