"""Passes read symbolic sizes without adding guards.

NOTE [passes add no guards]: a graph traced with dynamic sizes holds SymInts
(`s0` for a batch marked dynamic) where the static graph holds ints. Every
question Python asks of one (`==`, `<`, `int()`, `bool()`) goes to the
ShapeEnv, which answers with this call's size and records the answer as a
guard: the compiled graph then runs only for sizes that answer the same
way. A pass that compared shapes to find a loop's state asked, at a batch of
64 sequences of a model 64 wide, "is s0 == 64?", and specialised the batch:
Dynamo would compile again for every other batch, and where the batch is
marked dynamic (`torch._dynamo.mark_dynamic`; the decode step marks it) the
compile failed with a ConstraintViolationError, in `model.generate` at 64
and 128 sequences.

What a pass decides must hold for every size the graph will run at. So:

* passes compare sizes with `same_size` and `same_shape`, true only where the
  ShapeEnv proves it without a guard (`s0 == s0`; never `s0 == 64`);
* `run_pass` (which `run_passes` calls for each pass) runs every pass under
  `refusing_new_guards`: a question only a guard could answer raises
  `WouldSpecialise` before anything is recorded, and the pass declines for
  that graph (NOTE [a failing pass declines]) with the question in the
  report, the user's graph going on unspecialised. In strict mode (the test
  suite) it raises, so that such questions are found.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv, statically_known_true
from torch.utils import _pytree as pytree

from laplace_passes.infra.fx_helpers import fake_value


class WouldSpecialise(RuntimeError):
    """A pass asked a question of a symbolic size that only a guard could answer."""

    def __init__(self, expression: sympy.Basic, shape_env: ShapeEnv) -> None:
        sizes = ", ".join(f"{symbol} = {shape_env.backed_var_to_val[symbol]}"
                          for symbol in sorted(expression.free_symbols, key=str)
                          if symbol in shape_env.backed_var_to_val)
        seen = f" ({sizes} in this call)" if sizes else ""
        super().__init__(f"the pass asked whether {expression}{seen}, which holds for some sizes of this "
                         "dynamic graph and not others: answering would specialise the graph to this call's "
                         "sizes (NOTE [passes add no guards])")
        self.expression = expression


def shape_env_of(gm: torch.fx.GraphModule) -> ShapeEnv | None:
    """The ShapeEnv behind the symbolic sizes in `gm`'s fake values; None when every size is static."""
    for node in gm.graph.nodes:
        for value in pytree.tree_leaves(fake_value(node)):
            env = _shape_env_of_value(value)
            if env is not None:
                return env
    return None


@contextlib.contextmanager
def refusing_new_guards(shape_env: ShapeEnv | None) -> Iterator[None]:
    """Within: a question about symbolic sizes that `shape_env` cannot answer from what it already knows
    raises `WouldSpecialise` instead of adding a guard; `guard_or_false`/`guard_or_true` get their
    fallback. Questions it can answer (`s0 == s0`, `s0 >= 2` for a batch marked dynamic) are answered."""
    if shape_env is None or "evaluate_expr" in vars(shape_env):  # no symbols, or already refusing
        yield
        return
    evaluate = shape_env.evaluate_expr

    def evaluate_without_guard(orig_expr, hint=None, fx_node=None, size_oblivious=False, fallback_value=None,
                               *, forcing_spec=False):
        if _known(shape_env, orig_expr, size_oblivious):
            return evaluate(orig_expr, hint, fx_node, size_oblivious, fallback_value, forcing_spec=forcing_spec)
        if fallback_value is not None:
            return sympy.true if fallback_value else sympy.false
        raise WouldSpecialise(orig_expr, shape_env)

    shape_env.evaluate_expr = evaluate_without_guard
    try:
        yield
    finally:
        del shape_env.evaluate_expr


def same_size(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or SymInts) are equal for every size the graph runs at; adds no guard."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def same_shape(a: Sequence | None, b: Sequence | None) -> bool:
    """`same_size` for every dimension of two shapes (None: no shape, equal to nothing)."""
    return a is not None and b is not None and len(a) == len(b) and all(map(same_size, a, b))


def _known(shape_env: ShapeEnv, expression: Any, size_oblivious: bool) -> bool:
    """Whether the ShapeEnv answers `expression` without a guard: the static evaluation its own
    `evaluate_expr` tries first (torch 2.13; tests/test_guards.py shows it still answers `s0 >= 2`)."""
    if isinstance(expression, (sympy.logic.boolalg.BooleanTrue, sympy.logic.boolalg.BooleanFalse)) \
            or getattr(expression, "is_number", False):
        return True
    return shape_env._maybe_evaluate_static(expression, size_oblivious=size_oblivious) is not None


def _shape_env_of_value(value: Any) -> ShapeEnv | None:
    if isinstance(value, torch.Tensor):
        sizes = [*value.shape, *(value.stride() if value.layout == torch.strided else ())]
        return next((s.node.shape_env for s in sizes if isinstance(s, torch.SymInt)), None)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.shape_env
    return None
