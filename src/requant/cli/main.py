"""``requant``: one sub-command per tool. Errors print one message and exit 1."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.run(args)
    except RequantError as exc:
        print(f"requant {args.command}: error: {exc}", file=sys.stderr)
        if exc.detail and args.verbose:
            print(f"\n{exc.detail}", file=sys.stderr)
        elif exc.detail:
            print("(requant --verbose ... prints the full text)", file=sys.stderr)
        return 1
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
