"""The report as a Markdown page: the summary, what ONNX Runtime fused, every quantizer decision and every port's type.

It is rendered from the JSON report (``QuantizedModel.report``), so a saved ``--report-json``
file renders to the same page.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from requant.report.blocks import blocks_tables
from requant.report.executorch import executorch_tables
from requant.report.saturation import SaturationFinding

__all__ = ["encoding_summary", "method_summary", "to_markdown"]


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _us(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return [*lines, ""]


def _summary(report: Mapping[str, Any]) -> list[str]:
    rows: list[tuple[str, str]] = [("target", report["target"])]
    if report.get("quantizers", {}).get("preset_choice"):
        rows.append(("preset", report["quantizers"]["preset_choice"]))
    if report.get("model_source"):
        rows.append(("model", report["model_source"]))
    if report.get("example_inputs"):
        rows.append(("example inputs", report["example_inputs"]))
    if report.get("method_choice"):
        rows.append(("calibration method", method_summary(report["method_choice"])))
    if report.get("weight_encoding", {}).get("kernels"):
        rows.append(("int8 weights", encoding_summary(report["weight_encoding"])))
    size = report.get("size_bytes")
    if size:
        ratio = size["quantized"] / size["float"]
        rows.append(("size", f"{size['float'] / 1024:.1f} KiB -> {size['quantized'] / 1024:.1f} KiB ({ratio:.2f}x)"))
    latency = report.get("latency_ms_batch1")
    if latency:
        ratio = latency["quantized"] / latency["float"]
        rows.append(("latency, batch 1", f"{latency['float']:.3f} ms -> {latency['quantized']:.3f} ms ({ratio:.2f}x)"))
    ev = report.get("evaluation")
    if ev:
        if "float_accuracy" in ev:
            rows.append(("accuracy (float / int8)", f"{ev['float_accuracy']:.4f} / {ev['int8_accuracy']:.4f}"))
        if ev.get("class_scores", 1.0):  # a map (a text detector's) or a value has no top-1
            rows.append(("top-1 agreement with float", f"{ev['top1_agreement']:.4f} ({int(ev['samples'])} samples)"))
        rows.append(("cosine similarity", f"{ev['cosine_similarity']:.5f}"))
        rows.append(("SQNR", f"{ev['sqnr_db']:.1f} dB"))
    rows.append(("quantized in", f"{report['quantize_seconds']:.1f} s"))
    return _table(("figure", "value"), rows)


def method_summary(choice: Mapping[str, Any]) -> str:
    """What ``method="auto"`` chose and why, in one line (the report's ``method_choice``)."""
    if choice.get("why"):
        stem = choice.get("stem_float") or []
        more = ", ..." if len(stem) > 2 else ""
        kept = f"; its stem float: {len(stem)} ops, {', '.join(stem[:2])}{more}" if stem else ""
        head = choice.get("head_float") or []
        kept += f"; its head float after its last kernels: {len(head)} ops" if head else ""
        return f"auto -> {choice['chosen']} ({choice['why']}{kept})"
    scores = ", ".join(f"{m} {s:.1f} dB" for m, s in choice["output_sqnr_db"].items())
    which = "held-out calibration samples" if choice.get("held_out") else "calibration samples"
    corrected = f", biases corrected on {choice['sketch_samples']}" if choice.get("biases_corrected") else ""
    on = f"{choice['samples']} {which}{corrected}"
    line = f"auto -> {choice['chosen']} (the output's SQNR against float on {on}: {scores})"
    if choice.get("bias_correction_kept") is False:
        before = choice["uncorrected_sqnr_db"][choice["chosen"]]
        line += (
            f"; bias correction not applied: it moved the output further from float on those samples "
            f"({before:.1f} -> {choice['corrected_sqnr_db']:.1f} dB)"
        )
    return line


def encoding_summary(section: Mapping[str, Any]) -> str:
    """One line: how the int8 kernels' weights are stored, and on which CPUs that is exact."""
    kernels = section["kernels"]
    paired = [e for e in kernels if e["accumulation"] == "int16 pairs"]
    unsafe = [e for e in paired if e["margin"] < 0]
    if not paired:
        return f"full range, exact on {section['exact_on']} ({len(kernels)} kernels add in int32)"
    encoded = [e for e in paired if e["encoding"] == "pair-safe"]
    # the encoding's cost in weight SQNR, where the integers are its own (error feedback moves more, on purpose)
    costs = [e["sqnr_db"] - e["encoded_sqnr_db"] for e in encoded if e.get("rounding", "nearest") == "nearest"]
    text = "exact on every x86-64 CPU" if not unsafe else f"{len(unsafe)} kernels can saturate on {section['exact_on']}"
    text += f": of {len(paired)} kernels with int16 pair sums, {len(paired) - len(encoded) - len(unsafe)} proven at "
    text += f"full range, {len(encoded)} re-encoded so no pair can saturate"
    text += f" (at most {max(costs):.1f} dB of weight SQNR)" if costs else ""
    return text + _rounding_summary(kernels)


def _rounding_summary(kernels: list[Mapping[str, Any]]) -> str:
    """How many kernels' integers error feedback chose, and what it gained on their outputs."""
    fed = [e for e in kernels if e.get("rounding") == "error feedback"]
    if not fed:
        return ""
    gains = sorted(e["output_sqnr_db"] - e["nearest_output_sqnr_db"] for e in fed)
    return (f"; {len(fed)} rounded by error feedback against their calibration inputs (their outputs "
            f"{gains[len(gains) // 2]:+.1f} dB SQNR, median)")  # fmt: skip


def _lint(lint: Mapping[str, Any]) -> list[str]:
    kernels = lint["int8_kernels"]
    lines = ["## What ONNX Runtime ran", ""]
    lines.append(f"int8 kernels in ONNX Runtime's optimized graph: {sum(kernels.values())}.")
    lines.append("")
    if kernels:
        lines += _table(("kernel", "count"), sorted(kernels.items()))
    for key, title in (
        ("float_between_dequantize_and_quantize", "Ops that stayed float between DequantizeLinear and QuantizeLinear"),
        ("leftover_quantize_dequantize_pairs", "QuantizeLinear -> DequantizeLinear pairs with nothing fused"),
        ("dequantized_constants", "Constants dequantized at run time"),
        ("asked_to_be_quantized_but_float", "Nodes asked to be quantized that ONNX Runtime runs in float"),
        ("kept_float_by_decision", "Ops kept float between DequantizeLinear and QuantizeLinear by a target rule"),
    ):
        items = lint.get(key) or []
        lines.append(f"{title}: {len(items)}.")
        lines.append("")
        lines += [f"- {item}" for item in items]
        if items:
            lines.append("")
    saturation = lint.get("saturation")
    if saturation:
        findings = saturation["can_saturate"]
        lines.append(
            f"uint8 x int8 kernels that can saturate on {saturation['cpus']}: {len(findings)} of "
            f"{saturation['kernels_checked']}."
        )
        lines.append("")
        lines += [f"- {SaturationFinding(**f).text()}" for f in findings]
        if findings:
            lines.append("")
    return lines


def _quantizers(quantizers: Mapping[str, Any]) -> list[str]:
    lines = ["## Quantizers", "", "Applied in this order; a node annotated by one is not annotated again.", ""]
    rows = [
        (
            q["quantizer"],
            q["finder"],
            q["config"],
            q["selected_nodes"],
            q["accepted"],
            q["rejected"],
            q["rejected_already_annotated"],
        )
        for q in quantizers["quantizers"]
    ]
    lines += _table(("quantizer", "finder", "config", "selected", "accepted", "rejected", "already annotated"), rows)
    decomposed = quantizers.get("decomposed", [])
    kept = quantizers.get("not_decomposed", [])
    if decomposed or kept:
        lines += ["### Decomposed before annotating", ""]
        lines += [f"- {d['node']} -> {d['into']}: {d['why']}" for d in decomposed]
        lines += [f"- {d['node']} kept: {d['reason']}" for d in kept]
        lines.append("")
    placements = quantizers.get("placements", [])
    if placements:
        # the groups kept float, and those that would be cheaper float but cannot be; the rest counted
        shown = [p for p in placements if p["placed"] != "int8" or (p["float_us"] or 0) < (p["int8_us"] or 0)]
        lines += ["### Where int8 ends (modelled cost)", ""]
        if shown:
            lines += _table(("ops", "placed", "int8 us", "float us", "why"), [
                (", ".join(p["ops"]), p["placed"], _us(p["int8_us"]), _us(p["float_us"]), p["why"].split(" (")[0])
                for p in shown
            ])  # fmt: skip
        if len(shown) < len(placements):
            left = len(placements) - len(shown)
            said = (f"{left} groups of int8 ops between kernels stay" if left != 1
                    else "1 group of int8 ops between kernels stays")  # fmt: skip
            lines += [f"{said} int8: cheaper than "
                      "float with their conversions.", ""]  # fmt: skip
    for warning in quantizers.get("warnings", []):
        lines += [f"> **Warning:** {warning}", ""]
    rejected = [
        (", ".join(d["nodes"]), d["pattern"], q["quantizer"], d["reason"])
        for q in quantizers["quantizers"]
        for d in q["decisions"]
        if d["status"] == "rejected"
    ]
    lines += ["### Rejected patterns", ""]
    lines += _table(("nodes", "pattern", "quantizer", "reason"), rejected) if rejected else ["None.", ""]
    unannotated = quantizers.get("unannotated_nodes", [])
    lines += ["### Nodes no quantizer annotated (they stay float)", ""]
    lines += [f"- {n}" for n in unannotated] if unannotated else ["None."]
    return [*lines, ""]


def _short(type_text: str, limit: int = 160) -> str:
    """A per-channel type cut to its first values (the JSON report keeps all of them)."""
    if len(type_text) <= limit:
        return f"`{type_text}`"
    count = type_text[type_text.find("{") :].count(",") + 1
    return f"`{type_text[:limit]}...` ({count} values)"


def _ports(report: Mapping[str, Any]) -> list[str]:
    lines = ["## Quantized types", ""]
    calibrated = report.get("calibrated", [])
    lines += ["### Calibrated", ""]
    rows = [(f"`{c['value']}`", c["kind"], c["observer"], _short(c["type"])) for c in calibrated]
    lines += _table(("value", "kind", "observer", "type"), rows) if rows else ["None.", ""]
    propagated = report.get("propagated", [])
    lines += ["### Propagated", ""]
    shared = [(f"`{p['value']}`", p["why"], _short(p["type"])) for p in propagated]
    lines += _table(("value", "why", "type"), shared) if shared else ["None.", ""]
    lines += ["### Where constraints meet", ""]
    lines += [
        "Ops the target binds to one type (data movement; on TOSA a Concat too) whose input and output got "
        "different ones: a rescale before the op, or, on ONNX Runtime, the op in float between conversions.",
        "",
    ]
    met = [(f"`{r['node']}`", f"`{r['value']}`", r["why"]) for r in report.get("rescales", [])]
    lines += _table(("op", "value", "what happens"), met) if met else ["None.", ""]
    return lines


def _bias_correction(report: Mapping[str, Any]) -> list[str]:
    section = report.get("bias_correction")
    if not section:
        return []
    lines = ["## Kernels against float", ""]
    rows = [
        (
            f"`{k['node']}`",
            str(k["channels"]),
            f"{k['sqnr_db']:.1f}",
            f"{k['mean_shift']:.3g}",
            f"{k['max_shift']:.3g}",
            f"{k.get('sqnr_samples', k.get('samples', 0))} / {k.get('samples', 0)}",
        )
        for k in section.get("kernels", [])
    ]
    corrected = "given back to its bias" if section.get("enabled") else "not corrected (bias correction off)"
    lines += [
        "Each int8 kernel against its float version on the same inputs: its output SQNR (dB) and the "
        f"mean output shift its quantization caused (float units), {corrected}; and the calibration samples "
        "each was measured on (a pointwise convolution's SQNR on the first ones only: after them its shift "
        "comes from the sums of its inputs).",
        "",
    ]
    header = ("kernel", "channels", "SQNR dB", "mean shift", "largest shift", "samples: SQNR / shift")
    lines += _table(header, rows) if rows else ["None.", ""]
    kept = report.get("kept_float_below", {})
    if kept.get("kernels"):
        lines += [f"Kept float (SQNR below {kept['threshold_db']:g} dB, quantized a second time without them):", ""]
        lines += [f"- `{k['node']}`: {k['sqnr_db']:.1f} dB" for k in kept["kernels"]] + [""]
    return lines


def _smoothing(report: Mapping[str, Any]) -> list[str]:
    section = report.get("smoothing")
    if not section or not section.get("alpha"):
        return []
    lines = ["## Smoothing", ""]
    if section.get("not_applied"):
        return [*lines, f"Not applied: {section['not_applied']}.", ""]
    lines += [
        f"Each linear layer's input divided per channel by s = max|x|^{section['alpha']:g} / max|w|^"
        f"{1 - section['alpha']:.2g}, its weight's rows multiplied by s (the float model computes the same). "
        "Spread: the input's largest channel range over its median one, before and after.",
        "",
    ]
    rows = [
        (
            f"`{r['input']}`",
            ", ".join(f"`{n}`" for n in r["linears"]),
            r["applied"] or f"not smoothed: {r['skipped']}",
            f"{r['spread_before']:.1f} -> {r['spread_after']:.1f}" if r["channels"] else "",
        )
        for r in section.get("inputs", [])
    ]
    return [*lines, *_table(("input", "linear layers", "done", "spread"), rows)] if rows else [*lines, "None.", ""]


def _equalization(report: Mapping[str, Any]) -> list[str]:
    section = report.get("equalization")
    if not section or not section.get("chains"):
        return []
    lines = [
        "## Equalization",
        "",
        "Each depthwise convolution's input channels scaled up (the convolution before it times s per output "
        f"channel, the depthwise weights divided by s; s at most {section['max_scale']:g}) so that small channels "
        "use more of the tensor's range. Spread: the largest channel maximum over the median one, before and after.",
        "",
    ]
    rows = [
        (
            f"`{r['depthwise']}`",
            f"`{r['conv']}`" + (f" -> `{r['activation']}`" if r["activation"] else ""),
            f"{r['scaled']} of {r['channels']} channels, up to {r['largest_factor']:.2f}x"
            if not r["skipped"]
            else f"not equalized: {r['skipped']}",
            f"{r['spread_before']:.1f} -> {r['spread_after']:.1f}" if r["channels"] else "",
        )
        for r in section["chains"]
    ]
    return [*lines, *_table(("depthwise conv", "after", "done", "spread"), rows)]


def _weight_encoding(report: Mapping[str, Any]) -> list[str]:
    section = report.get("weight_encoding")
    if not section or not section.get("kernels"):
        return []
    lines = [
        "## Weight encodings",
        "",
        f"Kernel model: {section['kernel_model']}. Each int8 kernel's weights, checked for every input the "
        'kernel can be given (its stored range): "full range" is proven not to saturate as rounded; '
        '"pair-safe" channels got a larger scale and their largest same-sign pairs were shrunk until no '
        "int16 pair sum can leave its range. Margin: how far the closest pair stays from that range "
        "(accumulator units, for the worst input).",
        "",
    ]
    rows = [
        (
            f"`{e['node']}`",
            e["encoding"],
            e["accumulation"],
            str(e["margin"]) if e["accumulation"] != "int32" else "n/a",
            f"{e['rescaled']} / {e['channels']}" + (f" (x{e['largest_factor']:.2f})" if e["rescaled"] else ""),
            str(e["moved"]),
            f"{e['sqnr_db']:.1f} -> {e['encoded_sqnr_db']:.1f}",
            e["why"],
        )
        for e in section["kernels"]
    ]
    header = ("kernel", "encoding", "accumulation", "margin", "rescaled", "moved", "weight SQNR dB", "why")
    return [*lines, *_table(header, rows)]


def to_markdown(report: Mapping[str, Any], title: str = "requant quantization report") -> str:
    """The report (``QuantizedModel.report``, or its JSON read back) as a Markdown page; a model of parts' as each
    part's page under its name."""
    if "parts" in report:
        lines = [f"# {title}", "", "```", str(report["summary"]).split("\n\n")[0], "```", ""]  # before the parts'
        for name, part in report["parts"].items():
            page = to_markdown(part, f"{name}").splitlines()
            lines += [f"#{line}" if line.startswith("#") else line for line in page] + [""]
        return "\n".join(lines).rstrip("\n") + "\n"
    lines = [f"# {title}", ""]
    lines += _summary(report)
    for heading, header, rows in [*executorch_tables(report), *blocks_tables(report)]:  # executorch-xnnpack's, an LLM's
        lines += [f"## {heading}", "", *_table(header, rows)]
    if "lint" in report:  # the ONNX targets': their QDQ model, its ports and weights
        lines += _lint(report["lint"])
        lines += _quantizers(report["quantizers"])
        lines += _smoothing(report)
        lines += _equalization(report)
        lines += _ports(report)
        lines += _weight_encoding(report)
        lines += _bias_correction(report)
    return "\n".join(lines).rstrip("\n") + "\n"
