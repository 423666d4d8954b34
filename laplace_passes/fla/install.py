"""Installing the replacements: which fla function gets which, and how.

NOTE [how fla calls are replaced]
Three mechanisms, each where it is the one that works:

* Dynamo substitutions (`torch._dynamo.substitute_in_graph`) for fla's
  functions: while Dynamo traces, a call to the fla function traces the
  replacement instead, so the call becomes ordinary graph nodes (a
  `laplace::gla` site for GLA). This keys on the function object, so it
  holds however the function was imported, and leaves eager fla untouched.
* Class attributes for the two loss modules whose `forward` Dynamo cannot
  substitute (it does not substitute nn.Module methods): fla's
  `FusedCrossEntropyLoss.forward` asserts CUDA, `FusedLinearCrossEntropyLoss.forward`
  is `torch.compiler.disable`d. The new `forward` runs the replacement
  when compiling or on a device without Triton, fla's own otherwise.
* fla's own backend registry (`fla.backends`) only as the safety net
  (`not_replaced.guard_fla_kernels`). Registering the replacements there
  was considered and rejected: fla wraps every dispatched function in
  `torch.compiler.disable`, so a registered replacement would run outside
  the graph (a graph break per call: nothing to re-tile, nothing in the
  exported StableHLO); the dispatch points are fla-internal kernel
  functions inside fla's autograd.Functions, while `chunk_gla`,
  `rms_norm` and the others users call are not dispatched at all.

Substitutions and class attributes are process-wide; they are installed on
demand, when a compile starts (`install()`, called from one place:
`laplace_passes.driver.compile_fx.prepare_to_trace`), never as a side effect
of importing laplace_passes. An fla not yet imported when a compile starts is
covered as its import finishes (`laplace_passes.fla.late_import`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import torch

from laplace_passes.fla import activations, conv, family_calls, gla_calls, losses, norms, shared_ops
from laplace_passes.fla.not_replaced import guard_fla_kernels, triton_can_run

# Every fla function replaced, by qualified name -> its replacement.
FUNCTIONS = {**norms.SUBSTITUTES, **activations.SUBSTITUTES, **conv.SUBSTITUTES, **losses.SUBSTITUTES,
             **shared_ops.SUBSTITUTES, **family_calls.SUBSTITUTES}
# Replacements that need the original (to hand unsupported calls back to fla).
FACTORIES = {**gla_calls.SUBSTITUTE_FACTORIES, **family_calls.SUBSTITUTE_FACTORIES}
# nn.Module methods replaced on their class.
METHODS = dict(losses.METHODS)

_INSTALLED: dict[str, str] = {}  # qualified name -> "replaced" or why not
_BEFORE_LAST_INSTALL: list[str] = []


def install(import_fla: bool = False) -> list[str]:
    """Install every replacement not yet installed; return the fla calls now replaced.

    With `import_fla=False` only an fla already imported is covered, so merely
    looking up the backend never imports fla.
    """
    _BEFORE_LAST_INSTALL[:] = replaced()
    if not import_fla and "fla" not in sys.modules:
        return replaced()
    if importlib.util.find_spec("fla") is None:
        return replaced()
    for name in [*FUNCTIONS, *FACTORIES, *METHODS]:
        if name not in _INSTALLED:
            _INSTALLED[name] = _install_one(name)
    guard_fla_kernels()
    return replaced()


def replaced() -> list[str]:
    """The fla calls replaced now, by short name ("fla.chunk_gla", "fla.FusedCrossEntropyLoss.forward")."""
    return sorted(short_name(name) for name, status in _INSTALLED.items() if status == "replaced")


def not_installed() -> dict[str, str]:
    """fla calls a replacement exists for but which could not be installed, with the reason."""
    return {short_name(name): status for name, status in _INSTALLED.items() if status != "replaced"}


def short_name(qualified: str) -> str:
    """'fla.modules.norm.layernorm.rms_norm' -> 'fla.rms_norm'; methods keep their class."""
    parts = qualified.split(".")
    keep = 2 if qualified in METHODS else 1
    return ".".join(["fla", *parts[-keep:]])


def covered_before_install() -> list[str]:
    """What was covered before the latest `install()` call: tells whether it added anything."""
    return list(_BEFORE_LAST_INSTALL)


def _install_one(name: str) -> str:
    try:
        owner, attribute, original = _resolve(name)
    except (ImportError, AttributeError) as error:
        return f"not found in the installed fla ({error})"
    if name in METHODS:
        setattr(owner, attribute, _method(original, METHODS[name]))
        return "replaced"
    substitute = FACTORIES[name](original) if name in FACTORIES else FUNCTIONS[name]
    try:
        torch._dynamo.substitute_in_graph(original)(substitute)
    except (TypeError, ValueError) as error:  # a signature that changed in another fla version
        return f"substitution refused: {error}"
    return "replaced"


def _resolve(name: str):
    """(owner object, attribute name, value) for 'package.module.Attr.attr'."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:-1]:
            owner = getattr(owner, attribute)
        return owner, parts[-1], getattr(owner, parts[-1])
    raise ImportError(f"no module of {name} can be imported")


def _method(original, replacement):
    """A forward that runs `replacement` when compiling or off Triton devices, fla's `original` otherwise."""

    def forward(self, *args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if torch.compiler.is_compiling() or first is None or not triton_can_run(first.device):
            return replacement(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    forward.__doc__ = replacement.__doc__
    forward.__laplace_original__ = original
    return forward
