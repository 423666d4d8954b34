"""The main job: train the `tiny` GLA model on MQAR through backend="laplace".

    laplace-passes demo                    # defaults: about a minute of training on 2 CPU cores
    laplace-passes demo --world-size 4     # data-parallel over 4 local gloo processes
    torchrun --standalone --nproc-per-node 4 --no-python laplace-passes demo   # the same, started by torchrun
    laplace-passes demo --model fla-gla-tiny   # flash-linear-attention's own GLAForCausalLM

Each step: the compiled model (GLA re-tiled into chunks of the target's size)
predicts the recalled values, and ShardedMuon updates the hidden matrices
(AdamW the embeddings and norms). At the end: recall accuracy on a fresh
batch against chance and against a random one of the sequence's listed
values (what recall without key-value association reaches), and the pass
report. model_zoo's models are built with `shift_keys` (keys from the
previous token, `model_zoo.gla_lm.GatedLinearAttention`) unless
`shift_keys=False`: without it `tiny` stays at a random listed value's recall.

Data-parallel: under torchrun (one node or several) every process joins the
launcher's gloo group; `--world-size` W > 1 without torchrun starts W local
processes through torch.distributed's elastic launcher
(`laplace_passes.demo.distributed`). `batch` is the *global* batch: each step's
batch is generated from the seed and the step number alone and split over
the ranks, so the same command trains the same way at any world size (the
losses agree up to the order of the gradient sums). ShardedMuon's step is
compiled with the laplace backend too, whose Muon pass rewrites its
all-gather into two all-to-alls (`laplace_passes.collectives`); the report
then shows the step's graph and the traffic per rank before and after. The
step is compiled for target "cpu": its collectives run over gloo on this
machine, and trn2's rule for all-to-all group sizes (4, 8, 16, multiples of
32) would refuse W = 2 or 3. With one process there is no communication to
rewrite and the step runs eagerly.

Checkpoints (`checkpoint_dir`): see `laplace_passes.demo.checkpoint`. A run
whose directory holds a checkpoint resumes from the newest one, at any world
size, and its result lists the losses of every step since step 1.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from laplace_passes.collectives.traffic import muon_saving
from laplace_passes.demo import checkpoint as demo_checkpoint
from laplace_passes.demo.distributed import (LaunchError, join_process_group, launch_local, launcher_rank_and_world,
                                             under_torchrun)
from laplace_passes.infra.files import check_writable_dir
from laplace_passes.infra.process_cpu import usable_cores
from laplace_passes.tools.memory import allocation_failures_as_errors, check_fits


# The model_zoo models the demo trains: GLA LMs (`tiny` calls the GLA op, `plain-tiny` writes the recurrence in
# plain PyTorch) and flash-linear-attention's own GLA-family models.
DEMO_MODELS = ("tiny", "plain-tiny", "fla-gla-tiny", "fla-hgrn2-tiny", "fla-retnet-tiny", "fla-rwkv6-tiny",
               "fla-gsa-tiny", "fla-lightnet-tiny")

# model_zoo's own GLA models, which have GLAConfig.shift_keys; fla's models mix tokens their own way
# (short convolutions, token shift) when their configs ask for it.
SHIFTABLE_MODELS = ("tiny", "plain-tiny")

MEMORY_FIX = "use a smaller --seq-len or --batch"

# What a rank raises about the user's input or files (the settings, a checkpoint, memory): at W > 1 it is
# the same one line as at W = 1, not the launcher's report of every rank's traceback.
_ONE_LINE_ERRORS = ("ValueError", "CheckpointError", "OutputDirError", "OutOfMemory")


@dataclass
class DemoConfig:
    model: str = "tiny"  # one of DEMO_MODELS
    # The defaults: the settings of benchmarks/bench_demo.py's sweep on which `tiny` clearly learns MQAR in
    # about a minute of 2 cores (the README quotes the recall band it measured over threads and seeds).
    steps: int = 200
    batch: int = 32  # the global batch: split over the ranks
    seq_len: int = 32
    num_pairs: int = 8
    target: str = "trn2"
    inner: str = "eager"
    world_size: int = 1  # local processes to start (1 under torchrun: torchrun decides)
    seed: int = 0
    muon_lr: float = 0.02
    adamw_lr: float = 3e-3
    eval_batch: int = 256
    progress: bool = True
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # steps between checkpoints; None: only at the end
    more_steps: int | None = None  # train this many steps past checkpoint_dir's newest checkpoint (`steps` unused)
    recall_every: int | None = None  # steps between evaluations of the recall during training (DemoResult.recalls)
    # Keys from the previous token (GLAConfig.shift_keys). None: on for SHIFTABLE_MODELS. Without it `tiny`
    # recalls no better than a random listed value within the demo's steps (README: the main job).
    shift_keys: bool | None = None

    def __post_init__(self):
        if self.model not in DEMO_MODELS:
            raise ValueError(f"model must be one of {', '.join(DEMO_MODELS)}, got {self.model!r}")
        if self.shift_keys is None:
            self.shift_keys = self.model in SHIFTABLE_MODELS
        if not isinstance(self.shift_keys, bool):
            raise ValueError(f"shift_keys must be True, False or None, got {self.shift_keys!r}")
        if self.shift_keys and self.model not in SHIFTABLE_MODELS:
            raise ValueError(f"shift_keys is an option of model_zoo's models ({', '.join(SHIFTABLE_MODELS)}), "
                             f"not of {self.model}: leave it unset for fla's models")
        for name in ("steps", "batch", "seq_len", "num_pairs", "world_size", "eval_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.checkpoint_every is not None:
            if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 1:
                raise ValueError(f"checkpoint_every must be a positive int, got {self.checkpoint_every!r}")
            if self.checkpoint_dir is None:
                raise ValueError("checkpoint_every needs checkpoint_dir")
        for name in ("more_steps", "recall_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.more_steps is not None and self.checkpoint_dir is None:
            raise ValueError("more_steps counts from a checkpoint: it needs checkpoint_dir")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")

    def check_world_size(self, world_size: int) -> None:
        if self.batch % world_size:
            raise ValueError(f"batch {self.batch} is the global batch and must divide over {world_size} ranks")


@dataclass
class DemoResult:
    losses: list[float]  # one per step, from step 1 (a resumed run includes the checkpoint's)
    accuracy: float
    chance: float
    tokens_per_s: float
    seconds: float
    report: str = ""
    report_dict: dict = field(default_factory=dict)
    # Data-parallel runs: per-rank bytes received by the Muon step, gathers / all-to-alls.
    muon_received_ratio: float | None = None
    muon_ns_work_ratio: float | None = None  # the busiest rank's Newton-Schulz FLOPs, before / after the rewrite
    world_size: int = 1
    resumed_from: int | None = None  # the checkpoint's step this run started from
    recalls: list[tuple[int, float]] = field(default_factory=list)  # (step, recall accuracy): config.recall_every
    listed_chance: float | None = None  # MQARTask.listed_chance: a random one of the sequence's listed values

    def summary(self) -> str:
        muon = ""
        if self.muon_received_ratio is not None:
            muon = f"; Muon step {muon_saving(self.muon_received_ratio, self.muon_ns_work_ratio)} after the rewrite"
        resumed = f" (resumed from step {self.resumed_from})" if self.resumed_from is not None else ""
        listed = f"; a random listed value {self.listed_chance:.1%}" if self.listed_chance is not None else ""
        return (
            f"loss {self.losses[0]:.3f} -> {self.losses[-1]:.3f} over {len(self.losses)} steps{resumed}; "
            f"recall accuracy {self.accuracy:.1%} (chance {self.chance:.1%}{listed}); "
            f"{self.tokens_per_s:,.0f} training tokens/s; {self.seconds:.1f}s on {self.world_size} rank(s){muon}"
        )

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("report")
        return data


def run_demo(config: DemoConfig) -> DemoResult | None:
    """Train; the result on rank 0, None on the other ranks of a torchrun job."""
    config = _with_total_steps(config, _check_settings(config))
    if under_torchrun():
        _, world = launcher_rank_and_world()
        if config.world_size not in (1, world):
            raise ValueError(f"world_size {config.world_size} under torchrun, which started {world} processes: "
                             "leave --world-size out (torchrun's --nproc-per-node and --nnodes decide)")
        config.check_world_size(world)
        return _launched_rank(config)
    config.check_world_size(config.world_size)
    if config.world_size == 1:
        _warn_if_threads_contend()
        return _train(0, 1, config)
    try:
        return launch_local(config.world_size, _launched_rank, config)[0]
    except LaunchError as error:
        refusal = next((f"rank {rank}: {text.partition(': ')[2]}" for rank, text in error.raised.items()
                        if text.partition(": ")[0] in _ONE_LINE_ERRORS), None)
        if refusal is None:
            raise
        raise ValueError(refusal) from None


def _check_settings(config: DemoConfig) -> int | None:
    """What every rank would refuse after its start (a minute each) or after training (the checkpoint
    directory, written at the first save), refused once before any starts; returns the step of the
    checkpoint the run resumes from (None: none)."""
    import model_zoo
    from laplace_passes.driver.backend import compile_config
    from model_zoo.mqar import MQARTask

    vocab_size = model_zoo.build(config.model, device="meta").config.vocab_size  # no weights made
    MQARTask(vocab_size=vocab_size, num_pairs=config.num_pairs, seq_len=config.seq_len)
    _check_memory(config, vocab_size)
    compile_config({"target": config.target, "inner": config.inner})
    if config.checkpoint_dir is None:
        return None
    check_writable_dir(config.checkpoint_dir, "checkpoint directory")
    if config.more_steps is not None:
        _check_no_restarts_for_more_steps()
    up_to = config.steps if config.more_steps is None else sys.maxsize  # more_steps: any checkpoint resumes
    return demo_checkpoint.check_resumable(config.checkpoint_dir, up_to, _settings(config))


def _check_no_restarts_for_more_steps() -> None:
    """A torchrun restart runs the command again: more_steps would count again from the newer checkpoint."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise ValueError("--more-steps under torchrun --max-restarts: a restarted rank would count the steps again "
                         "from its newer checkpoint; give the total as --steps")


def _with_total_steps(config: DemoConfig, resume_step: int | None) -> DemoConfig:
    """`config` with `steps` the total to train to: the checkpoint's step plus more_steps, when given.

    Without more_steps, a checkpoint already at `steps` leaves nothing to train: said in one line
    (the run still evaluates the checkpoint)."""
    if config.more_steps is not None:
        return dataclasses.replace(config, steps=(resume_step or 0) + config.more_steps, more_steps=None)
    if resume_step == config.steps and launcher_rank_and_world()[0] == 0:
        print(f"the checkpoint in {config.checkpoint_dir} is at step {resume_step} = --steps: nothing to train "
              "(evaluating it); pass --more-steps N or a larger --steps to train on", file=sys.stderr)
    return config


def _warn_if_threads_contend() -> None:
    """One line on stderr when other work already fills the cores and OpenMP picks its own thread count."""
    warning = thread_contention_warning()
    if warning:
        print(warning, file=sys.stderr, flush=True)


def thread_contention_warning() -> str | None:
    """The fix for training under load, or None.

    With more runnable processes than cores, each of PyTorch's OpenMP threads spins waiting for the
    others at every parallel region while they wait for a core: the demo measured 35-40x slower
    (22 min instead of 42 s with 5-8 other runnable processes on 2 cores), and one thread per
    process 5.5x faster than the default under the same load.
    """
    if "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() == 1 or not hasattr(os, "getloadavg"):
        return None
    cores = usable_cores()
    load = os.getloadavg()[0]
    if load <= cores:
        return None
    return (f"the load average ({load:.2f}) is above the {cores} core{'s' * (cores != 1)} this process may run on "
            "(its CPU affinity, within a container's CPU quota): PyTorch's threads spin against "
            "the other work and training can run 35-40x slower; set OMP_NUM_THREADS=1 "
            "(`OMP_NUM_THREADS=1 laplace-passes demo ...`)")


def _check_memory(config: DemoConfig, vocab_size: int) -> None:
    """Refuse a batch whose token ids, targets and logits alone exceed this machine's memory.

    A lower bound (the activations come on top), so the refusal is never wrong: one process holds
    its rank's rows of a training batch, and rank 0 the whole evaluation batch.
    """
    world_size = launcher_rank_and_world()[1] if under_torchrun() else config.world_size
    per_token = 2 * 8 + 4 * vocab_size  # int64 ids and targets, one float32 logit per vocabulary entry
    rows, which, fix = max((config.batch // world_size, "a rank's training batch of", MEMORY_FIX),
                           (config.eval_batch, "the evaluation batch of", "use a smaller --seq-len"))
    check_fits(rows * config.seq_len * per_token,
               f"{which} {rows} sequences of {config.seq_len:,} tokens (their ids, targets and logits)", fix)


def _launched_rank(config: DemoConfig) -> DemoResult | None:
    """One process of a torchrun or launch_local job."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # the processes share the machine's cores
    rank, world = join_process_group()
    try:
        return _train(rank, world, config)
    finally:
        dist.destroy_process_group()


@dataclass
class _Trainer:
    """What every rank trains with."""

    model: torch.nn.Module
    compiled: torch.nn.Module
    task: object
    optimizer: object
    muon_report: object
    names: dict


def _build(config: DemoConfig, world_size: int) -> _Trainer:
    import laplace_passes
    import model_zoo
    from model_zoo.mqar import MQARTask
    from model_zoo.muon import ShardedMuon

    torch.manual_seed(config.seed)  # same initial weights on every rank
    model = model_zoo.build(config.model, **({"shift_keys": True} if config.shift_keys else {}))
    task = MQARTask(vocab_size=model.config.vocab_size, num_pairs=config.num_pairs, seq_len=config.seq_len)
    compiled = laplace_passes.compile(model, target=config.target, inner=config.inner)
    muon_report = laplace_passes.Report()
    optimizer = ShardedMuon(_param_groups(model), lr=config.muon_lr, weight_decay=0.0,
                            adamw_kwargs={"lr": config.adamw_lr, "weight_decay": 0.0},
                            backend=_muon_step_backend(muon_report) if world_size > 1 else None)
    names = {p: n for n, p in model.named_parameters()}
    return _Trainer(model, compiled, task, optimizer, muon_report, names)


def _train(rank: int, world_size: int, config: DemoConfig) -> DemoResult | None:
    """Train on this rank; rank 0 alone evaluates and returns the result (the others return None)."""
    with allocation_failures_as_errors(MEMORY_FIX):  # what _check_memory's lower bound lets through
        return _train_and_evaluate(rank, world_size, config)


def _train_and_evaluate(rank: int, world_size: int, config: DemoConfig) -> DemoResult | None:
    trainer = _build(config, world_size)
    start_step, losses = _resume(config, trainer)
    progress = _progress_bar(config.steps, start_step, enabled=config.progress and rank == 0)
    progress.set_postfix_str("compiling (the first step compiles the forward and backward graphs) ...")
    start, recalls = time.perf_counter(), []
    for step in range(start_step + 1, config.steps + 1):
        losses.append(_train_step(config, trainer, step, rank, world_size))
        if rank == 0 and _recall_due(config, step - start_step) and step < config.steps:
            recalls.append((step, _recall(config, trainer)))
        elapsed = time.perf_counter() - start
        tokens_per_s = (step - start_step) * config.batch * config.seq_len / elapsed  # the global batch
        progress.set_postfix_str(progress_postfix(losses[-1], tokens_per_s), refresh=False)
        progress.update(1)
        if _checkpoint_due(config, step):
            state = demo_checkpoint.training_state(trainer.model, trainer.optimizer, trainer.names, step, losses,
                                                   _settings(config))
            demo_checkpoint.save(config.checkpoint_dir, step, state, rank)
    progress.close()
    seconds = time.perf_counter() - start
    if rank != 0:  # every rank holds the same model: one evaluation (its own compile) is enough
        return None
    result = _result(config, trainer, losses, seconds, world_size, resumed_from=start_step or None)
    result.recalls = [*recalls, (config.steps, result.accuracy)] if config.recall_every else []
    return result


def _train_step(config: DemoConfig, trainer: _Trainer, step: int, rank: int, world_size: int) -> float:
    """One optimizer step on this rank's part of the global batch; returns the global batch's loss."""
    from model_zoo.mqar import IGNORE

    ids, targets = _rank_batch(config, trainer.task, step, rank, world_size)
    logits = _logits(trainer.compiled(ids))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    trainer.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    trainer.optimizer.step()
    return _global_mean(loss.detach(), world_size)


def _rank_batch(config: DemoConfig, task, step: int, rank: int, world_size: int):
    """This rank's rows of step `step`'s global batch, which depends on the seed and the step only."""
    generator = torch.Generator().manual_seed((config.seed << 32) + step)
    ids, targets = task.batch(config.batch, generator)
    per_rank = config.batch // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return ids[rows], targets[rows]


def _global_mean(value: torch.Tensor, world_size: int) -> float:
    """The mean over the ranks (each rank's batch has as many recall targets, so this is the global loss)."""
    if world_size == 1:
        return value.item()
    import torch.distributed as dist

    total = value.clone()
    dist.all_reduce(total)
    return (total / world_size).item()


def _recall_due(config: DemoConfig, trained: int) -> bool:
    return config.recall_every is not None and trained % config.recall_every == 0


def _recall(config: DemoConfig, trainer: _Trainer) -> float:
    """Recall accuracy on the evaluation batch (the same batch at every step: the curve compares like with like).

    The model is in the same mode as for training and no random state is drawn: the training that
    follows is the one without evaluations."""
    from model_zoo.mqar import recall_accuracy

    eval_ids, eval_targets = trainer.task.batch(config.eval_batch, torch.Generator().manual_seed(10_000 + config.seed))
    with torch.no_grad():
        return recall_accuracy(_logits(trainer.compiled(eval_ids)), eval_targets)


def _checkpoint_due(config: DemoConfig, step: int) -> bool:
    if config.checkpoint_dir is None:
        return False
    every = config.checkpoint_every
    return step == config.steps or (every is not None and step % every == 0)


def _settings(config: DemoConfig) -> dict:
    return {name: getattr(config, name) for name in demo_checkpoint.RUN_SETTINGS}


def _resume(config: DemoConfig, trainer: _Trainer) -> tuple[int, list[float]]:
    """(step, losses) of the newest checkpoint in checkpoint_dir, loaded into trainer; (0, []) if none."""
    if config.checkpoint_dir is None:
        return 0, []
    step = demo_checkpoint.newest_step(config.checkpoint_dir)  # step <= steps: _check_settings
    if step is None:
        return 0, []
    template = demo_checkpoint.training_state(trainer.model, trainer.optimizer, trainer.names, 0, [],
                                              _settings(config))
    loaded = demo_checkpoint.load(config.checkpoint_dir, step, template, _settings(config))
    trainer.optimizer.load_dcp_state_dict(trainer.names, loaded["optimizer"])
    return loaded["step"], loaded["losses"][: loaded["step"]]


def _result(config: DemoConfig, trainer: _Trainer, losses: list[float], seconds: float, world_size: int,
            resumed_from: int | None) -> DemoResult:
    accuracy = _recall(config, trainer)
    report = trainer.compiled.laplace_report
    report_text, report_dict, muon_ratio, ns_ratio = str(report), report.to_dict(), None, None
    if world_size > 1:
        muon_report = trainer.muon_report
        report_text += f"\n\nShardedMuon step over {world_size} ranks (backend='laplace', target 'cpu'):\n{muon_report}"
        report_dict["muon_step"] = muon_report.to_dict()
        traffic = muon_report.traffic
        muon_ratio = traffic[0].received_ratio if traffic else None
        if traffic and traffic[0].ns_flops_after:
            ns_ratio = traffic[0].ns_flops_before / traffic[0].ns_flops_after
    trained = config.steps - (resumed_from or 0)
    return DemoResult(
        losses=losses,
        accuracy=accuracy,
        chance=trainer.task.chance,
        listed_chance=trainer.task.listed_chance,
        tokens_per_s=trained * config.batch * config.seq_len / seconds if trained else 0.0,
        seconds=seconds,
        report=report_text,
        report_dict=report_dict,
        muon_received_ratio=muon_ratio,
        muon_ns_work_ratio=ns_ratio,
        world_size=world_size,
        resumed_from=resumed_from,
    )


def _progress_bar(steps: int, done: int, enabled: bool) -> tqdm:
    """tqdm on stderr: redrawn in place on a terminal, every tenth of the way elsewhere (logs stay short).

    On a terminal the line is cut to the terminal's width (`dynamic_ncols`):
    a line that wraps can only be redrawn from its last row, leaving the
    rows above it stale. The figures have fixed widths (`progress_postfix`),
    so the line never gets shorter as they change.
    """
    interactive = sys.stderr.isatty()
    return tqdm(total=steps, initial=done, desc="train", disable=not enabled, file=sys.stderr, ascii=".#",
                bar_format="{desc} [{bar:24}] {n_fmt}/{total_fmt} {elapsed}{postfix}", dynamic_ncols=interactive,
                mininterval=0.1 if interactive else 0.0, miniters=None if interactive else max(1, steps // 10))


def progress_postfix(loss: float, tokens_per_s: float) -> str:
    """The progress line's figures, each in a fixed width."""
    return f"loss {loss:7.3f}  tok/s {tokens_per_s:>9,.0f}"


def _muon_step_backend(report):
    """backend="laplace" for ShardedMuon's step, filling `report` (see the module docstring for the target)."""
    from laplace_passes.driver.backend import laplace_backend

    return functools.partial(laplace_backend, options={"target": "cpu", "report": report})


def _logits(output) -> torch.Tensor:
    """The logits of either model: a tensor (model_zoo's GLALM) or an output with `.logits` (fla's)."""
    return output if isinstance(output, torch.Tensor) else output.logits


def _param_groups(model: torch.nn.Module) -> list[dict]:
    """Muon for the hidden matrices; AdamW for the embeddings, the output head, norms and biases."""
    hidden, other = [], []
    for name, param in model.named_parameters():
        is_io = "embeddings" in name or name.startswith("lm_head")
        (hidden if param.ndim == 2 and not is_io else other).append(param)
    return [{"params": hidden}, {"params": other, "use_muon": False}]
