"""A chain of GLA steps checked to be one loop: the same computation at positions offset .. offset + T - 1.

`plan_token_loop` turns a `Chain` (laplace_passes.fx.steps) into a
`TokenLoop`: for each of GLA's four inputs (q from the readouts, k, v and
the decay from the updates) the factors of every step, matched across steps
(`laplace_passes.fx.per_step.pattern`: the same computation, indexing the
step's position), and where each factor's dimensions sit in the state. A
chain whose steps are not one computation (another op at step 3, an input
read at a position out of order, a coefficient that changes) is declined
with the step and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from laplace_passes.fx.algebra import Factor
from laplace_passes.fx.gate_bounds import NONNEGATIVE, gate_bound
from laplace_passes.fx.per_step import pattern, positions_in_several_numbers, shared_by_steps, step_index
from laplace_passes.fx.steps import Chain
from laplace_passes.fx.unlike_steps import unlike_step_0
from laplace_passes.fx.update_tops import SkipSelect
from laplace_passes.infra.fx_helpers import fake_tensor
from laplace_passes.infra.pass_base import Declined

Node = torch.fx.Node
aten = torch.ops.aten

TIME = "time"  # in a whole factor's positions: the dimension that runs over the tokens
CHUNKS, ROW = "chunks", "row"  # or two, chunks then the rows of a chunk (a user's chunked tensors)
_EXPS = frozenset({torch.exp, aten.exp.default})
_ZERO_FILLS = frozenset({torch.zeros, torch.zeros_like, aten.zeros.default, aten.zeros_like.default})
_ZERO_FILL_METHODS = frozenset({"new_zeros", "zero_"})


@dataclass
class RoleFactors:
    """One factor of a role, over all steps: its node at each step and where its dimensions sit in the state."""

    nodes: list[Node]
    positions: tuple  # per dimension of the factor: the state dimension it indexes, or None (size 1)


@dataclass
class TokenLoop:
    chain: Chain
    T: int
    offset: int  # the position step 0 reads
    state_shape: tuple[int, ...]
    key_axis: int
    value_axis: int
    roles: dict[str, list[RoleFactors]] = field(default_factory=dict)
    coefs: dict[str, float] = field(default_factory=dict)  # "scale", "input", "decay"
    readout_positions: tuple | None = None  # per dimension of a readout: a state dimension or None
    updates_when: bool = True  # a "skip" role's condition updates the state where it is True (else where False)
    resets_when: bool = True  # a "reset" role's condition resets the state where it is True (else where False)
    initial_state: Node | None = None
    # How the steps were read (`per_step.pattern`'s memo), with what matching them chose: NOTE [values every
    # step reads], NOTE [an index of several numbers]. The sources are read the same way.
    patterns: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def like(self) -> Node:
        """The node whose dtype and device GLA computes in: the loop's last state."""
        return self.chain.last.node

    def gate_factors(self) -> tuple[str, list[RoleFactors]]:
        """("log", the factors of x) for a decay written exp(x); ("decay", its factors); ("none", [])."""
        exponent = decay_exponent(self)
        if exponent is not None:
            return "log", [RoleFactors(exponent, self.roles["decay"][0].positions)]
        decay = self.roles.get("decay", [])
        return ("decay", decay) if decay else ("none", [])

    @property
    def batch_axes(self) -> list[int]:
        return [p for p in range(len(self.state_shape)) if p not in (self.key_axis, self.value_axis)]

    def gate_sources(self) -> dict[str, set[Node]]:
        """The per-step nodes of the gates, by kind ("log": x of exp(x); "decay"), for random inputs."""
        kind, factors = self.gate_factors()
        return {kind: {n for f in factors for n in f.nodes}}

    def results(self, steps: int) -> list[Node]:
        """What the loop computes over its first `steps` steps: their readouts, then the state after them."""
        return [r.node for r in self.chain.readouts[:steps]] + [self.chain.steps[steps - 1].node]

    def gla_results(self, builder, old: list[Node], target) -> list[Node]:
        """`results` computed by a GLA call `builder` makes (`target`: the op, or a reference)."""
        o, state = builder.gla("validation", target=target)
        over = builder.outputs_over_steps(o)
        new = [builder.readout(over, t, like) for t, like in enumerate(old[:-1])]
        return new + [builder.final_state(state, old[-1])]

    def source_nodes(self) -> set[Node]:
        """The nodes the loop reads its inputs from (its readouts and updates aside)."""
        return self.mask_sources() | self.value_sources()

    def value_sources(self) -> set[Node]:
        """The nodes the loop reads values from: its sources less those only its selects' conditions read."""
        found = self._sources_of_roles([r for r in self.roles if r not in _SELECT_ROLES])
        return found | ({self.initial_state} if self.initial_state is not None else set())

    def sources_of(self, node: Node) -> set[Node]:
        """The nodes one of the loop's per-step values is computed from (`source_nodes`, for that value)."""
        return _sources(node, self.patterns)

    def mask_sources(self) -> set[Node]:
        """The nodes the conditions of the selects that skip steps or reset states come from: masks, random
        ones stand for."""
        return self._sources_of_roles(_SELECT_ROLES)

    def _sources_of_roles(self, roles) -> set[Node]:
        return {n for role in roles for f in self.roles.get(role, []) for n in _sources(f.nodes[0], self.patterns)}


_SELECT_ROLES = ("skip", "reset")


def _sources(node: Node, memo: dict) -> set[Node]:
    found = pattern(node, memo)
    if not found.varies:
        return {node}
    if step_index(node, memo) is not None:
        return {found.key[1]}  # the tensor indexed at the step's position
    return {n for arg in node.all_input_nodes for n in _sources(arg, memo)} or {node}


def plan_token_loop(chain: Chain, memo: dict) -> TokenLoop:
    first = chain.first
    if any(s.rows is not None for s in chain.steps):
        raise Declined("its updates add a chunk of outer products each (a chunked algorithm), whose readouts "
                       "are not those of a token loop")
    key_axis, value_axis = first.key_axis % len(first.shape), first.value_axis % len(first.shape)
    for index, step in enumerate(chain.steps):
        if (step.key_axis % len(step.shape), step.value_axis % len(step.shape)) != (key_axis, value_axis):
            raise Declined(f"step {index} writes k and v into other dimensions of the state than step 0")
    loop = TokenLoop(chain, len(chain.steps), 0, first.shape, key_axis, value_axis, patterns=memo)
    positions = {
        "k": [_positions(s.expr.axes, s.keys) for s in chain.steps],
        "v": [_positions(s.expr.axes, s.values) for s in chain.steps],
        "decay": [_positions(s.expr.axes, s.decay) for s in chain.steps],
        "q": [_positions(r.state_axes, r.queries) for r in chain.readouts],
        **_bonus_positions(chain),
    }
    skip = _select_positions([s.skip for s in chain.steps], "skipped", first.shape, key_axis, value_axis)
    if skip:
        positions["skip"] = skip
        loop.updates_when = chain.first.skip.updates_when
    reset = _select_positions([s.reset for s in chain.steps], "reset", first.shape, key_axis, value_axis)
    if reset:
        positions["reset"] = reset
        loop.resets_when = chain.first.reset.resets_when
    offsets = set()
    for role in positions:
        per_step = positions[role]
        if per_step:
            loop.roles[role], found = _match_steps(role, per_step, memo)
            offsets |= found
    _set_offset(loop, offsets)
    _set_coefficients(loop)
    _refuse_growing_decays(loop)
    loop.initial_state = _initial_state(chain)
    if chain.readouts:
        loop.readout_positions = _readout_layout(chain)
    return loop


def bonus_roles(loop) -> list[str]:
    """The roles of a readout's bonus terms (NOTE [a readout's bonus term] in `laplace_passes.fx.readouts`)."""
    return sorted(r for r in loop.roles if r.startswith("bonus"))


def _bonus_positions(chain: Chain) -> dict[str, list]:
    """Per bonus term of the readouts, each readout's factors of it and the state dimensions they read."""
    counts = {len(r.bonus) for r in chain.readouts}
    if len(counts) > 1:
        raise Declined("some of its readouts add a term that does not read the state and others do not")
    return {f"bonus{i}": [_positions(r.state_axes, r.bonus[i].factors) for r in chain.readouts]
            for i in range(counts.pop() if counts else 0)}


def _select_positions(selects: list, what: str, state: tuple, key_axis: int, value_axis: int) -> list | None:
    """Per step, the condition of the select that skips it (or resets its state) and the state dimensions it
    reads (NOTE [steps a select skips], NOTE [states a select resets] in `laplace_passes.fx.update_tops`);
    None when no step has one."""
    if all(s is None for s in selects):
        return None
    # Which way round each select is: a skip's `updates_when`, a reset's `resets_when`.
    senses = {s.updates_when if isinstance(s, SkipSelect) else s.resets_when for s in selects if s is not None}
    if any(s is None for s in selects) or len(senses) > 1:
        raise Declined(f"some of its steps are {what} by a select and others are not, or by its opposite")
    per_step = []
    for select in selects:
        shape = tuple(fake_tensor(select.condition).shape)
        lead = len(state) - len(shape)
        positions = tuple(lead + d if size != 1 else None for d, size in enumerate(shape))
        if lead < 0 or {key_axis, value_axis} & set(positions):
            raise Declined(f"its select {select.condition.name} {list(shape)} chooses per key or value channel of "
                           "the state, not per sequence or head: not one GLA step")
        per_step.append([(select.condition, positions)])
    return per_step


def _positions(state_axes: tuple, factors: tuple[Factor, ...]) -> list[tuple[Node, tuple]]:
    where = {axis: p for p, axis in enumerate(state_axes) if axis is not None}
    out = []
    for factor in factors:
        if any(a is not None and a not in where for a in factor.axes):
            raise Declined(f"{factor.node.name} has a dimension the state does not have")
        out.append((factor.node, tuple(where.get(a) if a is not None else None for a in factor.axes)))
    return out


def _match_steps(role: str, per_step: list[list[tuple[Node, tuple]]], memo: dict):
    """The role's factors lined up across steps, and the step offsets they index (position - step).

    Steps that differ are read again with the values they share made step-invariant and each index of
    several numbers read at the one that changes (NOTE [values every step reads], NOTE [an index of several
    numbers] in `laplace_passes.fx.per_step`).
    """
    try:
        return _line_up(role, per_step, memo)
    except Declined:
        nodes = [[n for n, _ in f] for f in per_step]
        # Both readings, each where it applies (`|`, not `or`): one step may need them together.
        if len(per_step) < 2 or not (shared_by_steps(nodes, memo) | positions_in_several_numbers(nodes, memo)):
            raise
    return _line_up(role, per_step, memo)


def _line_up(role: str, per_step: list[list[tuple[Node, tuple]]], memo: dict):
    def signature(factors):
        return sorted(((repr(pattern(n, memo).key), pos), n) for n, pos in factors)

    reference = signature(per_step[0])
    lined_up = [[n] for _, n in reference]
    offsets = set()
    for index, factors in enumerate(per_step):
        found = signature(factors)
        if [key for key, _ in found] != [key for key, _ in reference]:
            raise Declined(unlike_step_0(index, role, [n for _, n in found], [n for _, n in reference], memo))
        for column, (_, node) in enumerate(found):
            steps = set(pattern(node, memo).steps)
            if len(steps) > 1:
                raise Declined(f"{node.name} reads two positions at step {index}")
            offsets |= {p - index for p in steps}
            if index:
                lined_up[column].append(node)
    factors = [RoleFactors(nodes, pos) for nodes, ((_, pos), _) in zip(lined_up, reference)]
    return factors, offsets


def _set_offset(loop: TokenLoop, offsets: set[int]) -> None:
    if len(offsets) > 1:
        reverse = any(o != min(offsets) for o in offsets)
        raise Declined("its steps read their inputs at positions that do not advance with the step"
                       + (" (a loop that runs backwards, or inputs shifted against each other)" if reverse else ""))
    loop.offset = offsets.pop() if offsets else 0
    for factors in loop.roles.values():
        for factor in factors:
            value = fake_tensor(factor.nodes[0])
            if value is None:
                raise Declined(f"{factor.nodes[0].name} has no shape")


def _set_coefficients(loop: TokenLoop) -> None:
    chain = loop.chain
    for name, values in (("input", [s.input_coef for s in chain.steps]),
                         ("decay", [s.decay_coef for s in chain.steps[1:] or chain.steps]),  # step 0: below
                         ("scale", [r.coef for r in chain.readouts] or [1.0]),
                         *((f"bonus{i}", [r.bonus[i].coef for r in chain.readouts])
                           for i in range(len(chain.readouts[0].bonus) if chain.readouts else 0))):
        if len(set(values)) > 1:
            what = "readout's bonus term" if name.startswith("bonus") else name
            start = 1 if name == "decay" else 0  # step 0's decay reads the initial state: below
            first = next(i for i, value in enumerate(values) if value != values[0])
            raise Declined(f"its {what} coefficient changes from step to step ({values[0]} at step {start}, "
                           f"{values[first]} at step {start + first})")
        loop.coefs[name] = values[0]
    if loop.coefs["decay"] <= 0:
        raise Declined(f"its decay coefficient {loop.coefs['decay']} is not positive (GLA decays lie in (0, 1])")
    # The first step may read its initial state times a number (S = 0.1 * ones; S = S * a + k v): the
    # initial state is that product.
    loop.coefs["initial"] = chain.first.decay_coef / loop.coefs["decay"]


def _refuse_growing_decays(loop: TokenLoop) -> None:
    """A decay exp(x) with x >= 0 by construction is >= 1: the loop is not GLA (whose gates are <= 0), and a
    run-time gate check would refuse every call."""
    exponent = decay_exponent(loop)
    if exponent is None:
        return
    bound = gate_bound(exponent[0])
    if bound.sign == NONNEGATIVE:
        raise Declined(f"its decay is exp of a value >= 0 by construction ({bound.how}): decays >= 1 grow the "
                       "state, where GLA's decays lie in (0, 1]")


def _initial_state(chain: Chain) -> Node | None:
    prev = chain.first.prev
    if prev is None or _is_zero_fill(prev):
        return None
    return prev


def _is_zero_fill(node: Node) -> bool:
    if node.op == "call_method":
        return node.target in _ZERO_FILL_METHODS
    if node.op != "call_function":
        return False
    if node.target in _ZERO_FILLS:
        return True
    return node.target in (torch.full, aten.full.default) and len(node.args) > 1 and node.args[1] == 0


def _readout_layout(chain: Chain) -> tuple:
    layouts = set()
    for readout in chain.readouts:
        where = {axis: p for p, axis in enumerate(readout.state_axes) if axis is not None}
        if any(a is not None and a not in where for a in readout.expr.axes):
            raise Declined(f"the readout {readout.node.name} has a dimension the state does not have")
        layouts.add(tuple(where.get(a) if a is not None else None for a in readout.expr.axes))
    if len(layouts) != 1:
        raise Declined("its readouts lay out their results differently from step to step")
    return layouts.pop()


def decay_exponent(loop: TokenLoop) -> list[Node] | None:
    """The per-step x of a decay written exp(x) (its one factor), so that gk = x without a log."""
    factors = loop.roles.get("decay", [])
    if len(factors) != 1:
        return None
    nodes = factors[0].nodes
    if all(_is_exp(n) for n in nodes):
        return [n.args[0] for n in nodes]
    return None


def _is_exp(node: Node) -> bool:
    if node.op == "call_method":
        return node.target == "exp" and len(node.args) == 1
    return node.op == "call_function" and node.target in _EXPS and len(node.args) == 1 and not node.kwargs


def describe(loop: TokenLoop, origin: str) -> str:
    """What the report says of a recognised loop: how it was written, its gates, its layout."""
    decay = loop.roles.get("decay", [])
    if not decay:
        gates = "no gate" if loop.coefs["decay"] == 1 else f"a fixed decay {loop.coefs['decay']:.4g}"
    elif any(loop.key_axis in f.positions for f in decay):
        gates = "per-key gates"
    else:
        gates = "per-head scalar gates"
    state = list(loop.state_shape)
    skips = ", steps skipped by a select" if "skip" in loop.roles else ""
    skips += ", states reset by a select" if "reset" in loop.roles else ""
    skips += ", each state read out before its update" if loop.chain.read_before_update else ""
    skips += ", a bonus term in the readout" if bonus_roles(loop) else ""
    return (f"{origin}, {loop.T} steps, {gates}{skips}, state {state} (key dim {loop.key_axis}, "
            f"value dim {loop.value_axis})")
