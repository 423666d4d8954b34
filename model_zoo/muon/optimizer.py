"""ShardedMuon: the optimizer around `muon_shard_step` (see the package docstring for one step)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, _get_scalar_dtype

from model_zoo.muon.checkpoint import load_muon_state_from_dcp, muon_state_for_dcp
from model_zoo.muon.collectives import RowSplit, all_gather_rows, all_reduce_mean, reduce_scatter_mean
from model_zoo.muon.hparams import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    MuonHParams,
    adamw_settings,
    check_group,
    check_muon_hparams,
)
from model_zoo.muon.rank_checks import (
    NOTHING_MODIFIED,
    ShardedMuonRanksDisagreeError,
    ShardedMuonStepError,
    check_ranks_agree,
)
from model_zoo.muon.shard_step import COMM_MODES, assign_owners, muon_shard_step

# The top-level key of ``ShardedMuon.state_dict()`` saying where it was saved (rank and world size).
SAVED_AT = "sharded_muon_saved_at"


@dataclass
class _MuonParams:
    """This step's Muon matrices: parameters, local gradients, settings, row layouts."""

    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    hparams: list[MuonHParams] = field(default_factory=list)
    splits: list[RowSplit] = field(default_factory=list)


@dataclass
class _AdamWParams:
    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)


class ShardedMuon(Optimizer):
    """ZeRO-1 data-parallel Muon (+ AdamW for non-2D parameters).

    Args:
        params: parameters or param groups, as for any torch optimizer.  A
            group may set ``use_muon``: ``None`` (default) = Muon for 2D
            parameters, AdamW otherwise; ``True`` = Muon only (a non-2D
            parameter is an error); ``False`` = AdamW for all (e.g.
            embeddings).  Groups may override ``adamw_lr``, ``adamw_betas``,
            ``adamw_eps``, ``adamw_weight_decay``, ``adamw_amsgrad``.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps,
        ns_steps, adjust_lr_fn: exactly ``torch.optim.Muon``'s, same defaults.
        comm: ``"all_gather"`` or ``"gather_broadcast"`` (module docstring).
        process_group: the data-parallel group; ``None`` = the default group
            if ``torch.distributed`` is initialised, else a single process.
        backend: ``"laplace"`` (default) compiles the shard step with the
            laplace backend (default options: target trn2, whose all-to-all
            takes groups of 4, 8, 16 or multiples of 32 ranks; other world
            sizes keep their gathers, with the reason in the report); a
            configured laplace backend, e.g. ``functools.partial(
            laplace_passes.driver.backend.laplace_backend, options={"target": "cpu"})``;
            any other ``torch.compile`` backend; ``None`` runs it eagerly.
        adamw_kwargs: ``lr``, ``betas``, ``eps``, ``weight_decay``,
            ``amsgrad`` for the AdamW parameters (``torch.optim.AdamW``'s
            defaults otherwise).

    ``step()`` raises :class:`ShardedMuonStepError` (parameters and state
    untouched) if anything fails on this rank or a peer.  For tests,
    ``opt._fault_hook = fn`` is called as ``fn(phase)`` with ``"reduce"``
    (before any collective of the step), ``"shard_step"`` (gradients
    averaged, before the Newton-Schulz collectives) and
    ``"all_gather_params"`` (before the last collective); raising from it
    simulates a rank failing there.

    Compile notes: ``muon_shard_step`` receives the rank as a tensor, so its
    graph is the same on every rank (own rows picked by ``index_select``,
    the owner-only Newton-Schulz of ``gather_broadcast`` in a ``torch.cond``),
    and ``backend="laplace"`` rewrites its gathers into two all-to-alls
    (``laplace_passes.collectives``). Learning rate, weight decay and
    momentum reach the compiled step as a tensor (NOTE [step sizes are
    inputs of the compiled step] in ``model_zoo/muon/hparams.py``): a
    learning-rate schedule, or changing them by hand between steps, runs the
    one compiled graph. The layouts, owners, Nesterov and the Newton-Schulz
    settings are Python constants: changing one compiles a new graph (Dynamo
    stops compiling after its recompile limit). So do the step sizes of
    every matrix when any Muon matrix is not float32: a schedule then
    compiles the step at every new value and, past the recompile limit, runs
    it uncompiled without the all-to-all rewrite (``step`` warns once when
    it sees one change). Shapes are compiled static (``dynamic=False``).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        comm: str = "all_gather",
        process_group: Any = None,
        backend: str | Callable | None = "laplace",
        adamw_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if comm not in COMM_MODES:
            raise ValueError(
                f"ShardedMuon: unknown comm={comm!r}; expected one of {', '.join(map(repr, COMM_MODES))}"
            )
        if backend is not None and not (isinstance(backend, str) or callable(backend)):
            raise TypeError(
                f"ShardedMuon: backend must be None, a torch.compile backend name or a callable, got {backend!r}"
            )
        check_muon_hparams(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn)
        adamw = adamw_settings(adamw_kwargs)
        self.comm = comm
        self.backend = backend
        self.process_group, self.rank, self.world_size = self._resolve_group(process_group)
        self._step_fn: Callable | None = None
        self._rank_tensors: dict[torch.device, Tensor] = {}
        # Testing hook: called with a phase name at points inside step()
        # ("reduce", "shard_step", "all_gather_params"); raising from it
        # simulates a rank failing mid-step.
        self._fault_hook: Callable[[str], None] | None = None
        self._replicas_checked = False  # the parameters' values compared across ranks (at the first step)
        # Each Muon matrix's step sizes at the last compiled step where they were constants, by parameter.
        self._constant_sizes: dict[int, Any] = {}
        self._warned_recompiles = False
        defaults = {
            "lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients), "eps": eps, "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn, "use_muon": None,
            **{f"adamw_{k}": v for k, v in adamw.items()},
        }
        super().__init__(params, defaults)

    # ---- setup ---------------------------------------------------------

    @staticmethod
    def _resolve_group(process_group):
        import torch.distributed as dist

        if process_group is None:
            if dist.is_available() and dist.is_initialized():
                process_group = dist.group.WORLD
            else:
                return None, 0, 1
        else:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "ShardedMuon: process_group was given but torch.distributed is not initialised"
                )
            if process_group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns outside the group
                raise ValueError(
                    f"ShardedMuon: this process (global rank {dist.get_rank()}) is not a member of process_group "
                    "(dist.new_group returned GroupMember.NON_GROUP_MEMBER here); create ShardedMuon only on "
                    "the group's members"
                )
            if not isinstance(process_group, dist.ProcessGroup):
                raise TypeError(
                    "ShardedMuon: process_group must be a torch.distributed.ProcessGroup, "
                    f"got {type(process_group).__name__}"
                )
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise ValueError("ShardedMuon: this process is not a member of process_group")
        world = dist.get_world_size(process_group)
        if world == 1:
            return None, 0, 1
        return process_group, rank, world

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._replicas_checked = False  # the next step compares the new parameters' values across ranks too
        group = self.param_groups[-1]
        group["ns_coefficients"] = tuple(group["ns_coefficients"])
        group["adamw_betas"] = tuple(group["adamw_betas"])
        check_group(group)
        for p in group["params"]:
            if torch.is_complex(p):
                raise ValueError("ShardedMuon does not support complex parameters")
            if group["use_muon"] and p.ndim != 2:
                raise ValueError(
                    "ShardedMuon: Muon only supports 2D parameters, but a param group with "
                    f"use_muon=True has a parameter of size {tuple(p.shape)}; leave use_muon "
                    "unset to send non-2D parameters to AdamW"
                )

    # ---- state ---------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``Optimizer.state_dict`` plus where it was saved: ``SAVED_AT`` = {"rank": r, "world_size": W}.

        A Muon matrix's state is this rank's padded momentum rows (the whole matrix at W = 1), so the state
        belongs to this rank at this world size; ``load_state_dict`` checks it. ``Optimizer.load_state_dict``
        (torch.optim.Muon's too) ignores the extra top-level key.
        """
        return {**super().state_dict(), SAVED_AT: {"rank": self.rank, "world_size": self.world_size}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``Optimizer.load_state_dict``, also accepting ``torch.optim.Muon``'s state_dict.

        Muon's param groups lack ShardedMuon's keys (``use_muon``,
        ``adamw_*``): they keep this optimizer's values. Muon's momentum is
        the whole matrix, as is a ShardedMuon's saved at world size 1; at
        W > 1 each rank keeps its own padded rows. A state saved at another
        rank or world size W > 1 is refused (before anything is modified):
        its rows are another rank's.
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"ShardedMuon.load_state_dict: {len(groups)} param groups in the state_dict, "
                             f"{len(self.param_groups)} in this optimizer")
        saved_at = state_dict.get(SAVED_AT)
        self._check_saved_at(saved_at)
        whole_matrices = any("use_muon" not in g for g in groups) or (saved_at or {}).get("world_size") == 1
        filled = [{**{k: v for k, v in mine.items() if k != "params"}, **saved}
                  for mine, saved in zip(self.param_groups, groups)]
        super().load_state_dict({**state_dict, "param_groups": filled})
        for group in self.param_groups:
            group["ns_coefficients"] = tuple(group["ns_coefficients"])
            group["adamw_betas"] = tuple(group["adamw_betas"])
            check_group(group)
        if whole_matrices and self.world_size > 1:
            self._keep_own_momentum_rows()

    def _check_saved_at(self, saved_at: dict[str, int] | None) -> None:
        """Refuse a state saved at another rank or world size W > 1 (one without ``SAVED_AT`` is taken as it is)."""
        if saved_at is None or saved_at["world_size"] == 1:
            return
        if (saved_at["rank"], saved_at["world_size"]) != (self.rank, self.world_size):
            raise ValueError(
                f"ShardedMuon.load_state_dict: this state_dict was saved on rank {saved_at['rank']} of world size "
                f"{saved_at['world_size']}, and this is rank {self.rank} of world size {self.world_size}: its "
                "momentum is the saving rank's rows of each matrix. Load on every rank the state_dict that rank "
                "saved, at the same world size; to resume at another world size (or from one rank's file), save "
                "with dcp_state_dict() and torch.distributed.checkpoint, and load with load_dcp_state_dict(). "
                "Nothing was loaded."
            )

    def _keep_own_momentum_rows(self) -> None:
        """Whole-matrix momentum (torch.optim.Muon's) -> this rank's padded rows."""
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state[p].get("momentum_buffer") if p in self.state else None
                if buf is not None and self._is_muon(group, p) and tuple(buf.shape) == tuple(p.shape):
                    self.state[p]["momentum_buffer"] = RowSplit(*p.shape, self.world_size).own(buf, self.rank)

    def dcp_state_dict(self, names: dict[Tensor, str]) -> dict[str, Any]:
        """This rank's state for ``torch.distributed.checkpoint``, loadable at any world size.

        ``names`` maps every parameter to its name (``{p: n for n, p in
        model.named_parameters()}``). A collective at W > 1 (all ranks call
        it). Pass the result to ``dcp.save``, or to ``dcp.load`` and then
        :meth:`load_dcp_state_dict`. See ``model_zoo.muon.checkpoint``.
        """
        return muon_state_for_dcp(self, names)

    def load_dcp_state_dict(self, names: dict[Tensor, str], loaded: dict[str, Any]) -> None:
        """Take the state ``dcp.load`` filled into a :meth:`dcp_state_dict` template."""
        load_muon_state_from_dcp(self, names, loaded)

    @staticmethod
    def _is_muon(group: dict[str, Any], p: Tensor) -> bool:
        use = group["use_muon"]
        return p.ndim == 2 if use is None else bool(use)

    def _group_timeout(self) -> str:
        try:
            t = self.process_group._get_backend(torch.device("cpu")).options._timeout
            return f"{t.total_seconds():g}s"
        except (AttributeError, RuntimeError):  # a backend without these internals: say it generally
            return "the process group's"

    def _hook(self, phase: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(phase)

    def shard_step_call(self) -> tuple[Callable, tuple]:
        """(the shard step as a function of tensors, this rank's arguments): what `step` compiles.

        For exporting it, e.g. ``laplace_passes.export_stablehlo(fn, *args, target="trn2", out_dir=...)``
        inside the distributed job. The arguments are this rank's shards of the current momenta, gradients
        (not averaged over the ranks: only their shapes matter to an export) and parameters, the rank
        as a tensor and, where the matrices are float32, the step sizes (learning rate, weight decay and
        momentum: an input of the exported module, NOTE [step sizes are inputs of the compiled step]).
        Needs a ``.grad`` on the Muon parameters; modifies nothing.
        """
        muon, _ = self._collect()
        if not muon.params:
            raise ValueError("ShardedMuon.shard_step_call(): no Muon parameter has a .grad (run a backward first)")
        splits = tuple(muon.splits)
        step_sizes, hparams = self._step_size_inputs(muon, compiled=True)
        step = functools.partial(muon_shard_step, splits=splits, hparams=hparams,
                                 owners=assign_owners(splits, self.world_size), comm=self.comm,
                                 world_size=self.world_size,
                                 group=self.process_group.group_name if self.process_group is not None else None)
        own = [lambda full, sp=sp: sp.own(full.detach(), self.rank) for sp in splits]
        args = (self._momentum_shards(muon), [o(g) for o, g in zip(own, muon.grads)],
                [o(p) for o, p in zip(own, muon.params)], self._rank_tensor(muon.params[0].device))
        return step, args if step_sizes is None else (*args, step_sizes)

    def _shard_step(self) -> Callable:
        if self._step_fn is None:
            if self.backend is None:
                self._step_fn = muon_shard_step
            else:
                # Static shapes: the layouts are Python constants anyway, and the
                # collective rewrite plans with concrete sizes.
                self._step_fn = torch.compile(muon_shard_step, backend=self.backend, dynamic=False)
        return self._step_fn

    def _rank_tensor(self, device: torch.device) -> Tensor:
        """This rank as a 0-d int64 tensor: the shard step picks its rows with it (made once per device)."""
        if device not in self._rank_tensors:
            self._rank_tensors[device] = torch.tensor(self.rank, dtype=torch.int64, device=device)
        return self._rank_tensors[device]

    # ---- step ------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One optimisation step on every rank (a collective: all ranks call it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon, adamw = self._collect()
        momentum = self._momentum_shards(muon)
        new_full, new_bufs, adamw_new = self._compute(muon, momentum, adamw)
        # Commit: local copies only, after the step's last collective.
        for p, full, buf in zip(muon.params, new_full, new_bufs):
            p.copy_(full)
            self.state[p]["momentum_buffer"] = buf
        for p, (new_p, new_state) in zip(adamw.params, adamw_new):
            p.copy_(new_p)
            self.state[p].update(new_state)
        return loss

    def _collect(self) -> tuple[_MuonParams, _AdamWParams]:
        """The parameters with a gradient, Muon's (with their settings and row layouts) and AdamW's."""
        muon, adamw = _MuonParams(), _AdamWParams()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("ShardedMuon does not support sparse gradients")
                if self._is_muon(group, p):
                    rows, cols = p.shape
                    muon.params.append(p)
                    muon.grads.append(p.grad)
                    muon.hparams.append(MuonHParams.of(group, rows, cols))
                    muon.splits.append(RowSplit(rows, cols, self.world_size))
                else:
                    adamw.params.append(p)
                    adamw.grads.append(p.grad)
                    adamw.groups.append(group)
        return muon, adamw

    def _momentum_shards(self, muon: _MuonParams) -> list[Tensor]:
        """This rank's padded momentum shard of each Muon matrix (zeros at the first step)."""
        shards = []
        for p, sp in zip(muon.params, muon.splits):
            buf = self.state[p].get("momentum_buffer")
            if buf is None:
                buf = torch.zeros(sp.shard_rows, sp.cols, dtype=p.dtype, device=p.device)
            elif tuple(buf.shape) != (sp.shard_rows, sp.cols):
                raise RuntimeError(
                    f"ShardedMuon: momentum_buffer of a {tuple(p.shape)} parameter has shape "
                    f"{tuple(buf.shape)}, expected this rank's padded shard {(sp.shard_rows, sp.cols)} "
                    f"(world size {self.world_size}); was the state saved with another world size?"
                )
            shards.append(buf)
        return shards

    def _compute(self, muon: _MuonParams, momentum: list[Tensor], adamw: _AdamWParams):
        """Everything the step computes, into temporaries: (full parameters, momentum shards, AdamW updates)."""
        W = self.world_size
        group = self.process_group.group_name if self.process_group is not None else None
        phase = "start"
        try:
            phase = "reduce"  # gradient averaging: all communication before any update
            self._hook(phase)
            # NOTE [ranks agree before the step's collectives]; their values at the first step only.
            check_ranks_agree([p for group in self.param_groups for p in group["params"]], self.rank,
                              self.world_size, self.process_group, check_values=not self._replicas_checked)
            self._replicas_checked = True
            grad_shards = reduce_scatter_mean(muon.grads, muon.splits, W, group)
            adamw_grads = all_reduce_mean(adamw.grads, W, group)
            phase = "shard_step"  # Muon on the own row shards (Newton-Schulz communication inside)
            self._hook(phase)
            new_bufs, new_shards = self._muon_update(muon, momentum, grad_shards, group)
            phase = "adamw"  # local
            adamw_new = self._adamw_compute(adamw.params, adamw_grads, adamw.groups)
            phase = "all_gather_params"  # the last collective: full parameters on every rank
            self._hook(phase)
            new_full = all_gather_rows(new_shards, muon.splits, W, group)
        except ShardedMuonRanksDisagreeError:  # raised on every rank alike, with its own message
            raise
        except Exception as error:  # re-raised as ShardedMuonStepError, saying nothing was modified
            raise self._step_error(phase, error) from error
        return new_full, new_bufs, adamw_new

    def _muon_update(self, muon: _MuonParams, momentum: list[Tensor], grad_shards: list[Tensor], group):
        if not muon.params:
            return [], []
        param_shards = [sp.own(p.detach(), self.rank) for p, sp in zip(muon.params, muon.splits)]
        splits = tuple(muon.splits)
        step_sizes, hparams = self._step_size_inputs(muon, compiled=self.backend is not None)
        if step_sizes is None and self.backend is not None:
            self._warn_if_constant_sizes_change(muon)
        return self._shard_step()(
            momentum, grad_shards, param_shards, self._rank_tensor(muon.params[0].device), step_sizes,
            splits=splits, hparams=hparams, owners=assign_owners(splits, self.world_size),
            comm=self.comm, world_size=self.world_size, group=group,
        )

    @staticmethod
    def _step_size_inputs(muon: _MuonParams, compiled: bool) -> tuple[Tensor | None, tuple]:
        """(step sizes, hyper-parameters) for the shard step.

        A compiled step of float32 matrices reads learning rate, weight decay and momentum from a tensor
        input, so a schedule does not recompile it (NOTE [step sizes are inputs of the compiled step]). Other
        dtypes keep them as constants: `lerp` takes a tensor weight of its input's dtype only, and a bf16
        weight would round the momentum where torch.optim.Muon's float32 arithmetic does not.
        """
        if not compiled or any(p.dtype != torch.float32 for p in muon.params):
            return None, tuple(muon.hparams)
        sizes = torch.tensor([hp.step_sizes() for hp in muon.hparams], dtype=torch.float32,
                             device=muon.params[0].device)
        return sizes, tuple(hp.constants() for hp in muon.hparams)

    def _warn_if_constant_sizes_change(self, muon: _MuonParams) -> None:
        """Warn once when the step sizes change while they are constants of the compiled step (a matrix that is
        not float32, `_step_size_inputs`): each new value compiles the step again."""
        # By parameter: a matrix without a .grad at some step is left out of that step, which changes nothing.
        sizes = {id(p): hp.step_sizes() for p, hp in zip(muon.params, muon.hparams)}
        changed = any(previous != sizes[key] for key, previous in self._constant_sizes.items() if key in sizes)
        self._constant_sizes.update(sizes)
        if not changed or self._warned_recompiles:
            return
        self._warned_recompiles = True
        index = {p: i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        others = ", ".join(f"parameter {index[p]} {tuple(p.shape)} {p.dtype}"
                           for p in muon.params if p.dtype != torch.float32)
        warnings.warn(
            "ShardedMuon: the learning rate, weight decay or momentum changed between steps while Muon matrices "
            f"that are not float32 take part ({others}): then every matrix's step sizes are constants of the "
            "compiled step, so each new value compiles the step again, and past Dynamo's recompile limit "
            f"(torch._dynamo.config.recompile_limit = {torch._dynamo.config.recompile_limit}) the step runs "
            "uncompiled, without the all-to-all rewrite. Keep the Muon matrices in float32 for a schedule to "
            "run one compiled step (NOTE [step sizes are inputs of the compiled step]), or pass backend=None.",
            stacklevel=7,  # the caller of step(): past this, _compute, step, no_grad's and Optimizer's wrappers
        )

    def _step_error(self, phase: str, error: Exception) -> ShardedMuonStepError:
        W = self.world_size
        extra = (
            f" If another rank failed or hung, this rank's collective fails when the peer's "
            f"connection closes or after the process group timeout ({self._group_timeout()})."
            if W > 1
            else ""
        )
        return ShardedMuonStepError(
            f"ShardedMuon.step() failed on rank {self.rank} of {W} during '{phase}' "
            f"(comm={self.comm!r}): {type(error).__name__}: {error}.{extra} {NOTHING_MODIFIED}"
        )

    def _adamw_compute(self, params, grads, groups):
        """torch.optim.AdamW's update, applied to copies; returns (param, state) per param."""
        from torch.optim.adamw import adamw

        out = []
        for p, g, group in zip(params, grads, groups):
            state = self.state[p]
            amsgrad = group["adamw_amsgrad"]
            new_p = p.detach().clone()
            if "step" in state:
                step = state["step"].clone()
                exp_avg = state["exp_avg"].clone()
                exp_avg_sq = state["exp_avg_sq"].clone()
                max_sq = state["max_exp_avg_sq"].clone() if amsgrad else None
            else:
                # as torch.optim.Adam._init_group (non-capturable, non-fused)
                step = torch.tensor(0.0, dtype=_get_scalar_dtype())
                exp_avg = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg_sq = torch.zeros_like(p, memory_format=torch.preserve_format)
                max_sq = torch.zeros_like(p, memory_format=torch.preserve_format) if amsgrad else None
            beta1, beta2 = group["adamw_betas"]
            adamw(
                [new_p],
                [g],
                [exp_avg],
                [exp_avg_sq],
                [max_sq] if amsgrad else [],
                [step],
                foreach=None,
                capturable=False,
                differentiable=False,
                fused=None,
                has_complex=torch.is_complex(p),
                amsgrad=amsgrad,
                beta1=beta1,
                beta2=beta2,
                lr=group["adamw_lr"],
                weight_decay=group["adamw_weight_decay"],
                eps=group["adamw_eps"],
                maximize=False,
            )
            st = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
            if amsgrad:
                st["max_exp_avg_sq"] = max_sq
            out.append((new_p, st))
        return out
