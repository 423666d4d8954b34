"""Strict mode: a failure inside laplace_passes' own code raises instead of being declined or reported.

By default a pass or check that meets something it did not expect declines
(a pass) or becomes a finding (a preflight check), with the exception in the
reason, and the user's compile goes on. With LAPLACE_PASSES_STRICT=1 in the
environment the exception is raised, so that such failures are found (the
test suite's use).
"""

from __future__ import annotations

import os

ENVIRONMENT_VARIABLE = "LAPLACE_PASSES_STRICT"


def strict_mode() -> bool:
    return os.environ.get(ENVIRONMENT_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")
