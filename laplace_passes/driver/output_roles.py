"""What each output of an exported module is: the function's output, an input's new value, a value saved for
the backward, or a gradient.

AOT Autograd orders a forward or inference graph's outputs: first the new
values of the inputs the function updates in place (a buffer's counter, a
decode state), then the function's outputs, then the bases of outputs that
alias one another, then (a forward graph) the values the backward graph
takes. A "graph output" is a value the Dynamo graph returns: the function's
outputs, and values Dynamo writes back after the graph (a reassigned
attribute), in the order Dynamo returns them. A backward graph returns one
gradient per forward input, None where it has none (the module leaves those
out). The manifest's outputs carry that
role, so that a consumer maps them without reading the graph: a module of
tiny's training forward returns 3 values to the user and 100 to the backward.

    layout = OutputLayout.of_compile()       # inside the inner compiler's call: AOT's metadata of this graph
    roles = layout.roles(kind, positions, count)   # one dict per module output, or None where unknown
"""

from __future__ import annotations

from dataclasses import dataclass

from torch._guards import TracingContext


@dataclass(frozen=True)
class OutputLayout:
    mutated_inputs: tuple[int, ...]  # the graph input each leading output is the new value of
    user_outputs: int
    aliased_bases: int

    @classmethod
    def of_compile(cls) -> OutputLayout | None:
        """The layout of the graph being compiled now; None outside AOT Autograd, or with effect tokens (outputs
        this module does not place)."""
        context = TracingContext.try_get()
        meta = getattr(context, "fw_metadata", None)
        if meta is None or getattr(meta, "tokens", None):
            return None
        return cls(tuple(meta.mutated_inp_runtime_indices), meta.num_outputs, meta.num_intermediate_bases)

    def roles(self, kind: str, positions: list[int], count: int) -> list[dict] | None:
        """A role per module output, the module's outputs being the ATen graph's outputs at `positions` (of
        `count`); None when the graph's outputs do not have this layout (a partition of a graph)."""
        if kind == "backward":
            return [{"role": "gradient", "of_forward_input": p} for p in positions]
        leading = len(self.mutated_inputs) + self.user_outputs + self.aliased_bases
        if count < leading or (kind == "inference" and count != leading):
            return None
        return [self._role(p) for p in positions]

    def _role(self, position: int) -> dict:
        mutated = len(self.mutated_inputs)
        if position < mutated:
            return {"role": "updated input", "input": self.mutated_inputs[position]}
        if position < mutated + self.user_outputs:
            return {"role": "graph output", "index": position - mutated}
        if position < mutated + self.user_outputs + self.aliased_bases:
            return {"role": "base of aliased outputs"}
        return {"role": "saved for backward"}
