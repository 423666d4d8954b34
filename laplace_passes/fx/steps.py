"""A recurrence's steps and chains, as `laplace_passes.fx.recurrence` reads them from a graph.

A `Step` is one update S_t = c1 S_{t-1} (.) d_t + c2 k_t (x) v_t, with the
factors of its decay, keys and values, the selects that skip it or reset its
state, and why it is not GLA's when it is not (`mismatch`). A `Chain` is the
steps of one loop, linked through their previous states, with a readout per
step (or none) and what the loop runs before its first step here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from laplace_passes.fx.algebra import Expr, Factor, Index
from laplace_passes.fx.readouts import Readout
from laplace_passes.fx.update_tops import ResetSelect, SkipSelect
from laplace_passes.infra.fx_helpers import fake_tensor

Node = torch.fx.Node


@dataclass
class Step:
    """One update S_t of a recurrence; `mismatch` says why it is not GLA's, when it is not."""

    node: Node
    prev: Node | None  # S_{t-1}; None: the step starts from a zero state
    expr: Expr
    decay: tuple[Factor, ...] = ()
    decay_coef: float = 1.0
    keys: tuple[Factor, ...] = ()
    values: tuple[Factor, ...] = ()
    input_coef: float = 1.0
    key_axis: int = -2  # the state's dimension k writes and q reads
    value_axis: int = -1
    rows: Index | None = None  # a chunked update's summed rows (None: one token per step)
    mismatch: str = ""
    unread: dict = field(default_factory=dict)  # node -> why the algebra read it as a leaf (`why_unread`)
    skip: SkipSelect | None = None  # the select that skips the update at some steps (NOTE [steps a select skips])
    reset: ResetSelect | None = None  # the select that resets the state it reads (NOTE [states a select resets])
    through: Node | None = None  # S_{t-1} when `prev` is an op of it the algebra does not read (`tanh(S)`)

    @property
    def state_read(self) -> Node | None:
        """The node the update reads as its previous state: `prev`, or the select that resets it."""
        return self.reset.select if self.reset is not None else self.prev

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(fake_tensor(self.node).shape)


@dataclass
class Chain:
    steps: list[Step]
    readouts: list[Readout] = field(default_factory=list)  # one per step, or none at all
    mismatch: str = ""
    unlinked: int = 0  # steps the loop runs before its first step here, not read as steps of it
    read_before_update: bool = False  # readouts of S_{t-1} per token (NOTE [readouts before the update])
    reads_reset_states: bool = False  # ... of S_{t-1} after the select that resets it, same NOTE

    @property
    def tokens(self) -> int:
        """The steps the user's loop runs: the chain's, and a first step (from a zero state, say) written or
        read differently, which a report that counted only the chain would leave out."""
        return len(self.steps) + self.unlinked

    @property
    def first(self) -> Step:
        return self.steps[0]

    @property
    def last(self) -> Step:
        return self.steps[-1]
