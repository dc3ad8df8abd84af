"""Reports: what requant decided and why. The quantizers' decision records come from ``requant.quantizers``."""

from requant.quantizers.records import NodeDecision, QuantizerRecord, QuantizerReport
from requant.report.markdown import to_markdown

__all__ = ["NodeDecision", "QuantizerRecord", "QuantizerReport", "to_markdown"]
