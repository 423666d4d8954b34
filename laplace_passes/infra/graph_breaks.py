"""The graph breaks Dynamo meets while a function is captured, each in one line.

A graph break splits the function into several graphs with Python between
them: a data-dependent branch takes the side the example inputs chose, an op
whose output shape depends on values (``nonzero``) runs eagerly. Each graph
is compiled (or exported, or checked for Neuron) alone, and the code between
them is in none of them, so `inspect`, `export` and `preflight` say where the
function was split. Dynamo counts the breaks it meets by reason, process-wide:
``counters["graph_break"]`` in the function's own frame, and only
``counters["unimplemented"]`` in the frames it resumes after a break (a
second data-dependent branch). The reasons counted while one capture runs
are that capture's; an "unimplemented" reason counts when the function was
split (more than one graph) or a break was counted, since Dynamo also meets
them where it recovers within a graph.

    with GraphBreaks() as breaks:
        compiled(*example_inputs)
    breaks.reasons(graphs=2)   # ['Data-dependent branching (model.py, line 12: if y.sum() > 0:)']
"""

from __future__ import annotations

import re
from collections import Counter

from torch._dynamo.utils import counters

# Where Dynamo's reason points in the user's code: `# File "m.py", line 6, in f, code: if y.sum() > 0:`.
_CODE_LINE = re.compile(r'# File "([^"]+)", line (\d+), in [^,]+, code: (.*)')
_DEBUG_CONTEXT = re.compile(r"Developer debug context: (.+)")
_CATEGORIES = ("graph_break", "unimplemented")  # Dynamo's counters that hold graph-break reasons


class GraphBreaks:
    """The graph breaks met between entering and leaving the context: `reasons(graphs)`, one line each."""

    def __enter__(self) -> "GraphBreaks":
        self._before = {category: Counter(counters[category]) for category in _CATEGORIES}
        self._met: dict[str, list[str]] = {category: [] for category in _CATEGORIES}
        return self

    def __exit__(self, *exc_info) -> None:
        # A reason's count is not a count of breaks (Dynamo may meet one break again when it restarts a frame).
        self._met = {category: list(Counter(counters[category]) - self._before[category]) for category in _CATEGORIES}

    def reasons(self, graphs: int) -> list[str]:
        """One line per kind of break, for a capture that made `graphs` Dynamo graphs."""
        if not self._met["graph_break"] and graphs <= 1:
            return []
        return list(dict.fromkeys(one_line(reason) for category in _CATEGORIES for reason in self._met[category]))


def one_line(reason: str) -> str:
    """Dynamo's reason (a title, an explanation, hints, a link) as its title and where it happened."""
    title = reason.strip().splitlines()[0].strip() if reason.strip() else "a graph break"
    if where := _CODE_LINE.search(reason):
        path, line, code = where.groups()
        return f"{title} ({path.rsplit('/', 1)[-1]}, line {line}: {code.strip()})"
    if context := _DEBUG_CONTEXT.search(reason):
        return f"{title} ({context.group(1).strip()})"
    return title
