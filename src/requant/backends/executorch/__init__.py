"""The ExecuTorch backend: a PT2E-converted program lowered to XNNPACK and written as a ``.pte``
(:mod:`.lower`), and run by ExecuTorch's runtime (:mod:`.runtime`)."""

from requant.backends.executorch.lower import Lowered, lower_to_pte
from requant.backends.executorch.runtime import ModuleSession, PteSession

__all__ = ["Lowered", "ModuleSession", "PteSession", "lower_to_pte"]
