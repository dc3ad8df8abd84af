"""``requant``: one sub-command per tool. Errors print one message and exit 1.

Stopped (Ctrl-C, or SIGTERM: ``timeout``, a job cancelled) it unwinds as an error does: its temporary files
(each calibration session's copy of the model: a YOLO's 100 MB) are removed, no output is left half written, and
it says so in one line, exiting 130 (Ctrl-C) or 143 (SIGTERM) instead of printing a traceback."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from requant.cli import compare_cmd, lint_cmd, opt_cmd, quantize_cmd, report_cmd, type_cmd
from requant.errors import RequantError

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="requant", description="requant: a post-training quantization compiler.")
    parser.add_argument("--verbose", action="store_true", help="after an error, the full text of what caused it "
                        "(torch's export report, ...), where requant's one line summarizes it")  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    type_cmd.register(commands)
    opt_cmd.register(commands)
    quantize_cmd.register(commands)
    lint_cmd.register(commands)
    compare_cmd.register(commands)
    report_cmd.register(commands)
    return parser


class Stopped(BaseException):
    """A SIGTERM, raised where the command is so that it unwinds (``finally`` blocks, temporary folders)."""


def _terminated(signum: int, frame: Any) -> None:
    raise Stopped


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        result: int = args.run(args)
    except (KeyboardInterrupt, Stopped) as stop:
        how = "interrupted" if isinstance(stop, KeyboardInterrupt) else "terminated"
        print(f"requant {args.command}: {how}: temporary files removed, nothing half written", file=sys.stderr)
        return 130 if isinstance(stop, KeyboardInterrupt) else 143
    except RequantError as exc:
        print(f"requant {args.command}: error: {exc}", file=sys.stderr)
        if exc.detail and args.verbose:
            print(f"\n{exc.detail}", file=sys.stderr)
        elif exc.detail:
            print("(requant --verbose ... prints the full text)", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
