"""The matmuls a call runs, found with torch.profiler, and the same matmuls run alone: a path's ceiling.

    matmuls = MatmulsAlone.of(run)     # one profiled call of `run` (a compiled GLA forward + backward, say)
    matmuls()                          # every product again, back to back, at the shapes the call ran
    matmuls.flops, len(matmuls)

A call that does matmuls and other work cannot be faster than its matmuls
alone: timed in the same rounds as the call, they give the share of the
dense matmul rate the call would reach if everything else it does (the
elementwise kernels between the products, the wrapper, the allocations)
cost nothing. The products run on random inputs of the recorded shapes, in
contiguous layouts, each into an output allocated once (as Inductor's
buffers are reused), so layout copies the call made are not counted.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

# Profiler event -> (the op run alone, the positions of its two factors among the recorded input shapes).
MATMUL_EVENTS = {
    "aten::mm": (torch.mm, (0, 1)),
    "aten::addmm": (torch.mm, (1, 2)),
    "aten::bmm": (torch.bmm, (0, 1)),
    "aten::baddbmm": (torch.bmm, (1, 2)),
}


class MatmulsAlone:
    """The products one call ran, with inputs and outputs of their shapes, to run again alone."""

    def __init__(self, products: list[tuple[str, tuple, tuple]]) -> None:
        self.shapes = Counter(products)
        self._calls = []
        for op_name, a_shape, b_shape in products:
            op = MATMUL_EVENTS[op_name][0]
            a, b = torch.randn(a_shape), torch.randn(b_shape)
            self._calls.append((op, a, b, op(a, b)))

    @classmethod
    def of(cls, run) -> "MatmulsAlone":
        """The matmuls of one call of `run`, in the order it ran them."""
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiled:
            run()
        products = []
        for event in sorted(profiled.events(), key=lambda e: e.time_range.start):
            if event.name in MATMUL_EVENTS and _outermost(event):
                first, second = MATMUL_EVENTS[event.name][1]
                products.append((event.name, tuple(event.input_shapes[first]), tuple(event.input_shapes[second])))
        return cls(products)

    @property
    def flops(self) -> float:
        return float(sum(2 * b.shape[-1] * a.numel() for _, a, b, _ in self._calls))

    def __len__(self) -> int:
        return len(self._calls)

    def __call__(self) -> None:
        for op, a, b, out in self._calls:
            op(a, b, out=out)


def _outermost(event) -> bool:
    """Not a matmul inside another recorded matmul (addmm calling mm, say): each product counted once."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in MATMUL_EVENTS:
            return False
        parent = parent.cpu_parent
    return True
