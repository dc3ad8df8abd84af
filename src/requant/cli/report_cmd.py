"""``requant report REPORT.json -o PAGE.html``: a saved report as one self-contained HTML page with plots.

The report is the JSON ``requant quantize --report-json`` writes (or ``requant.quantize(...).report``
saved with ``json.dump``). The page needs no network to be viewed: its charts are inline SVG drawn
by matplotlib (``pip install 'requant[html]'``). Nothing is written when the report cannot be read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from requant.cli.parser import documented, write_all
from requant.errors import RequantError

__all__ = ["register"]


def register(commands: Any) -> None:
    sub = documented(commands, "report", "turn a saved report (JSON) into one HTML page with plots", __doc__)
    sub.add_argument("input", metavar="REPORT", help="a report written by requant quantize --report-json")
    sub.add_argument("-o", "--output", metavar="PAGE", required=True, help="where to write the HTML page")
    sub.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from requant.frontends import check_outputs
    from requant.report.html import to_html

    check_outputs({"-o": args.output}, {"the report": args.input})
    source = Path(args.input)
    try:
        report = json.loads(source.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RequantError(f"cannot read the report {source}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequantError(f"{source} is not a JSON report ({exc})") from None
    write_all({args.output: to_html(report, title=f"requant report: {source.stem}")})
    print(f"wrote {args.output}")
    return 0
