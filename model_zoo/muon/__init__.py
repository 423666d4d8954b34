"""Data-parallel (ZeRO-1) sharded Muon, written the way users write it.

``ShardedMuon`` is a drop-in for :class:`torch.optim.Muon` in data-parallel
training over W ranks (the traffic model: docs/DESIGN.md section 5)::

    opt = ShardedMuon(model.parameters(), lr=0.02, comm="all_gather")
    loss.backward()          # each rank: its local gradient
    opt.step()               # all ranks: identical updated parameters

Parameters are replicated on every rank, each rank's ``.grad`` is local.
One ``step()``:

1. 2D ("Muon") parameters: the gradients are reduce-scattered and averaged,
   so each rank holds the average gradient for its *row shard* of every
   matrix.  Rows are split as evenly as possible (the first ``rows % W``
   ranks get one more row); every shard is zero-padded to
   ``ceil(rows / W)`` rows so all collectives see equal sizes and every rank
   holds tensors of identical shapes.  Momentum lives only for the own shard.
2. ``muon_shard_step`` (the compile target, see below) updates the momentum
   shard, orthogonalises with Newton-Schulz, which needs whole matrices, and
   returns new momentum and parameter shards.  Two ways to get whole
   matrices (``comm=``):

   * ``"all_gather"``: every rank all-gathers every (bf16) momentum-updated
     matrix, runs Newton-Schulz on all of them redundantly and keeps its own
     rows of each result.  Collectives: one ``all_gather_into_tensor``.
   * ``"gather_broadcast"``: each matrix has an owner rank (greedy balance
     by Newton-Schulz cost).  The matrices are gathered (expressed as one
     ``all_gather_into_tensor``, there is no functional gather), only the
     owner orthogonalises a matrix, and each owner ``broadcast``s its results
     to everyone, who keep their own rows.  Collectives: one
     ``all_gather_into_tensor`` + one ``broadcast`` per owner rank.

3. The new parameter shards are all-gathered so every rank has the full,
   identical parameters.
4. Non-2D parameters (and any group with ``use_muon=False``) use AdamW
   (``torch.optim.AdamW`` semantics, via ``torch.optim.adamw.adamw``): the
   gradients are all-reduced and averaged, and every rank updates them
   identically.

All collectives are functional collectives: the ``_c10d_functional.*`` ops
that ``torch.distributed._functional_collectives`` issues, each followed by
``_c10d_functional.wait_tensor``, i.e. exactly the nodes a ``torch.compile``
FX graph holds.  The Newton-Schulz communication lives entirely in
``muon_shard_step``, a pure function of tensors.  With ``backend=None`` it runs eagerly; with any other
``backend`` it is run through ``torch.compile(muon_shard_step,
backend=backend, dynamic=False)``; ``backend="laplace"`` rewrites its
gathers into two ``all_to_all_single`` with one owner per matrix
(``laplace_passes.collectives``; bit-identical results).

Numerics: Newton-Schulz always runs on the *same full matrix* (same shape,
same bf16 values) as ``torch.optim.Muon`` would, and every other operation is
elementwise on row shards, so with the same averaged gradient the result is
bit-identical to ``torch.optim.Muon`` (+ ``torch.optim.AdamW``) on the full
parameters.  The gradient average is a sum over ranks divided by W; its
summation order is the collective's, so for arbitrary float gradients it
matches a reference average only up to fp32 rounding.  A Tensor ``lr`` is
used as torch.optim.Muon uses it (step sizes computed in its dtype).

bf16 parameters: ShardedMuon's compiled step equals its eager step bit for
bit, but not ``torch.optim.Muon``, for two reasons in PyTorch's Muon itself:
with ``nesterov=True`` and a tall matrix (rows > cols) it adds the transposed
view Newton-Schulz returns, and PyTorch's bf16 ``add_(other, alpha=...)``
rounds a transposed ``other`` differently from a contiguous one (ShardedMuon
adds row shards, contiguous); with ``nesterov=False`` its Newton-Schulz
normalises the bf16 momentum buffer itself in place (``grad.bfloat16()`` is
no copy for bf16), which ShardedMuon does not, so the momenta drift apart.
Wide and square bf16 matrices with ``nesterov=True`` are bit-identical.
float32 parameters are bit-identical in every case.

Failure handling: everything a step computes goes into temporaries; the
parameters and optimizer state are written only after the step's last
collective has completed.  Any exception during the step (a local error, a
peer that closed its connection, or a collective that ran past the process
group timeout because a peer hung) is raised as :class:`ShardedMuonStepError`
on that rank, with parameters and state unchanged.  A failing rank never
reaches the final all-gather, so every other rank fails in a collective and
raises too.  (Whatever happens after the last collective is local copying.)

Requirements: every rank builds ShardedMuon over the same parameters (same
count, order, shapes and dtypes), replicated (the same values) at the first
step, and calls ``step()`` the same number of times with the same set of
parameters having a ``.grad`` (``None`` grads are skipped, as in
``torch.optim.Muon``).  A step first checks that the ranks agree, with one
small all-gather of a fixed-size summary, and the first step also compares
each parameter's sum and sum of squares; if they disagree every rank raises
a :class:`ShardedMuonRanksDisagreeError` (``ShardedMuonParamLayoutError``,
``ShardedMuonGradLayoutError`` or ``ShardedMuonUnreplicatedError``) naming
the first difference, before anything is modified (NOTE [ranks agree before
the step's collectives] in ``rank_checks``).  The optimizer state of a Muon
parameter is this rank's padded momentum shard, so ``state_dict()`` is per
rank: it records the rank and world size it was saved at, and
``load_state_dict`` refuses it on another rank or at another world size
(``dcp_state_dict`` resumes at any).  At W=1 it is the same as
``torch.optim.Muon``'s, and a state saved at W=1, or by
``torch.optim.Muon``, loads at any W, each rank keeping its own rows.
``dcp_state_dict`` / ``load_dcp_state_dict`` are the
``torch.distributed.checkpoint`` path, loadable at any world size
(``checkpoint``).

Modules: ``hparams`` (Muon's and AdamW's settings and checks; ``StepSizes``,
what a compiled step takes as an input so that a schedule does not recompile it),
``collectives`` (the row layout over ranks and the collectives that move
rows), ``shard_step`` (``muon_shard_step``, what is compiled),
``optimizer`` (``ShardedMuon``), ``checkpoint`` (its state for DCP),
``rank_checks`` (what a step checks across ranks first, and its errors).
"""

from model_zoo.muon.collectives import RowSplit
from model_zoo.muon.hparams import MuonConstants, MuonHParams, StepSizes, adjust_lr
from model_zoo.muon.optimizer import ShardedMuon
from model_zoo.muon.rank_checks import (
    ShardedMuonGradLayoutError,
    ShardedMuonParamLayoutError,
    ShardedMuonRanksDisagreeError,
    ShardedMuonStepError,
    ShardedMuonUnreplicatedError,
)
from model_zoo.muon.shard_step import COMM_MODES, assign_owners, muon_shard_step, newton_schulz

__all__ = [
    "COMM_MODES",
    "MuonConstants",
    "MuonHParams",
    "RowSplit",
    "ShardedMuon",
    "ShardedMuonGradLayoutError",
    "ShardedMuonParamLayoutError",
    "ShardedMuonRanksDisagreeError",
    "ShardedMuonStepError",
    "ShardedMuonUnreplicatedError",
    "StepSizes",
    "adjust_lr",
    "assign_owners",
    "muon_shard_step",
    "newton_schulz",
]
