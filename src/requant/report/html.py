"""A report as one self-contained HTML page with plots (``--report-html``, ``requant report``).

The page needs no network to be viewed: styles inline, every chart an inline SVG drawn by
matplotlib (the ``html`` extra). Sections appear for what the report has: the summary; each int8
kernel's SQNR against float; the weights' SQNR as the type rounds them and as stored (the encoding);
each quantized activation's chosen range; the accuracy budget's tries; latency and size; lint; the
quantizers' decisions and rejections. The same report gives the same bytes.
"""

from __future__ import annotations

import html
import io
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from requant.errors import RequantError
from requant.report.blocks import blocks_tables
from requant.report.executorch import executorch_tables

__all__ = ["HtmlReportError", "compare_to_html", "to_html"]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ccc; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; } figcaption { font-size: 0.85em; color: #555; }
svg { max-width: 100%; height: auto; }
"""


class HtmlReportError(RequantError):
    """The page cannot be drawn (matplotlib missing, or a report without what a page needs)."""


@contextmanager
def _pyplot() -> Iterator[Any]:
    try:
        import matplotlib
    except ImportError:
        raise HtmlReportError(
            "the HTML report draws its charts with matplotlib: pip install 'requant[html]' (or matplotlib)"
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    # the same report gives the same bytes: fixed ids, text as text, no date
    with matplotlib.rc_context({"svg.hashsalt": "requant", "svg.fonttype": "none", "font.size": 9}):
        yield plt


def _svg(draw: Callable[[Any], None], height: float) -> str:
    with _pyplot() as plt:
        figure, axes = plt.subplots(figsize=(9, height))
        draw(axes)
        figure.tight_layout()
        buffer = io.StringIO()
        figure.savefig(buffer, format="svg", metadata={"Date": None})
        plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # inline: no XML prolog or doctype


def _bars(names: Sequence[str], values: Sequence[float], xlabel: str, threshold: float | None = None) -> str:
    """A horizontal bar per name (first at the top); bars below ``threshold`` in red."""

    def draw(axes: Any) -> None:
        positions = range(len(names))
        colours = ["#c0392b" if threshold is not None and v < threshold else "#2e86c1" for v in values]
        axes.barh(list(positions), list(values), color=colours)
        axes.set_yticks(list(positions), list(names))
        axes.invert_yaxis()
        axes.set_xlabel(xlabel)
        if threshold is not None:
            axes.axvline(threshold, color="#888", linestyle="--", linewidth=0.8)
        axes.grid(axis="x", alpha=0.3)

    return _svg(draw, max(1.6, 0.22 * len(names) + 0.8))


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f'<td class="num">{value:.4g}</td>'
        if isinstance(value, int) and not isinstance(value, bool):
            return f'<td class="num">{value}</td>'
        return f"<td>{html.escape(str(value))}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _figure(svg: str, caption: str) -> str:
    return f"<figure>{svg}<figcaption>{html.escape(caption)}</figcaption></figure>"


def _kernels(report: Mapping[str, Any]) -> list[str]:
    kernels = report.get("bias_correction", {}).get("kernels") or []
    if not kernels or not all("sqnr_db" in k for k in kernels):  # (the PT2E flow measures no kernel alone)
        return []
    names = [k["node"] for k in kernels]
    values = [float(k["sqnr_db"]) for k in kernels]
    worst = sorted(kernels, key=lambda k: k["sqnr_db"])[:10]
    return [
        "<h2>Kernels against float</h2>",
        _figure(
            _bars(names, values, "output SQNR against the float kernel (dB)", threshold=30.0),
            "Each int8 convolution and Gemm beside its float version on the same inputs (calibration samples); "
            "red: below 30 dB.",
        ),
        _table(
            ["kernel", "SQNR dB", "mean shift", "largest shift"],
            [[k["node"], k["sqnr_db"], k["mean_shift"], k["max_shift"]] for k in worst],
        ),
    ]


def _weights(report: Mapping[str, Any]) -> list[str]:
    encodings = report.get("weight_encoding", {}).get("kernels") or []
    if not encodings:
        return []

    def draw(axes: Any) -> None:
        positions = list(range(len(encodings)))
        axes.barh([p - 0.2 for p in positions], [e["sqnr_db"] for e in encodings], height=0.4,
                  label="as the type rounds them", color="#95a5a6")  # fmt: skip
        axes.barh([p + 0.2 for p in positions], [e["encoded_sqnr_db"] for e in encodings], height=0.4,
                  label="as stored (the encoding)", color="#2e86c1")  # fmt: skip
        axes.set_yticks(positions, [f"{e['node']} ({e['weight']})" for e in encodings])
        axes.invert_yaxis()
        axes.set_xlabel("weight SQNR (dB)")
        axes.legend(loc="lower right")
        axes.grid(axis="x", alpha=0.3)

    rows = [[e["node"], e["weight"], e["encoding"], e["margin"], e["rescaled"], e["why"]] for e in encodings]
    return [
        "<h2>Weights</h2>",
        _figure(
            _svg(draw, max(1.6, 0.3 * len(encodings) + 0.8)),
            f"The int8 weights of each kernel; exact on: {report['weight_encoding'].get('exact_on', '')}.",
        ),
        _table(["kernel", "weight", "encoding", "margin", "rescaled channels", "why"], rows),
    ]


def _clipped(seen: Mapping[str, Any], low: float, high: float) -> float:
    """The share of the observed values (by histogram bin centre) outside ``[low, high]``."""
    histogram = seen.get("histogram")
    if not histogram or not histogram["counts"]:
        return 0.0
    counts = histogram["counts"]
    width = (histogram["hi"] - histogram["lo"]) / len(counts)
    centres = [histogram["lo"] + (i + 0.5) * width for i in range(len(counts))]
    outside = sum(c for c, x in zip(counts, centres, strict=True) if x < low or x > high)
    return float(outside) / max(float(sum(counts)), 1.0)


def _ranges(report: Mapping[str, Any]) -> list[str]:
    from requant.types import UniformQuantizedType, parse_type

    found = []
    for entry in report.get("calibrated", []):
        if entry.get("kind") != "activation":
            continue
        try:
            t = parse_type(entry["type"])
        except RequantError:
            continue
        if isinstance(t, UniformQuantizedType):
            found.append((entry["value"], *t.float_range, entry.get("seen") or {}))
    if not found:
        return []

    def draw(axes: Any) -> None:
        positions = list(range(len(found)))
        axes.barh(positions, [h - lo for _, lo, h, _ in found], left=[lo for _, lo, _, _ in found],
                  color="#27ae60", label="the type's range")  # fmt: skip
        observed = [(p, seen["observed"]) for p, (_, _, _, seen) in zip(positions, found, strict=True) if seen]
        if observed:
            axes.hlines([p for p, _ in observed], [o[0] for _, o in observed], [o[1] for _, o in observed],
                        color="#222", linewidth=1.5, label="observed in calibration")  # fmt: skip
            axes.legend(loc="lower right")
        axes.set_yticks(positions, [name for name, *_ in found])
        axes.invert_yaxis()
        axes.axvline(0.0, color="#888", linewidth=0.8)
        axes.set_xlabel("value")
        axes.grid(axis="x", alpha=0.3)

    parts = [
        "<h2>Activation ranges</h2>",
        _figure(
            _svg(draw, max(1.6, 0.22 * len(found) + 0.8)),
            "Each quantized activation: the range its type holds (green) and the range calibration observed "
            "(black; histogram observers and minmax).",
        ),
    ]
    worst = sorted(
        (
            (_clipped(seen, low, high), name, low, high, seen)
            for name, low, high, seen in found
            if seen.get("histogram")
        ),
        key=lambda w: (-w[0], w[1]),
    )[:6]
    if worst:

        def histograms(axes: Any) -> None:
            axes.set_axis_off()
            figure = axes.figure
            for i, (share, name, low, high, seen) in enumerate(worst):
                ax = figure.add_subplot(2, 3, i + 1)
                h = seen["histogram"]
                width = (h["hi"] - h["lo"]) / len(h["counts"])
                ax.bar([h["lo"] + (j + 0.5) * width for j in range(len(h["counts"]))], h["counts"], width=width,
                       color="#7f8c8d", log=True)  # fmt: skip
                for bound in (low, high):
                    ax.axvline(bound, color="#c0392b", linewidth=1)
                ax.set_title(f"{name}: {100 * share:.3g}% clipped", fontsize=8)

        parts.append(
            _figure(
                _svg(histograms, 4.6),
                "The activations whose chosen range clips the largest share of the observed values: their "
                "histograms (log scale) and the type's range (red).",
            )
        )
    return parts


def _budget(report: Mapping[str, Any]) -> list[str]:
    budget = report.get("accuracy_budget")
    if not budget:
        return []
    tries = sorted(budget["tries"], key=lambda t: t["kept_float"])
    start = tries[0]  # nothing kept float: the first point of every family's line
    families = {_family(t) for t in tries[1:]} or {"ranked"}
    float_ms = (report.get("latency_ms_batch1") or {}).get("float")
    colors = {"ranked": ("#2e86c1", "#e67e22"), "first": ("#27ae60", "#8e44ad")}

    def line(family: str) -> list[Mapping[str, Any]]:
        return [start, *(t for t in tries[1:] if _family(t) == family)]

    def draw(axes: Any) -> None:
        cost = axes.twinx() if float_ms and all("latency_ms" in t for t in tries) else None  # what each try costs
        for family in sorted(families):
            points, (color, cost_color) = line(family), colors.get(family, ("#555555", "#999999"))
            axes.plot([t["kept_float"] for t in points], [t["drop"] for t in points], marker="o", color=color,
                      label=f"{budget['measures']}: {family}")  # fmt: skip
            if cost is not None:
                cost.plot([t["kept_float"] for t in points], [t["latency_ms"] / float_ms for t in points],
                          marker="s", linestyle=":", color=cost_color, label=f"latency / float: {family}")  # fmt: skip
        axes.axhline(budget["max_drop"], color="#c0392b", linestyle="--", linewidth=0.8, label="budget")
        axes.set_xlabel("kernels kept float")
        axes.set_ylabel(budget["measures"])
        axes.grid(alpha=0.3)
        handles = axes.get_legend_handles_labels()[0]
        if cost is not None:
            cost.set_ylabel("int8 latency / float latency")
            handles += cost.get_legend_handles_labels()[0]
        axes.legend(handles, [h.get_label() for h in handles], loc="upper right", fontsize="small")

    kept = [[k["node"], "" if k["effect_db"] is None else k["effect_db"], "" if k["sqnr_db"] is None else k["sqnr_db"]]
            for k in budget["kept_float"]]  # fmt: skip
    named = budget.get("families", {})
    chosen = f" ({named[budget['family']]})" if budget.get("family") in named else ""
    return [
        "<h2>Accuracy budget</h2>",
        _figure(
            _svg(draw, 2.6),
            f"Each try, by family: {', '.join(f'{k}: {v}' for k, v in named.items() if k in families)}; "
            f"{'met' if budget['met'] else 'NOT met'}: {budget['final_drop']:.4f}{chosen}.",
        ),
        _table(["kept float", "effect dB", "local SQNR dB"], kept),
        _table(
            ["kernels kept float", "family", budget["measures"], "modelled us added", "latency / float"],
            [_try_row(t, float_ms) for t in tries],
        ),
    ]


def _family(step: Mapping[str, Any]) -> str:
    """A budget try's family (reports written before there were two: "ranked")."""
    return str(step.get("family", "ranked"))


def _try_row(step: Mapping[str, Any], float_ms: float | None) -> list[Any]:
    family = _family(step) if step["kept_float"] else ""
    cost = step["latency_ms"] / float_ms if float_ms and "latency_ms" in step else ""
    return [step["kept_float"], family, step["drop"], step.get("modelled_us", ""), cost]


def _speed_and_size(report: Mapping[str, Any]) -> list[str]:
    latency, size = report.get("latency_ms_batch1"), report.get("size_bytes")
    parts = ["<h2>Latency and size</h2>"]
    if latency:
        names = ["float", "int8"]
        values = [latency["float"], latency["quantized"]]
        parts.append(_figure(_bars(names, values, "ms per run, batch 1"), "Measured interleaved in one process."))
    if size:
        parts.append(_table(["model", "bytes"], [["float", size["float"]], ["int8", size["quantized"]]]))
    return parts if len(parts) > 1 else []


def _section_tables(report: Mapping[str, Any]) -> list[str]:
    parts = []
    for title, header, rows in [*executorch_tables(report), *blocks_tables(report)]:
        parts += [f"<h2>{html.escape(title)}</h2>", _table(list(header), [list(r) for r in rows])]
    return parts


def _lint(report: Mapping[str, Any]) -> list[str]:
    lint = report.get("lint")
    if not lint:
        return []
    rows = [["int8 kernels", ", ".join(f"{k} x{v}" for k, v in sorted(lint.get("int8_kernels", {}).items()))]]
    for key, label in (
        ("float_between_dequantize_and_quantize", "stayed float between conversions"),
        ("asked_to_be_quantized_but_float", "asked to be quantized, runs in float"),
        ("kept_float_by_decision", "kept float by decision"),
        ("leftover_quantize_dequantize_pairs", "conversions with nothing fused"),
    ):
        if lint.get(key):
            rows.append([label, "; ".join(map(str, lint[key]))])
    saturating = lint.get("saturation", {}).get("can_saturate") or []
    rows.append(["can saturate without VNNI", ", ".join(f["node"] for f in saturating) or "none"])
    return ["<h2>What ONNX Runtime runs (lint)</h2>", _table(["", ""], rows)]


def _equalization(report: Mapping[str, Any]) -> list[str]:
    chains = (report.get("equalization") or {}).get("chains", [])
    if not chains:
        return []
    rows = [
        [r["depthwise"], r["conv"] + (f" -> {r['activation']}" if r["activation"] else ""),
         f"{r['scaled']} of {r['channels']} channels, up to {r['largest_factor']:.2f}x" if not r["skipped"]
         else f"not equalized: {r['skipped']}",
         float(r["spread_before"]) if r["channels"] else "", float(r["spread_after"]) if r["channels"] else ""]
        for r in chains
    ]  # fmt: skip
    caption = (
        "Depthwise convolutions' input channels scaled up against the convolution before them: spread is the "
        "largest channel maximum over the median one"
    )
    return ["<h2>Equalization</h2>", f"<p>{html.escape(caption)}</p>",
            _table(["depthwise conv", "after", "done", "spread before", "spread after"], rows)]  # fmt: skip


def _smoothing(report: Mapping[str, Any]) -> list[str]:
    section = report.get("smoothing") or {}
    inputs = section.get("inputs", [])
    if not section.get("alpha") or not inputs:
        return []
    rows = [
        [r["input"], ", ".join(r["linears"]), r["applied"] or f"not smoothed: {r['skipped']}",
         float(r["spread_before"]) if r["channels"] else "", float(r["spread_after"]) if r["channels"] else ""]
        for r in inputs
    ]  # fmt: skip
    caption = (
        f"Linear-layer inputs evened out against their weights (alpha {section['alpha']:g}): spread is the "
        "largest channel range over the median one"
    )
    return ["<h2>Smoothing</h2>", f"<p>{html.escape(caption)}</p>",
            _table(["input", "linear layers", "done", "spread before", "spread after"], rows)]  # fmt: skip


def _decisions(report: Mapping[str, Any]) -> list[str]:
    quantizers = report.get("quantizers", {})
    rows = []
    for record in quantizers.get("quantizers", []):
        for d in record.get("decisions", []):
            rows.append([", ".join(d["nodes"]), d["pattern"], d["status"], d.get("reason", "")])
    decomposed = [[d["node"], d["into"], d.get("why", "")] for d in quantizers.get("decomposed", [])]
    placements = quantizers.get("placements", [])
    placed = [
        [", ".join(p["nodes"]), ", ".join(p["ops"]), p["placed"], p.get("by", "cost"), f"{p['int8_us']}",
         f"{p['float_us']}", p["why"]]
        for p in placements
    ]  # fmt: skip
    groups = [p for p in placements if p.get("by", "cost") == "cost"]
    parts = ["<h2>Decisions</h2>"]
    if decomposed:
        parts.append(_table(["node", "rewritten into", "why"], decomposed))
    if placed:
        by_table = len(placements) - len(groups)
        counted = f"{len(groups)} group{'' if len(groups) == 1 else 's'}"
        parts.append(f"<details><summary>{counted} of int8 ops between kernels, placed by modelled "
                     f"cost ({sum(1 for p in groups if p['placed'] == 'float')} kept float)"
                     + (f"; {by_table} ops the target's table keeps float, priced" if by_table else "")
                     + "</summary>")  # fmt: skip
        parts.append(_table(["nodes", "ops", "placed", "by", "int8 us", "float us", "why"], placed) + "</details>")
    if rows:
        rejected = sum(1 for r in rows if r[2] != "accepted")
        parts.append(f"<details><summary>{len(rows)} decisions ({rejected} not accepted)</summary>")
        parts.append(_table(["nodes", "pattern", "status", "reason"], rows) + "</details>")
    return parts if len(parts) > 1 else []


def to_html(report: Mapping[str, Any], title: str = "requant report") -> str:
    """The page for ``report`` (``requant.quantize``'s, or its JSON read back)."""
    if not isinstance(report, Mapping) or "summary" not in report:
        raise HtmlReportError("not a requant report: it has no 'summary' (write one with --report-json)")
    body = [f"<h1>{html.escape(title)}</h1>", f"<pre>{html.escape(str(report['summary']))}</pre>"]
    for name, part in report.get("parts", {}).items():  # a model of parts: each part's sections under its name
        body += [f"<h1>{html.escape(name)}</h1>", *_body(part)]
    if "parts" not in report:
        body += _body(report)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _body(report: Mapping[str, Any]) -> list[str]:
    body: list[str] = []
    for section in (
        _kernels,
        _tensors,
        _weights,
        _ranges,
        _smoothing,
        _equalization,
        _budget,
        _speed_and_size,
        _section_tables,
        _lint,
        _decisions,
    ):
        body += section(report)
    return body


def _tensor_chart(tensors: Sequence[Mapping[str, Any]]) -> tuple[str, list[Mapping[str, Any]]]:
    """Each tensor's SQNR against float in graph order (SVG), and the five where the error grows most."""
    ordered = sorted(tensors, key=lambda t: t["position"])
    finite = [t for t in ordered if math.isfinite(t["sqnr_db"])]
    grew = sorted((t for t in finite if t["own_loss_db"] > 0), key=lambda t: -t["own_loss_db"])[:5]

    def draw(axes: Any) -> None:
        axes.plot([t["position"] for t in finite], [t["sqnr_db"] for t in finite], marker=".", color="#2e86c1")
        for t in grew:
            axes.annotate(t["name"][:28], (t["position"], t["sqnr_db"]), color="#c0392b", fontsize=7,
                          xytext=(4, -10), textcoords="offset points")  # fmt: skip
            axes.plot([t["position"]], [t["sqnr_db"]], marker="o", color="#c0392b")
        axes.set_xlabel("tensor, in graph order")
        axes.set_ylabel("SQNR against float (dB)")
        axes.grid(alpha=0.3)

    return _svg(draw, 3.2), grew


_TENSOR_CAPTION = (
    "each quantized tensor's SQNR against the float model's tensor of that name, in graph order; red: where "
    "the error grows most (the tensor's SQNR below its worst input's)"
)


def _tensors(report: Mapping[str, Any]) -> list[str]:
    tensors = report.get("tensors")
    if not tensors:
        return []
    svg, grew = _tensor_chart(tensors)
    where = f": the error grows most at {grew[0]['name']!r}" if grew else ""
    text = f"{len(tensors)} tensors on the first evaluation samples{html.escape(where)}"
    return [
        "<h2>Tensor by tensor</h2>",
        f"<p>{text} (<code>requant compare</code> for the whole table)</p>",
        _figure(svg, _TENSOR_CAPTION),
    ]


def compare_to_html(tensors: Sequence[Mapping[str, Any]], title: str = "requant compare") -> str:
    """The page for ``requant compare``'s tensors (``TensorComparison.to_json()``): each tensor's SQNR
    against float in graph order, the tensors where the error grows most marked, and the worst
    tensors as a table."""
    if not tensors:
        raise HtmlReportError("no tensors to show: the comparison found none")
    svg, grew = _tensor_chart(tensors)
    worst = sorted(tensors, key=lambda t: (t["sqnr_db"], t["name"]))[:30]
    rows = [[t["name"], t["sqnr_db"], t["cosine"], t["max_error"], t["own_loss_db"], t["quantized_as"]] for t in worst]
    summary = f"{len(tensors)} tensors compared; worst {worst[0]['name']!r} at {worst[0]['sqnr_db']:.1f} dB"
    if grew:
        summary += f"; the error grows most at {grew[0]['name']!r} ({grew[0]['own_loss_db']:.1f} dB below its inputs)"
    body = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{html.escape(summary)}</p>",
        _figure(svg, _TENSOR_CAPTION),
        "<h2>Worst tensors</h2>",
        _table(["tensor", "SQNR dB", "cosine", "max error", "own loss dB", "quantized as"], rows),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
