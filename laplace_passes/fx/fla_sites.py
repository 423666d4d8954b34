"""Make flash-linear-attention's GLA calls single, recognisable graph nodes.

Dynamo would otherwise trace into fla: `naive_recurrent_gla` becomes T copies
of its loop body, `chunk_gla` / `fused_recurrent_gla` reach Triton kernels
that need a GPU. We register Dynamo substitutions (`substitute_in_graph`) that
replace each call by one `laplace::gla` node whose `origin` names the fla
function, with fla's semantics: default scale K**-0.5, state [B, H, K, V] in
fp32, the `(o, final_state or None)` tuple.

Calls using features the op does not model (variable-length `cu_seqlens`,
`state_v_first`, `gv`, `reverse`) are left to fla itself: they run eagerly
through a graph break, never silently changed.

Substitutions are process-wide Dynamo state, so they are installed on demand
(`install()`), never as an import side effect of fla; while installed, an fla
call compiled by *another* backend runs the `laplace::gla` reference
implementation.
"""

from __future__ import annotations

import importlib
import sys

import torch

from laplace_passes.gla import gla_op

_INSTALLED: set[str] = set()
_BEFORE_LAST_INSTALL: list[str] = []


def install(import_fla: bool = False) -> list[str]:
    """Register the substitutions; return the fla functions now covered.

    With `import_fla=False` only an fla already imported is covered, so
    merely looking up the backend never imports fla.
    """
    _BEFORE_LAST_INSTALL[:] = sorted(_INSTALLED)
    if not import_fla and "fla" not in sys.modules:
        return sorted(_INSTALLED)
    try:
        naive = importlib.import_module("fla.ops.gla.naive")
        chunk = importlib.import_module("fla.ops.gla.chunk")
        fused = importlib.import_module("fla.ops.gla.fused_recurrent")
    except ImportError:
        return sorted(_INSTALLED)
    for name, original, make in (
        ("fla.naive_recurrent_gla", naive.naive_recurrent_gla, _naive_substitute),
        ("fla.chunk_gla", chunk.chunk_gla, _chunk_substitute),
        ("fla.fused_recurrent_gla", fused.fused_recurrent_gla, _fused_recurrent_substitute),
    ):
        if name not in _INSTALLED:
            torch._dynamo.substitute_in_graph(original)(make(original))
            _INSTALLED.add(name)
    return sorted(_INSTALLED)


def covered_before_install() -> list[str]:
    """What was covered before the latest `install()` call: tells whether it added anything."""
    return list(_BEFORE_LAST_INSTALL)


def _site(q, k, v, gk, scale, initial_state, output_final_state, origin):
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, final_state = gla_op(q, k, v, gk, initial_state, scale, origin)
    return o, (final_state if output_final_state else None)


def _naive_substitute(original):
    def naive_recurrent_gla(q, k, v, gk, initial_state=None, output_final_state=False):
        return _site(q, k, v, gk, None, initial_state, output_final_state, "fla.naive_recurrent_gla")

    return naive_recurrent_gla


def _chunk_substitute(original):
    run_in_fla = torch.compiler.disable(original, reason="fla feature not modelled by laplace::gla")

    def chunk_gla(
        q, k, v, g, scale=None, initial_state=None, output_final_state=False,
        state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
    ):
        if state_v_first or cu_seqlens is not None or cu_seqlens_cpu is not None:
            return run_in_fla(q, k, v, g, scale, initial_state, output_final_state,
                              state_v_first, cu_seqlens, cu_seqlens_cpu)
        return _site(q, k, v, g, scale, initial_state, output_final_state, "fla.chunk_gla")

    return chunk_gla


def _fused_recurrent_substitute(original):
    run_in_fla = torch.compiler.disable(original, reason="fla feature not modelled by laplace::gla")

    def fused_recurrent_gla(
        q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
        reverse=False, state_v_first=False, cu_seqlens=None, **kwargs,
    ):
        if gk is None or gv is not None or reverse or state_v_first or cu_seqlens is not None or kwargs:
            return run_in_fla(q, k, v, gk, gv, scale, initial_state, output_final_state,
                              reverse, state_v_first, cu_seqlens, **kwargs)
        return _site(q, k, v, gk, scale, initial_state, output_final_state, "fla.fused_recurrent_gla")

    return fused_recurrent_gla
