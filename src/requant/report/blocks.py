"""A language model's report section (``llm``, :mod:`requant.stages.blocks`) as tables (title, header, rows),
which the Markdown and HTML pages both draw: the format, calibration, size and perplexities, then each
linear layer's rounding and the output SQNR of every rounding tried."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from requant.report.executorch import Table

__all__ = ["blocks_tables"]


def _figures(report: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    llm, checked = report["llm"], report["outputs"]
    fmt, size = llm["format"], llm["size"]
    kind = "symmetric" if fmt["symmetric"] else "asymmetric (a zero point per block)"
    rows: list[tuple[Any, ...]] = [
        ("weights", f"{fmt['bits']}-bit {kind} blocks of {fmt['block_size']} along the input axis: {fmt['type']}"),
        ("calibration", f"{llm['calibration']['windows']} windows of {llm['calibration']['window']} tokens"),
        ("size", f"{size['float_bytes'] / 1e6:.1f} MB -> {size['quantized_bytes'] / 1e6:.1f} MB"),
        ("perplexity, calibration text" + (" (held out)" if checked["held_out"] else ""),
         f"{checked['float_perplexity']:.3f} -> {checked['perplexity']:.3f} ({checked['windows']} windows)"),
    ]  # fmt: skip
    if llm.get("exported"):
        rows.insert(0, ("model", llm["exported"]))
    for layer in llm["layers"]:
        for gather, how in layer.get("tied", {}).items():
            rows.append(("tied embedding", f"{gather}: a GatherBlockQuantized that {how}"))
    evaluation = llm.get("evaluation")
    if evaluation:
        before, after = evaluation["float_perplexity"], evaluation["perplexity"]
        rows.append(("perplexity, --eval text", f"{before:.3f} -> {after:.3f} ({evaluation['windows']} windows, "
                     f"{evaluation['tokens']} tokens)"))  # fmt: skip
    for step, t in llm.get("latency", {}).items():
        rows.append((f"latency, {step}", f"{t['float_ms']:.2f} ms -> {t['quantized_ms']:.2f} ms ({t['ratio']:.2f}x)"))
    return rows


def blocks_tables(report: Mapping[str, Any]) -> list[Table]:
    """The section's tables; none for another flow's report."""
    if not report.get("llm"):
        return []
    layers: list[tuple[Any, ...]] = []
    for r in report["llm"]["layers"]:
        if "rounding" not in r:
            layers.append((r["node"], r["k"], r["n"], "float", r["float"]))
            continue
        sqnr = r["rounding"].get("output_sqnr_db", {})
        tried = ", ".join(f"{m} {db:.1f}" for m, db in sqnr.items()) or r["rounding"].get("why", "")
        layers.append((r["node"], r["k"], r["n"], r["rounding"]["chosen"], tried))
    return [("Language model", ("figure", "value"), _figures(report)),
            ("Linear layers", ("node", "K", "N", "rounding", "output SQNR of each tried (dB)"), layers)]  # fmt: skip
