"""The main job: train the `tiny` GLA model on MQAR through backend="laplace".

    laplace-passes demo                    # defaults: under 2 minutes on 2 CPU cores
    laplace-passes demo --world-size 4     # data-parallel over 4 local gloo processes
    laplace-passes demo --model fla-gla-tiny   # flash-linear-attention's own GLAForCausalLM

Each step: the compiled model (GLA re-tiled into chunks of the target's size)
predicts the recalled values, and ShardedMuon updates the hidden matrices
(AdamW the embeddings and norms). At the end: recall accuracy on a fresh
batch against chance, and the pass report.

Data-parallel (`--world-size` W > 1): ShardedMuon's step is compiled with the
laplace backend too, whose Muon pass rewrites its all-gather into two
all-to-alls (`laplace_passes.collectives`); the report then shows the step's
graph and the traffic per rank before and after. The step is compiled for
target "cpu": its collectives run over gloo on this machine, and trn2's rule
for all-to-all group sizes (4, 8, 16, multiples of 32) would refuse W = 2 or 3.
With one process there is no communication to rewrite and the step runs eagerly.
"""

from __future__ import annotations

import functools
import os
import queue
import socket
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm


@dataclass
class DemoConfig:
    model: str = "tiny"  # a model_zoo name: "tiny", or "fla-gla-tiny" (fla's GLAForCausalLM)
    steps: int = 300
    batch: int = 32
    seq_len: int = 64
    num_pairs: int = 8
    target: str = "trn2"
    inner: str = "eager"
    world_size: int = 1
    seed: int = 0
    muon_lr: float = 0.02
    adamw_lr: float = 3e-3
    eval_batch: int = 256
    progress: bool = True

    def __post_init__(self):
        for name in ("steps", "batch", "seq_len", "num_pairs", "world_size", "eval_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass
class DemoResult:
    losses: list[float]
    accuracy: float
    chance: float
    tokens_per_s: float
    seconds: float
    report: str = ""
    report_dict: dict = field(default_factory=dict)
    # Data-parallel runs: per-rank bytes received by the Muon step, gathers / all-to-alls.
    muon_received_ratio: float | None = None

    def summary(self) -> str:
        muon = ""
        if self.muon_received_ratio is not None:
            muon = f"; Muon step receives x{self.muon_received_ratio:.2f} fewer bytes per rank after the rewrite"
        return (
            f"loss {self.losses[0]:.3f} -> {self.losses[-1]:.3f} over {len(self.losses)} steps; "
            f"recall accuracy {self.accuracy:.1%} (chance {self.chance:.1%}); "
            f"{self.tokens_per_s:,.0f} training tokens/s; {self.seconds:.1f}s{muon}"
        )

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("report")
        return data


def run_demo(config: DemoConfig) -> DemoResult:
    if config.world_size == 1:
        return _train(0, 1, config)
    return _run_data_parallel(config)


def _train(rank: int, world_size: int, config: DemoConfig) -> DemoResult:
    import laplace_passes
    import model_zoo
    from model_zoo.mqar import IGNORE, MQARTask, recall_accuracy
    from model_zoo.muon import ShardedMuon

    torch.manual_seed(config.seed)  # same initial weights on every rank
    model = model_zoo.build(config.model)
    task = MQARTask(vocab_size=model.config.vocab_size, num_pairs=config.num_pairs, seq_len=config.seq_len)
    compiled = laplace_passes.compile(model, target=config.target, inner=config.inner)
    muon_report = laplace_passes.Report()
    optimizer = ShardedMuon(_param_groups(model), lr=config.muon_lr, weight_decay=0.0,
                            adamw_kwargs={"lr": config.adamw_lr, "weight_decay": 0.0},
                            backend=_muon_step_backend(muon_report) if world_size > 1 else None)
    data = torch.Generator().manual_seed(config.seed * 1000 + rank + 1)
    progress = _progress_bar(config.steps, enabled=config.progress and rank == 0)
    progress.set_postfix_str("compiling (the first step compiles the forward and backward graphs) ...")
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, config.steps + 1):
        ids, targets = task.batch(config.batch, data)
        logits = _logits(compiled(ids))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        elapsed = time.perf_counter() - start
        tokens_per_s = world_size * step * config.batch * config.seq_len / elapsed
        progress.set_postfix_str(progress_postfix(losses[-1], tokens_per_s), refresh=False)
        progress.update(1)
    progress.close()
    seconds = time.perf_counter() - start
    eval_ids, eval_targets = task.batch(config.eval_batch, torch.Generator().manual_seed(10_000 + config.seed))
    with torch.no_grad():
        accuracy = recall_accuracy(_logits(compiled(eval_ids)), eval_targets)
    report = compiled.laplace_report
    report_text, report_dict, muon_ratio = str(report), report.to_dict(), None
    if world_size > 1:
        report_text += f"\n\nShardedMuon step over {world_size} ranks (backend='laplace', target 'cpu'):\n{muon_report}"
        report_dict["muon_step"] = muon_report.to_dict()
        traffic = muon_report.traffic
        muon_ratio = traffic[0].received_ratio if traffic else None
    return DemoResult(
        losses=losses,
        accuracy=accuracy,
        chance=task.chance,
        tokens_per_s=world_size * config.steps * config.batch * config.seq_len / seconds,
        seconds=seconds,
        report=report_text,
        report_dict=report_dict,
        muon_received_ratio=muon_ratio,
    )


def _progress_bar(steps: int, enabled: bool) -> tqdm:
    """tqdm on stderr: redrawn in place on a terminal, every tenth of the way elsewhere (logs stay short).

    On a terminal the line is cut to the terminal's width (`dynamic_ncols`):
    a line that wraps can only be redrawn from its last row, leaving the
    rows above it stale. The figures have fixed widths (`progress_postfix`),
    so the line never gets shorter as they change.
    """
    interactive = sys.stderr.isatty()
    return tqdm(total=steps, desc="train", disable=not enabled, file=sys.stderr, ascii=".#",
                bar_format="{desc} [{bar:24}] {n_fmt}/{total_fmt} {elapsed}{postfix}", dynamic_ncols=interactive,
                mininterval=0.1 if interactive else 0.0, miniters=None if interactive else max(1, steps // 10))


def progress_postfix(loss: float, tokens_per_s: float) -> str:
    """The progress line's figures, each in a fixed width."""
    return f"loss {loss:7.3f}  tok/s {tokens_per_s:>9,.0f}"


def _muon_step_backend(report):
    """backend="laplace" for ShardedMuon's step, filling `report` (see the module docstring for the target)."""
    from laplace_passes.backend import laplace_backend

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


def _run_data_parallel(config: DemoConfig) -> DemoResult:
    import torch.multiprocessing as mp

    port = _free_port()
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_rank_main, args=(rank, config, port, results), daemon=True)
        for rank in range(config.world_size)
    ]
    for process in processes:
        process.start()
    outcomes = _collect(results, processes)
    for process in processes:
        process.join()
    failures = [o for o in outcomes if o[0] == "error"]
    if failures:
        raise RuntimeError("data-parallel demo failed:\n" + "\n".join(f"rank {r}: {msg}" for _, r, msg in failures))
    return next(result for _, rank, result in outcomes if rank == 0)


def _collect(results, processes) -> list:
    """One outcome per rank; a rank that dies without reporting (killed, crashed) stops the demo, not hangs it."""
    outcomes = []
    while len(outcomes) < len(processes):
        try:
            outcomes.append(results.get(timeout=1.0))
        except queue.Empty:
            reported = {outcome[1] for outcome in outcomes}
            dead = [(rank, p.exitcode) for rank, p in enumerate(processes)
                    if rank not in reported and p.exitcode not in (None, 0)]
            if dead:
                for process in processes:
                    process.terminate()
                raise RuntimeError("data-parallel demo failed: " + ", ".join(
                    f"rank {rank} exited with code {code} without a result" for rank, code in dead))
    return outcomes


def _rank_main(rank: int, config: DemoConfig, port: int, results) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # W processes share the machine's cores
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=config.world_size)
        result = _train(rank, config.world_size, config)
        dist.destroy_process_group()
        results.put(("ok", rank, result))
    except Exception as error:  # reported to the parent, which raises
        results.put(("error", rank, f"{type(error).__name__}: {error}"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
