"""Hardware targets: every number a pass needs, in one object.

Passes read the chunk size, memory sizes, instruction budget and collective
constraints from a target, never from literals, so the same pipeline serves
Trainium2 and a CPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

KIB = 1024
MIB = 1024 * KIB


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


@dataclass(frozen=True)
class HardwareTarget:
    """A compilation target.

    partitions: rows of the on-chip memory tile; the GLA chunk size.
    sub_chunk_size: rows sharing one anchor in the chunked GLA's intra-chunk
        scores (numerical stability, see `laplace_passes.chunked`).
    max_graph_instructions: the compiler's limit on one graph (None: no limit).
    matmul_tile: (partition rows, free columns) of one matmul instruction.
    recurrent_max_tokens: GLA sites this short (decode: 1 token) get the recurrent form, one
        state update per token, instead of a chunk padded to `partitions` rows; measured by
        `benchmarks/bench_fla.py` (the crossover of the two forms).
    static_shapes: the target's compiler takes static shapes only (neuronx-cc): a graph with
        symbolic sizes is compiled once per concrete shape (`laplace_passes.shapes`).
    """

    name: str
    partitions: int
    sub_chunk_size: int
    sbuf_bytes: int | None = None
    psum_bytes: int | None = None
    max_graph_instructions: int | None = None
    matmul_tile: tuple[int, int] = (128, 512)
    recurrent_max_tokens: int = 0
    static_shapes: bool = False
    collectives: CollectiveConstraints = field(default_factory=CollectiveConstraints)
    description: str = ""

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
    sbuf_bytes=128 * 224 * KIB,  # 28 MiB
    psum_bytes=2 * MIB,
    max_graph_instructions=5_000_000,  # neuronx-cc's default threshold ([XTP002])
    matmul_tile=(128, 512),
    # The estimated instructions of the two forms cross at T = 24 (1.3B heads) to 48 (tiny heads).
    recurrent_max_tokens=16,
    static_shapes=True,  # neuronx-cc; TorchNeuron recompiles per shape and rejects dynamic=True
    collectives=CollectiveConstraints(
        all_to_all_equal_splits_only=True,
        all_to_all_group_sizes=(4, 8, 16),
        all_to_all_group_size_multiple=32,
    ),
)

CPU = HardwareTarget(
    name="cpu",
    description="Host CPU: fla's default chunk of 64 tokens, no graph-size limit",
    partitions=64,
    sub_chunk_size=16,
    # Measured on a CPU (one thread, the tiny model's heads): the forms cross between T = 64 and 256;
    # fla switches to its recurrent kernel at T <= 64 too.
    recurrent_max_tokens=64,
)

TARGETS: dict[str, HardwareTarget] = {t.name: t for t in (TRN2, CPU)}


def get_target(target: str | HardwareTarget) -> HardwareTarget:
    """Resolve a target name (or pass a HardwareTarget through)."""
    if isinstance(target, HardwareTarget):
        return target
    if isinstance(target, str) and target in TARGETS:
        return TARGETS[target]
    raise ValueError(f"unknown target {target!r}; known targets: {', '.join(sorted(TARGETS))} (or a HardwareTarget)")
