"""Run under gdb (``gdb -batch -x tests/amx_under_gdb.py --args PYTHON -c PROBE``, by
``tests/test_without_vnni.py``): MLAS's CPU dispatch is made to see AMX on a CPU that may not have it.

At each copy of ``MLAS_PLATFORM``'s AMX test (the offsets in ``REQUANT_AMX_SITES``: the ``not`` of leaf
7's EDX, the ``not`` of XCR0, the return of the first ``arch_prctl``, the AMX dispatch's assignment,
four hex numbers a line), the register under test gets AMX-TILE and AMX-INT8 (bits 24, 25), XCR0 the
tile state (bits 17, 18), and the permission request is answered by jumping to the assignment, as if
Linux had granted it. The installed ONNX Runtime then takes MLAS's AMX QGEMM (on a CPU without AMX,
its first tile instruction raises SIGILL); ``bench/ort_without_vnni.py``'s copy must jump past the test
whatever its registers hold. Prints ``amx test reached`` each time a test is reached, ``SIGNAL name``
when the program stops on a signal. This file runs in gdb's own Python: the standard library only.
"""

import os
import re

import gdb  # type: ignore[import-not-found]

MODULE = "onnxruntime_pybind11_state"


def _base() -> int:
    """Where the module is mapped (its first mapping, file offset 0)."""
    for line in gdb.execute("info proc mappings", to_string=True).splitlines():
        fields = line.split()
        if fields and fields[-1].endswith(".so") and MODULE in fields[-1] and int(fields[3], 16) == 0:
            return int(fields[0], 16)
    raise RuntimeError(f"{MODULE} is not mapped")


def main() -> None:
    sites = [[int(x, 16) for x in line.split()] for line in os.environ["REQUANT_AMX_SITES"].strip().splitlines()]
    for setting in ("pagination off", "confirm off", "print thread-events off", "print inferior-events off"):
        gdb.execute(f"set {setting}")
    gdb.execute(f"catch load {MODULE}")
    gdb.execute("run")
    base = _base()
    gdb.execute("delete")
    roles: dict[int, tuple[str, int]] = {}
    for cpuid, xcr0, prctl, assign in sites:
        roles[base + cpuid] = ("cpuid", 0x3000000)
        roles[base + xcr0] = ("xcr0", 0x60000)
        roles[base + prctl] = ("prctl", base + assign)
    for at in roles:
        gdb.Breakpoint(f"*{at:#x}", internal=True)
    while gdb.selected_inferior().pid:
        gdb.execute("continue")
        if not gdb.selected_inferior().pid:
            break
        pc = int(gdb.parse_and_eval("$pc"))
        if pc not in roles:
            print(
                f"SIGNAL {gdb.parse_and_eval('$_siginfo.si_signo')} at {gdb.execute('x/i $pc', to_string=True).strip()}",
                flush=True,
            )
            gdb.execute("kill")
            break
        role, value = roles[pc]
        if role == "prctl":
            gdb.execute(f"set $pc = {value:#x}")
            continue
        if role == "cpuid":
            print("amx test reached", flush=True)
        register = re.search(r"not\s+%(\w+)", gdb.execute("x/i $pc", to_string=True)).group(1)
        gdb.execute(f"set ${register} = ${register} | {value:#x}")


main()
