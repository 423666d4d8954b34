"""Hardware targets: every number a pass needs, in one object.

Passes read the chunk size, memory sizes, instruction budget and collective
constraints from a target, never from literals, so the same pipeline serves
Trainium2 and a CPU. Each number is a named field with its source beside
it; override any of them with `target.with_overrides(name=value)` (or
`dataclasses.replace`) and pass the result as `target=`.

Sources (AWS Neuron SDK documentation, https://awsdocs-neuron.readthedocs-hosted.com,
whose source is https://github.com/aws-neuron/aws-neuron-sdk):
  [ARCH1]  nki/guides/architecture/trainium_inferentia2_arch.rst: NeuronCore-v2, SBUF 128 partitions x
           192 KiB, PSUM 2 MiB, a 128x128 TensorEngine whose moving tile holds 512 fp32 per partition
  [ARCH2]  nki/guides/architecture/trainium2_arch.rst: NeuronCore-v3, SBUF 128 x 224 KiB, PSUM 2 MiB
  [HBM]    libraries/nxd-inference/developer_guides/feature-guide.rst: "On Inf2/Trn1, each Neuron core
           has 16GB of memory"; "On Trn2, each Neuron core has 24GB of memory (with LNC2)"
  [LNC]    compiler/neuronx-cc/api-reference-guide (--logical-nc-config {1, 2}, trn2 default 2) and
           compiler/error-codes/EARG001.rst ("On trn1, only lnc=1 is supported")
  [AUTOCAST] the same CLI reference: --auto-cast default `none`; TorchNeuron passes --auto-cast=none
  [XTP002] neuronx-cc's error "[XTP002] Number of instructions (8658944) is over the threshold
           (5000000)", https://github.com/aws-neuron/aws-neuron-sdk/issues/987 (also #819); the
           documented code is NCC_EXTP004 (compiler/error-codes/EXTP004.rst), which gives no number
  [NRT]    the Neuron runtime's collectives topology error "Supported number of Neuron Cores is 1, 2,
           8, 16 or a multiple of 32", https://github.com/huggingface/optimum-neuron/issues/619, and
           4-rank replica groups, release-notes/components/runtime.rst (Runtime 2.23.110)
  [LNCENV] about-neuron/arch/neuron-features/logical-neuroncore-config.rst: the runtime variable
           NEURON_LOGICAL_NC_CONFIG sets the LNC, and "AWS Neuron currently doesn't support setting the
           compiler flag to a different LNC configuration than the Neuron Runtime environment variable";
           TorchNeuron passes the variable's value as --lnc when set (torch-neuronx
           csrc/core/utils/PlatformUtils.cpp, GetLogicalNeuronCores; public copy
           github.com/parmoham-aws/test-repo-parmoham at 98154b8), the instance's default otherwise
  [A2A]    TorchNeuron's all-to-all accepts equal splits only (torch_neuronx/distributed/backend.py,
           alltoall_base: "Only even split sizes are supported")
  [CTRL]   general/arch/neuron-features/control-flow.rst: control flow is "supported in NeuronCore-v2
           Architecture ... however it is still not implemented by the Neuron Compiler"
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict, dataclass, field
from typing import Mapping

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
GB = 1000**3


@dataclass(frozen=True)
class CollectiveConstraints:
    """What the target's collective library accepts for all-to-all."""

    all_to_all_equal_splits_only: bool = False
    # Group sizes accepted for all-to-all: explicit sizes, plus any multiple of
    # `group_size_multiple` (0 = no such rule). Empty and 0 = any size.
    all_to_all_group_sizes: tuple[int, ...] = ()
    all_to_all_group_size_multiple: int = 0

    def group_size_supported(self, size: int) -> bool:
        if not self.all_to_all_group_sizes and not self.all_to_all_group_size_multiple:
            return True
        if size in self.all_to_all_group_sizes:
            return True
        m = self.all_to_all_group_size_multiple
        return bool(m) and size % m == 0


# How the recurrent form reads o_t = q_t S out of the state (`laplace_passes.ops.gla.gla_recurrence`).
RECURRENT_READOUTS = ("matmul", "reduce")
CHUNK_RECURRENCES = ("unrolled", "op")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, minimum: int) -> None:
    kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if not _is_int(value) or value < minimum:
        raise ValueError(f"HardwareTarget.{name} must be {kind}, got {value!r}")


@dataclass(frozen=True)
class HardwareTarget:
    """A compilation target.

    partitions: rows of the on-chip memory tile; the GLA chunk size.
    sub_chunk_size: rows of the leaves of chunked GLA's intra-chunk halving, whose scores
        are computed elementwise (NOTE [stable intra-chunk scores] in
        `laplace_passes.ops.chunked_forward`): the fewest estimated instructions on trn2 at 16,
        the fastest on a CPU compiled by Inductor at 8 (eagerly at 4; timed at
        `benchmarks/bench_gla.py`'s shape).
    max_graph_instructions: the compiler's limit on one graph (None: no limit).
    matmul_tile: (partition rows, free columns) of one matmul instruction.
    hbm_bytes_per_core: device memory of one (logical) core: the preflight's bound on a graph's
        inputs plus its peak of live intermediates (neuronx-cc: NCC_EOOM001). None: not checked.
    logical_cores: neuronx-cc's --lnc (physical cores per logical core), None: not a Neuron target.
        The Neuron runtime's NEURON_LOGICAL_NC_CONFIG, when set, overrides it where a command or
        check is made for this machine (`runtime_target` below).
    logical_core_choices: the --lnc values the target accepts; `at_logical_cores` picks one.
    auto_cast: neuronx-cc's --auto-cast, written out explicitly.
    recurrent_max_tokens: GLA sites this short (decode: 1 token) get the recurrent form, one
        state update per token, instead of a chunk padded to `partitions` rows; measured by
        `benchmarks/bench_fla.py` (the crossover of the two forms).
    recurrent_readout: how the recurrent form reads each output out of the state
        (`laplace_passes.ops.gla.gla_recurrence`): "matmul" (the trn2 estimate's choice for fla's
        1.3B heads) or "reduce" (fuses with the state update on a CPU: the compiled decode step
        of the tiny model ran 1.20x faster at 1280 sequences; `docs/passes.md`, "Short sites and decode").
    static_shapes: the target's compiler takes static shapes only (neuronx-cc): a graph with
        symbolic sizes is compiled once per concrete shape (`laplace_passes.driver.shapes`).
    control_flow: the target's compiler takes control flow (`cond`, `while_loop`; StableHLO `case`,
        `if`, `while`) in a graph. neuronx-cc does not [CTRL]: passes emit none for it (the Muon
        rewrite takes its branch-free plan) and the preflight flags any left.
    save_residuals: chunked GLA's forward keeps the states entering each chunk and tril(A) for
        its backward (`laplace_passes.ops.chunked`), which otherwise recomputes them from the inputs:
        more memory for less work. On a CPU a forward+backward step runs faster with them kept
        (`benchmarks/bench_gla.py --recompute-residuals`). The Neuron targets recompute, the
        form their graphs were sized and HBM-checked with: for laplace-3b at T = 2048 on trn2,
        keeping them would take 6% off the backward's estimated instructions per layer and
        add 5% to the activations saved for it, a trade to settle on the device.
    chunk_recurrence: how the unroll pass leaves chunked GLA's state recurrence over chunks (the
        only part whose size grows with T; `laplace_passes.unroll.chunk_loops`): "unrolled", one
        state update per chunk (what neuronx-cc takes), or "op", one `laplace::chunk_recurrence`
        node running the same loop at run time, so the graph's size does not depend on T (with
        Inductor's faster index analysis, the first call of `tiny`'s training step at T = 2048
        took 0.69x the CPU seconds: `benchmarks/bench_compile.py`, docs/benchmarks.md). Inner
        compilers that lower to StableHLO get it unrolled.
    """

    name: str
    partitions: int
    sub_chunk_size: int
    sbuf_bytes: int | None = None
    psum_bytes: int | None = None
    max_graph_instructions: int | None = None
    matmul_tile: tuple[int, int] = (128, 512)
    recurrent_max_tokens: int = 0
    recurrent_readout: str = "matmul"
    static_shapes: bool = False
    control_flow: bool = True
    save_residuals: bool = False
    chunk_recurrence: str = "unrolled"
    collectives: CollectiveConstraints = field(default_factory=CollectiveConstraints)
    hbm_bytes_per_core: int | None = None
    logical_cores: int | None = None
    logical_core_choices: tuple[int, ...] = ()
    auto_cast: str = "none"
    description: str = ""

    def __post_init__(self) -> None:
        # Checked where the target is made: a bad number would otherwise surface inside a pass, as a
        # ZeroDivisionError or a negative tensor size wrapped in Dynamo's error.
        for name in ("partitions", "sub_chunk_size"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("recurrent_max_tokens", self.recurrent_max_tokens, minimum=0)
        if self.recurrent_readout not in RECURRENT_READOUTS:
            raise ValueError(f"HardwareTarget.recurrent_readout must be one of {RECURRENT_READOUTS}, "
                             f"got {self.recurrent_readout!r}")
        if self.chunk_recurrence not in CHUNK_RECURRENCES:
            raise ValueError(f"HardwareTarget.chunk_recurrence must be one of {CHUNK_RECURRENCES}, "
                             f"got {self.chunk_recurrence!r}")
        tile = self.matmul_tile
        if not (isinstance(tile, tuple) and len(tile) == 2 and all(_is_int(n) and n > 0 for n in tile)):
            raise ValueError(f"HardwareTarget.matmul_tile must be two positive ints (partition rows, free columns), "
                             f"got {tile!r}")

    def __repr__(self) -> str:
        # Short: it shows up in torch's error messages (the backend's repr); every field: dataclasses.asdict.
        return (f"HardwareTarget({self.name!r}, partitions={self.partitions}, "
                f"max_graph_instructions={self.max_graph_instructions}, static_shapes={self.static_shapes})")

    def with_overrides(self, **changes) -> HardwareTarget:
        """This target with some numbers replaced, e.g. ``TRN2.with_overrides(max_graph_instructions=2_000_000)``."""
        return dataclasses.replace(self, **changes)

    def at_logical_cores(self, logical_cores: int) -> HardwareTarget:
        """This Neuron target with `logical_cores` physical cores per logical core; HBM per logical core scales with them."""
        if logical_cores not in self.logical_core_choices:
            choices = ", ".join(map(str, self.logical_core_choices)) or "none (not a Neuron target)"
            raise ValueError(f"{self.name} takes a logical NeuronCore config (--lnc) of {choices}, not {logical_cores!r}")
        hbm = self.hbm_bytes_per_core
        if hbm is not None:
            hbm = hbm // self.logical_cores * logical_cores
        return self.with_overrides(logical_cores=logical_cores, hbm_bytes_per_core=hbm)

    @property
    def chunk_size(self) -> int:
        """Tokens per GLA chunk: one per partition."""
        return self.partitions

    def to_dict(self) -> dict:
        return asdict(self)


TRN2 = HardwareTarget(
    name="trn2",
    description="AWS Trainium2 NeuronCore-v3 (SBUF 128 partitions x 224 KiB)",
    partitions=128,
    sub_chunk_size=16,
    sbuf_bytes=128 * 224 * KIB,  # 28 MiB, one physical core [ARCH2]
    psum_bytes=2 * MIB,  # [ARCH2]
    max_graph_instructions=5_000_000,  # the threshold in neuronx-cc's [XTP002] error (2024 builds)
    matmul_tile=(128, 512),  # [ARCH1], kept by NeuronCore-v3 [ARCH2]
    hbm_bytes_per_core=24 * GB,  # [HBM], at LNC=2
    logical_cores=2,  # [LNC]: trn2's default
    logical_core_choices=(1, 2),  # [LNC]
    # The estimated instructions of the two forms cross between T = 8 and 16 (tiny and 1.3B heads).
    recurrent_max_tokens=8,
    static_shapes=True,  # neuronx-cc; TorchNeuron recompiles per shape and rejects dynamic=True
    control_flow=False,  # [CTRL]
    # [A2A]; the group sizes follow [NRT], the runtime's trn1 topology rule plus its 4-rank groups
    # (no document states a trn2 all-to-all rule; override it when yours differs).
    collectives=CollectiveConstraints(
        all_to_all_equal_splits_only=True,
        all_to_all_group_sizes=(4, 8, 16),
        all_to_all_group_size_multiple=32,
    ),
)

TRN1 = HardwareTarget(
    name="trn1",
    description="AWS Trainium NeuronCore-v2 (SBUF 128 partitions x 192 KiB); also inf2's core",
    partitions=128,
    sub_chunk_size=16,
    sbuf_bytes=128 * 192 * KIB,  # 24 MiB [ARCH1]
    psum_bytes=2 * MIB,  # [ARCH1]
    max_graph_instructions=5_000_000,  # [XTP002]
    matmul_tile=(128, 512),  # [ARCH1]
    recurrent_max_tokens=8,  # as trn2: same TensorEngine shape, not measured separately
    control_flow=False,  # [CTRL]
    hbm_bytes_per_core=16 * GB,  # [HBM]
    logical_cores=1,  # [LNC]: the only value trn1 accepts
    logical_core_choices=(1,),  # [LNC]
    collectives=TRN2.collectives,  # [A2A], [NRT]
)

CPU = HardwareTarget(
    name="cpu",
    description="Host CPU: fla's default chunk of 64 tokens, no graph-size limit",
    partitions=64,
    # Inductor-compiled GLA forward+backward 1.06-1.08x faster than with 4-row leaves at chunks of 64
    # and 128 (one level of small matmuls fewer, T=2048, H=4, K=128, V=256, 2 threads).
    sub_chunk_size=8,
    # Measured on a CPU (one thread, the tiny model's heads): the forms cost about the same at T = 64,
    # one chunk (benchmarks/bench_fla.py --part crossover); fla switches to its recurrent kernel at T <= 64 too.
    recurrent_max_tokens=64,
    recurrent_readout="reduce",
    save_residuals=True,  # the backward's recomputation was about a tenth of a step (bench_gla.py)
    chunk_recurrence="op",  # Inductor compiles one graph for any T (bench_compile.py)
)

TARGETS: dict[str, HardwareTarget] = {t.name: t for t in (TRN2, TRN1, CPU)}


def get_target(target: str | HardwareTarget) -> HardwareTarget:
    """Resolve a target name (or pass a HardwareTarget through)."""
    if isinstance(target, HardwareTarget):
        return target
    if isinstance(target, str) and target in TARGETS:
        return TARGETS[target]
    raise ValueError(f"unknown target {target!r}; known targets: {', '.join(sorted(TARGETS))} (or a HardwareTarget)")


# [LNCENV]: the Neuron runtime's logical NeuronCore config, which a NEFF's --lnc must match.
LOGICAL_NC_ENV = "NEURON_LOGICAL_NC_CONFIG"


def runtime_target(target: str | HardwareTarget, env: Mapping[str, str] | None = None) -> HardwareTarget:
    """`target` at the logical NeuronCore config the runtime here uses: NEURON_LOGICAL_NC_CONFIG when set.

    Read from `env` (default os.environ). Sets the target's `--lnc` and
    scales its HBM per logical core (`HardwareTarget.at_logical_cores`);
    other targets, or an unset variable, give the target unchanged. A value
    the target does not take (trn1: only 1) is a ValueError naming the variable.
    """
    resolved = get_target(target)
    value = (os.environ if env is None else env).get(LOGICAL_NC_ENV, "").strip()
    if not value or resolved.logical_cores is None:
        return resolved
    try:
        return resolved.at_logical_cores(int(value))
    except ValueError as error:
        raise ValueError(f"{LOGICAL_NC_ENV}={value!r}: {error}") from None
