"""Targets: declarative tables of the kernels a runtime or chip has, and the checks of each."""

from requant.targets.table import Accept, Check, Match, Pattern, Reject, SupportTable, Verdict

__all__ = ["Accept", "Check", "Match", "Pattern", "Reject", "SupportTable", "Verdict"]
