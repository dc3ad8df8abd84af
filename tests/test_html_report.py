"""The HTML report: one self-contained page with plots, rendered by a real browser (Debian's Chromium,
headless; `make setup` installs it)."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import requant
from requant.report.html import HtmlReportError, compare_to_html, to_html
from tests.test_quantize import run_cli

DIGITS = Path(__file__).parent.parent / "examples" / "digits"
CHROMIUM = shutil.which("chromium")
# as root on a machine with no network: no sandbox, and no background connections to refuse
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    result = requant.quantize(
        DIGITS / "digits_cnn.onnx",
        DIGITS / "calib.npz",
        eval_data=DIGITS / "eval.npz",
        max_drop=5e-6,
        metric="cosine",
    )  # fmt: skip  (pair-safe: the same on every CPU)
    # measured: 1.0e-5 at first (the logits float), 5.6e-6 with the first conv float, 3.4e-6 with both
    # convs (met: the Gemm stays int8, so the page has its int8 sections)
    return json.loads(json.dumps(result.report, default=str))  # as --report-json writes it


def test_the_page_is_self_contained_and_the_same_every_time(report: dict) -> None:
    tries = report["accuracy_budget"]["tries"]
    assert len(tries) >= 2 and all(t["latency_ms"] > 0 for t in tries)  # each try's latency, measured interleaved
    page = to_html(report)
    assert "latency / float" in page
    assert page == to_html(report)  # the same bytes
    # kernels, tensor by tensor (the evaluation data's), weights, activation ranges, budget, latency: inline SVG
    assert page.count("<svg") == 6 and "Tensor by tensor" in page
    for section in ("Kernels against float", "Weights", "Activation ranges", "Accuracy budget", "Latency and size",
                    "What ONNX Runtime runs (lint)", "Decisions"):  # fmt: skip
        assert f"<h2>{section}</h2>" in page
    # nothing to fetch: no script, stylesheet or image from elsewhere (the SVGs' XML namespaces are names)
    assert not re.findall(r'(?:src|href)\s*=\s*"(?:https?:)?//|url\(\s*["\']?(?:https?:)?//|<script|<link', page)
    assert "node_conv2d" in page and "QGemm x1" in page  # the convs kept float, the Gemm int8


def test_a_report_without_a_summary_is_refused() -> None:
    with pytest.raises(HtmlReportError, match="not a requant report"):
        to_html({"lint": {}})


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def _rendered(page_text: str, tmp_path: Path, height: int) -> str:
    """``page_text`` opened in headless Chromium: screenshot 1200 x ``height`` in ``tmp_path /
    'page.png'`` (checked for its size), no console messages (script errors, failed loads): the DOM."""
    page = tmp_path / "page.html"
    page.write_text(page_text, encoding="utf-8")
    with tempfile.TemporaryDirectory() as profile:
        common = [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0"]
        shot = subprocess.run([*common, f"--window-size=1200,{height}", f"--screenshot={tmp_path / 'page.png'}",
                               page.as_uri()], capture_output=True, text=True, timeout=120)  # fmt: skip
        dom = subprocess.run([*common, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.returncode == 0 and dom.returncode == 0, shot.stderr[-2000:]
    assert _png_size(tmp_path / "page.png") == (1200, height)
    console = [line for line in shot.stderr.splitlines() + dom.stderr.splitlines() if "CONSOLE" in line]
    assert console == []  # no script errors, nothing failed to load
    return dom.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is installed by `make setup` (apt)")
def test_chromium_renders_the_page_with_its_charts(report: dict, tmp_path: Path) -> None:
    dom = _rendered(to_html(report), tmp_path, 2400)
    assert (tmp_path / "page.png").stat().st_size > 50_000  # charts and tables drawn, not a blank page
    # the browser's DOM has the charts
    assert dom.count("<svg") == 6 and "Accuracy budget" in dom and "Tensor by tensor" in dom


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is installed by `make setup` (apt)")
def test_chromium_renders_the_comparison_page(tmp_path: Path) -> None:
    quantized = tmp_path / "digits_int8.onnx"
    requant.quantize(DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", output=quantized, measure=False)
    results = requant.compare(DIGITS / "digits_cnn.onnx", quantized, DIGITS / "eval.npz", samples=50)
    dom = _rendered(compare_to_html([r.to_json() for r in results]), tmp_path, 900)
    assert (tmp_path / "page.png").stat().st_size > 30_000
    assert dom.count("<svg") == 1 and dom.count("<tr>") == 1 + len(results)


def test_the_cli_writes_the_page_from_a_saved_report(report: dict, tmp_path: Path) -> None:
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(report))
    done = subprocess.run([sys.executable, "-m", "requant", "report", str(saved), "-o", str(tmp_path / "r.html")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and (tmp_path / "r.html").read_text().count("<svg") == 6
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    refused = subprocess.run([sys.executable, "-m", "requant", "report", str(bad), "-o", str(tmp_path / "b.html")],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert refused.returncode == 1 and "is not a JSON report" in refused.stderr and not (tmp_path / "b.html").exists()


def test_quantize_writes_the_page_with_the_model(tmp_path: Path) -> None:
    out, page = tmp_path / "d.onnx", tmp_path / "d.html"
    ran = run_cli(str(DIGITS / "digits_cnn.onnx"), "-o", str(out), "--calib", str(DIGITS / "calib.npz"),
                  "--report-html", str(page), "--no-measure")  # fmt: skip
    assert ran.returncode == 0 and out.is_file() and page.read_text().count("<svg") >= 3


def test_a_histogram_method_shows_the_observed_ranges_and_the_most_clipped_tensors() -> None:
    result = requant.quantize(DIGITS / "digits_cnn.onnx", DIGITS / "calib.npz", method="mse", measure=False)
    seen = [c["seen"] for c in result.report["calibrated"] if c["kind"] == "activation" and c["observer"] == "mse"]
    assert seen and all(len(s["histogram"]["counts"]) == 64 and s["observed"][0] <= s["observed"][1] for s in seen)
    page = to_html(json.loads(json.dumps(result.report, default=str)))
    assert "observed in calibration" in page and "clipped" in page
    assert page.count("<svg") == 4  # kernels, weights, ranges, histograms (no latency: not measured)
