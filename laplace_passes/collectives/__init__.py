"""Collective rewrites: Muon's gather-and-orthogonalise into paired all-to-alls.

    from laplace_passes.collectives import rewrite_muon_step
    result = rewrite_muon_step(aten_graph_module, world_size=8)   # in place
    result.modified, result.declined, result.traffic

The `laplace` backend runs the same pass (`RewriteMuonStep`) on every
inference graph that holds a gather or Newton-Schulz, unless
`options={"muon_all_to_all": False}`. See `rewrite.py` for the graphs before
and after, `match.py`, `own_rows.py` and `newton_schulz.py` for what is matched,
`plan.py` for ownership, `traffic.py` for the byte accounting.
"""

from laplace_passes.collectives.newton_schulz import find_newton_schulz, newton_schulz_flops
from laplace_passes.collectives.plan import OwnershipPlan, plan_ownership
from laplace_passes.collectives.rewrite import RewriteMuonStep, is_candidate, rewrite_muon_step
from laplace_passes.collectives.traffic import collective_bytes

__all__ = [
    "OwnershipPlan",
    "RewriteMuonStep",
    "collective_bytes",
    "find_newton_schulz",
    "is_candidate",
    "newton_schulz_flops",
    "plan_ownership",
    "rewrite_muon_step",
]
