"""Building the `laplace::gla` call of a recognised token loop, and its results in the loop's own layouts.

NOTE [recognised loop: before and after]
Before (a Python loop Dynamo unrolled, T = 4 steps shown of 256; q, k, v, g [B, T, H, K]):

    S = l_q_.new_zeros(2, 2, 8, 8)
    exp = l_g_[(slice(None), 0)].exp();  mul = S * exp[(Ellipsis, None)]
    mul_1 = l_k_[(slice(None), 0, ..., None)] * l_v_[(slice(None), 0, ..., None, slice(None))]
    S_1 = mul + mul_1;  sum_1 = (l_q_[(slice(None), 0, ..., None)] * S_1).sum(-2)
    ... three more steps ...
    stack = torch.stack([sum_1, sum_2, sum_3, sum_4], 1)
    return (stack, S_4)

After (the loop's inputs over all steps, one GLA call, its results where the loop's were):

    movedim = torch.movedim(l_q_, 1, 0); ...                  # each input [T, B, H, K], then GLA's [B, T, H, K]
    gla = torch.ops.laplace.gla.default(q, k, v, gk, None, 1.0, 'token loop ...')
    o = gla[0]; state = gla[1]
    stack = permute(reshape(o, ...), ...)                      # the stack of the four readouts
    return (stack, state)

The re-tiling pass then makes the GLA call chunked GLA like any other site.

Each value is built in the graph given (`graph`, with `env` mapping the
loop's nodes to that graph's): the module's own graph for the rewrite, or a
small one that checks the rewrite on random inputs first
(`laplace_passes.fx.recognise`).

NOTE [resets in a trained decay]
A loop whose decay is not written exp(x) gets the gates log(decay). A
decay of exactly 0 resets the state (packed documents: a trained decay
times a mask that is 0 where a document starts; a gate saturated in fp32,
1 - sigmoid(x) for x above about 17), and its log is -inf, which every GLA
form takes as a reset. log's own derivative there is 1/0: the GLA backward
gives such a gate the gradient 0 (the chunked backward knows a gate's
gradient only as the decay times the decay's gradient, and gives every
decay at or below exp(-30) the gradient 0, NOTE [flushing tiny decays]),
and 0 times inf is NaN, which the mask's own derivative (0) (or the
saturated sigmoid's, 0) passes on: NaN where the loop's is 0. So the log
is taken of the decay with its zeros replaced by 1, and -inf put back
where they were: the same gates, and a gradient of 0 at the resets, which
is the loop's own gradient wherever the decay reaches its parameters
through a mask or a saturated function. A decay that is itself a parameter
at exactly 0 gets the gradient 0 there, as a flushed decay does, where the
loop's is the state's share of the loss (tests/test_recognise.py).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx
import torch.nn.functional as F

from laplace_passes.fx.per_step import Lifter
from laplace_passes.fx.token_loop import CHUNKS, ROW, TIME, RoleFactors, TokenLoop, bonus_roles
from laplace_passes.infra.fx_helpers import fake_tensor, new_node

Node = torch.fx.Node


def _same_order(value, order) -> bool:
    return list(order) == list(range(len(order)))


def _same_shape(value, shape) -> bool:
    return value is not None and list(value.shape) == list(shape)


def _same_dtype(value, dtype) -> bool:
    return value is not None and value.dtype == dtype


def _same_place(value, source, destination) -> bool:
    return value is not None and source % value.dim() == destination % value.dim()


# Ops the builder leaves out when they would not change their input (`value`: its fake tensor, if known).
_IDENTITY_WHEN = {torch.permute: _same_order, torch.reshape: _same_shape, torch.Tensor.expand: _same_shape,
                  torch.Tensor.to: _same_dtype, torch.movedim: _same_place}


class GlaBuilder:
    """Builds a loop's GLA inputs, call and outputs for its first `steps` steps."""

    def __init__(self, graph: torch.fx.Graph, loop: TokenLoop, steps: int, memo: dict, env=None) -> None:
        self.graph, self.loop, self.steps = graph, loop, steps
        self.env = env or (lambda n: n)
        self.lifter = Lifter(graph, memo, steps, loop.offset, self.env)
        self.dtype = fake_tensor(loop.like).dtype
        self.device = fake_tensor(loop.like).device
        self.batch = loop.batch_axes
        self.sizes = loop.state_shape
        self.call_gates: Node | None = None  # the GLA call's gk, once `gla` has built it
        self.late_resets: Node | None = None  # resets applied after the one-token shift, set by `gla_inputs`

    def call(self, target, *args, **kwargs) -> Node:
        if target in _IDENTITY_WHEN and _IDENTITY_WHEN[target](fake_tensor(args[0]), *args[1:]):
            return args[0]  # a permute, reshape, expand or cast that changes nothing
        return new_node(self.graph, target, args, kwargs)

    # -- inputs ----------------------------------------------------------------------------------------

    def role(self, name: str, feature: int, nodes_per_factor: list[RoleFactors] | None = None) -> Node | None:
        """The product of a role's factors, [T, *batch, feature] (size 1 where a factor broadcasts)."""
        factors = self.loop.roles.get(name, []) if nodes_per_factor is None else nodes_per_factor
        product = None
        for factor in factors:
            arranged = self.arrange(factor, [*self.batch, feature])
            product = arranged if product is None else self.call(operator.mul, product, arranged)
        return product

    def arrange(self, factor: RoleFactors, targets: list[int]) -> Node:
        """A factor over the steps, its dimensions moved to `targets` order, [T, *targets] with 1 for absent ones.

        A factor whose positions name a TIME dimension is one node over all tokens already (a quadratic form's
        q, k, v): that dimension goes first. Any other is a per-step node, lifted over the steps.
        """
        if TIME in factor.positions or CHUNKS in factor.positions:
            return self._arrange_whole(factor, targets)
        whole, varies = self.lifter.lift(factor.nodes[: self.steps])
        value = fake_tensor(factor.nodes[0])
        lead = 1 if varies else 0
        kept = [d for d, p in enumerate(factor.positions) if p is not None]
        order = sorted(kept, key=lambda d: targets.index(factor.positions[d]))
        node = self.call(torch.permute, whole, [*range(lead), *(lead + d for d in order
                                                                   + [d for d in range(value.dim()) if d not in kept])])
        shape = [self.steps if varies else 1] + [self.sizes[p] if p in (factor.positions[d] for d in kept) else 1
                                                 for p in targets]
        return self.call(torch.reshape, node, shape)

    def _arrange_whole(self, factor: RoleFactors, targets: list[int]) -> Node:
        """A whole tensor over the tokens: its TIME dimension (or CHUNKS then ROW, merged) goes first."""
        value = fake_tensor(factor.nodes[0])
        time = [factor.positions.index(p) for p in (TIME, CHUNKS, ROW) if p in factor.positions]
        kept = [d for d, p in enumerate(factor.positions) if p is not None and p not in (TIME, CHUNKS, ROW)]
        order = sorted(kept, key=lambda d: targets.index(factor.positions[d]))
        rest = [d for d in range(value.dim()) if d not in kept and d not in time]
        node = self.call(torch.permute, self.env(factor.nodes[0]), [*time, *order, *rest])
        present = {factor.positions[d] for d in kept}
        shape = [self.steps] + [self.sizes[p] if p in present else 1 for p in targets]
        return self.call(torch.reshape, node, shape)

    def full(self, node: Node | None, feature: int, fill: float = 1.0, per_feature: bool = True) -> tuple[Node, int]:
        """[T, *batch, F] expanded to full size over the steps and batch (a constant `fill` when there is no
        factor), and F: the feature size, or 1 for a value the same for every feature (a gate per head),
        which GLA's layout then broadcasts as a stride-0 view instead of a copy per feature."""
        width = self.sizes[feature] if per_feature else 1
        shape = [self.steps] + [self.sizes[p] for p in self.batch] + [width]
        if node is None:
            return self.call(torch.full, shape, fill, dtype=self.dtype, device=self.device), width
        if fill != 1.0:
            node = self.call(operator.mul, node, fill)
        return self.call(torch.Tensor.expand, node, shape), width

    def to_gla_layout(self, value: tuple[Node, int], feature_axis: int) -> Node:
        """[T, *batch, F] -> [B, T, H, F] (B the first batch dimension, H the product of the others)."""
        node, width = value
        batch = [self.sizes[p] for p in self.batch]
        moved = self.call(torch.movedim, node, 0, 1) if batch else node
        B, H = (batch[0], math.prod(batch[1:])) if batch else (1, 1)
        laid = self.call(torch.reshape, self.call(torch.Tensor.to, moved, self.dtype), [B, self.steps, H, width])
        feature = self.sizes[feature_axis]
        return laid if width == feature else self.call(torch.Tensor.expand, laid, [B, self.steps, H, feature])

    def gla_inputs(self) -> tuple[Node, Node, Node, Node, Node | None]:
        loop, K, V = self.loop, self.loop.key_axis, self.loop.value_axis
        q = self.full(self.role("q", K), K)
        k = self.full(self.role("k", K), K)
        v = self.full(self.role("v", V), V, loop.coefs["input"])
        gk = self.gates()
        resets = self.reset_states()
        self.late_resets = resets if resets is not None and self._reads_before_updates("reads_reset_states") \
            else None  # applied after the shift, in `gla` (NOTE [readouts before the update])
        if resets is not None and self.late_resets is None:
            # NOTE [states a select resets]: the gate -inf (a decay of 0) where a state resets
            gk = (self.call(torch.where, resets, -math.inf, gk[0]), gk[1])
        updates = self.updated_steps()
        if updates is not None:  # NOTE [steps a select skips]: gate 0, k = v = 0 where a step is skipped
            k, v, gk = ((self.call(torch.where, updates, node, 0.0), width) for node, width in (k, v, gk))
        h0 = None
        if loop.initial_state is not None:
            h0 = self.state_to_gla(self.env(loop.initial_state), getattr(loop, "initial_order", None))
            if loop.coefs["initial"] != 1.0:
                h0 = self.call(operator.mul, h0, loop.coefs["initial"])
        inputs = [self.to_gla_layout(x, axis) for x, axis in ((q, K), (k, K), (v, V), (gk, K))]
        return (*inputs, h0)

    def updated_steps(self) -> Node | None:
        """[T, *batch, 1], True where a step updates the state, for a loop whose steps a select skips."""
        condition = self.role("skip", self.loop.key_axis)
        if condition is None or self.loop.updates_when:
            return condition
        return self.call(torch.logical_not, condition)

    def reset_states(self) -> Node | None:
        """[T, *batch, 1], True where a step resets the state it reads, for a loop whose states a select resets."""
        condition = self.role("reset", self.loop.key_axis)
        if condition is None or self.loop.resets_when:
            return condition
        return self.call(torch.logical_not, condition)

    def gates(self) -> tuple[Node, int]:
        """log of the decay: exp's exponent itself when the decay is exp(x), else a log."""
        loop, K = self.loop, self.loop.key_axis
        log_coef = math.log(loop.coefs["decay"])
        kind, factors = loop.gate_factors()
        per_key = any(K in f.positions for f in factors)
        if kind == "log":
            x = self.role("decay", K, factors)
            if log_coef:
                x = self.call(operator.add, x, log_coef)
            return self.full(x, K, per_feature=per_key)
        decay = self.role("decay", K, factors)
        if decay is None:
            return self.full(None, K, log_coef, per_feature=False)
        gk = self.log_of_decay(decay)
        return self.full(self.call(operator.add, gk, log_coef) if log_coef else gk, K, per_feature=per_key)

    def log_of_decay(self, decay: Node) -> Node:
        """log(decay), -inf at a decay of exactly 0 with a gradient of 0 there, not NaN (NOTE [resets in a
        trained decay])."""
        reset = self.call(torch.eq, decay, 0)
        logged = self.call(torch.log, self.call(torch.where, reset, 1.0, decay))
        return self.call(torch.where, reset, -math.inf, logged)

    def state_to_gla(self, state: Node, order: tuple[int, ...] | None = None) -> Node:
        """A state in the loop's layout -> [B, H, K, V] in the compute dtype. `order`, when given, says where the
        state's dimensions are instead: the dimensions of the batch, key and value, then any of size 1."""
        order = order or [*self.batch, self.loop.key_axis, self.loop.value_axis]
        batch = [self.sizes[p] for p in self.batch]
        B, H = (batch[0], math.prod(batch[1:])) if batch else (1, 1)
        moved = self.call(torch.permute, state, order)
        K, V = self.sizes[self.loop.key_axis], self.sizes[self.loop.value_axis]
        return self.call(torch.reshape, self.call(torch.Tensor.to, moved, self.dtype), [B, H, K, V])

    # -- the call and its outputs ----------------------------------------------------------------------

    def gla(self, origin: str, target=torch.ops.laplace.gla.default) -> tuple[Node, Node]:
        q, k, v, gk, h0 = self.gla_inputs()
        late = self._reads_before_updates()
        if late:  # NOTE [readouts before the update]: token t's state is S_{t-1}, then one update further
            last = [self.call(torch.select, x, 1, -1) for x in (k, v, gk)]
            k, v, gk = (self.call(F.pad, x, (0, 0, 0, 0, 1, -1)) for x in (k, v, gk))
            if self.late_resets is not None:  # the state token t reads out is reset: nothing of token t - 1
                resets = self._in_gla_layout(self.late_resets)
                k = self.call(torch.where, resets, 0.0, k)
                gk = self.call(torch.where, resets, -math.inf, gk)
        call = self.call(target, q, k, v, gk, h0, float(self.loop.coefs["scale"]), origin)
        self.call_gates = gk  # for the proof of its bound (`recognise._keep_unproven_gates_as_written`)
        o, state = self.call(operator.getitem, call, 0), self.call(operator.getitem, call, 1)
        bonus = self._bonus()
        if bonus is not None:
            o = self.call(operator.add, o, bonus)
        return o, self._one_update(state, *last) if late else state

    def _bonus(self) -> Node | None:
        """The readouts' terms that do not read the state, [B, T, H, V] (NOTE [a readout's bonus term]): each
        a product over the state's dimensions, summed over the key."""
        loop, K, V = self.loop, self.loop.key_axis, self.loop.value_axis
        total = None
        for role in bonus_roles(loop):
            term = None
            for factor in loop.roles[role]:
                arranged = self.arrange(factor, [*self.batch, K, V])
                term = arranged if term is None else self.call(operator.mul, term, arranged)
            summed = self.call(torch.sum, term, len(self.batch) + 1)
            if loop.coefs[role] != 1.0:
                summed = self.call(operator.mul, summed, loop.coefs[role])
            total = summed if total is None else self.call(operator.add, total, summed)
        return None if total is None else self.to_gla_layout(self.full(total, V), V)

    def _reads_before_updates(self, how: str = "read_before_update") -> bool:
        chain = getattr(self.loop, "chain", None)
        return chain is not None and getattr(chain, how)

    def _in_gla_layout(self, condition: Node) -> Node:
        """A [T, *batch, 1] condition -> [B, T, H, 1], without a cast (`to_gla_layout` casts to the dtype)."""
        batch = [self.sizes[p] for p in self.batch]
        full = self.call(torch.Tensor.expand, condition, [self.steps, *batch, 1])  # one per sequence: per head too
        moved = self.call(torch.movedim, full, 0, 1) if batch else full
        B, H = (batch[0], math.prod(batch[1:])) if batch else (1, 1)
        return self.call(torch.reshape, moved, [B, self.steps, H, 1])

    def _one_update(self, state: Node, k: Node, v: Node, gk: Node) -> Node:
        """exp(gk)[..., None] * state + k[..., None] * v[..., None, :], in GLA's layouts ([B, H, K, V], [B, H, F])."""
        decayed = self.call(operator.mul, self.call(torch.unsqueeze, self.call(torch.exp, gk), -1), state)
        outer = self.call(operator.mul, self.call(torch.unsqueeze, k, -1), self.call(torch.unsqueeze, v, -2))
        return self.call(operator.add, decayed, outer)

    def outputs_over_steps(self, o: Node) -> Node:
        """GLA's o [B, T, H, V] -> [T, *batch, V]."""
        batch = [self.sizes[p] for p in self.batch]
        V = self.sizes[self.loop.value_axis]
        split = self.call(torch.reshape, o, [batch[0] if batch else 1, self.steps, *batch[1:], V])
        moved = self.call(torch.movedim, split, 1, 0)
        return moved if batch else self.call(torch.reshape, moved, [self.steps, V])

    def readout(self, over_steps: Node, step: int, like: Node) -> Node:
        """Step `step`'s readout in the layout and dtype of the loop's own readout `like`."""
        return self._laid_out(self.call(torch.select, over_steps, 0, step), like, leading=False)

    def stacked(self, over_steps: Node, dim: int, like: Node) -> Node:
        """All readouts stacked along `dim` (like `torch.stack(readouts, dim)`)."""
        laid = self._laid_out(over_steps, like, leading=True)
        return self.call(torch.movedim, laid, 0, dim) if dim else laid

    def _laid_out(self, value: Node, like: Node, leading: bool) -> Node:
        positions = self.loop.readout_positions
        source = [*self.batch, self.loop.value_axis]
        kept = [p for p in positions if p is not None]
        lead = [0] if leading else []
        rest = [p for p in source if p not in kept]  # size-1 batch dimensions the readout does not keep
        order = lead + [len(lead) + source.index(p) for p in kept + rest]
        moved = self.call(torch.permute, value, order)
        shape = ([self.steps] if leading else []) + [self.sizes[p] if p is not None else 1 for p in positions]
        return self.call(torch.Tensor.to, self.call(torch.reshape, moved, shape), fake_tensor(like).dtype)

    def laid_out_whole(self, over_steps: Node, positions: tuple, like: Node) -> Node:
        """[T, *batch, V] in the layout of `like`, whose dimensions are at `positions` (TIME, a batch or
        the value position, or None for size 1)."""
        source = [TIME, *self.batch, self.loop.value_axis]
        if CHUNKS in positions:  # a user's chunked layout: the tokens split into [chunks, rows] first
            rest_shape = [self.sizes[p] for p in source[1:]]
            over_steps = self.call(torch.reshape, over_steps, [self.loop.chunks, self.loop.rows, *rest_shape])
            source = [CHUNKS, ROW, *source[1:]]
        kept = [p for p in positions if p is not None]
        rest = [d for d, p in enumerate(source) if p not in kept]
        moved = self.call(torch.permute, over_steps, [source.index(p) for p in kept] + rest)
        value = fake_tensor(like)
        return self.call(torch.Tensor.to, self.call(torch.reshape, moved, list(value.shape)), value.dtype)

    def final_state(self, state: Node, like: Node) -> Node:
        """GLA's final state [B, H, K, V] -> the loop's state layout and dtype."""
        order = [*self.batch, self.loop.key_axis, self.loop.value_axis]
        split = self.call(torch.reshape, state, [self.sizes[p] for p in order])
        inverse = [order.index(p) for p in range(len(order))]
        moved = self.call(torch.permute, split, inverse)
        return self.call(torch.Tensor.to, moved, fake_tensor(like).dtype)

