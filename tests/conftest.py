"""Settings every test process shares: one intra-op thread.

The tests' tensors are small and their ops many (a token recurrence is
thousands of ops on small tensors). On them, torch's second OpenMP thread
costs more than it gives: each op waits for both threads, and on a busy
2-core machine a descheduled thread stalls every op, the more the busier
it is. test_chunked_gla.py took 56 s with one thread and 118 s with two,
one run after the other on this 2-core machine at a load average of 4;
its token recurrence at T = 2048, D = 128 alone, 9 s and 168 s at a load
of 23. On an idle machine the two are even (44 s and 43 s). OMP_NUM_THREADS also reaches the processes the tests start (the
CLI, torchrun and its workers, the gloo ranks). Set OMP_NUM_THREADS
yourself to run the tests with more threads.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads at import)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Strict mode: a failure inside a laplace pass raises instead of skipping the pass (NOTE [a failing pass
# declines]), so that the tests find it; tests of the skipping set strict=False or the variable to 0.
os.environ.setdefault("LAPLACE_PASSES_STRICT", "1")

@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo_per_module():
    """Each test module starts from an empty Dynamo cache: compiles of the same model code in earlier modules
    of a worker count towards Dynamo's recompile limit, past which a compile silently runs eagerly."""
    torch._dynamo.reset()
    yield


# The Neuron runtime's logical core config changes the neuronx-cc commands and the HBM budget
# the tests check (laplace_passes.infra.targets.runtime_target); tests that need it set it themselves.
os.environ.pop("NEURON_LOGICAL_NC_CONFIG", None)


# Under `pytest -n 2 --dist loadfile` (the README's command) each worker takes
# the next module when it is nearly done with its own. Handing the slowest
# modules out first keeps one worker from starting a three-minute module
# while the other is about to finish: the suite ends when both have. The
# order is from `--durations=0` summed per module (seconds on two workers,
# this 2-core machine); a module missing from it only runs later.
SLOWEST_MODULES_FIRST = (
    "test_bench_cli.py",  # 186
    "test_decode_ahead.py",  # 139
    "test_fla_family_models.py",  # 127
    "test_dynamic_shapes.py",  # 116
    "test_backend.py",  # 114
    "test_demo_distributed.py",  # 106
    "test_readme.py",  # 90
    "test_recognise.py",  # 88
    "test_sharded_muon.py",  # 82
    "test_cli.py",  # 66
    "test_lowering.py",  # 65
    "test_kernel_batches.py",  # 64
    "test_compiled_bodies.py",  # 61
    "test_muon_rewrite.py",  # 57
    "test_fla_model.py",  # 55
    "test_condition_sources.py",  # 54
    "test_generate.py",  # 53
    "test_decode_step.py",  # 47
    "test_muon_user_steps.py",  # 43
    "test_xla_consumer.py",  # 43
    "test_fla_zoo.py",  # 42
    "test_chunked_gla.py",  # 39
    "test_inductor_fast.py",  # 38
    "test_body_helper.py",  # 37
    "test_gate_bounds.py",  # 31
    "test_recognise_mamba2.py",  # 31
    "test_checkpointed_regions.py",  # 28
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # xdist's own order (most tests first) would undo the one below


def pytest_collection_modifyitems(items):
    def module_rank(item):
        name = item.path.name
        return SLOWEST_MODULES_FIRST.index(name) if name in SLOWEST_MODULES_FIRST else len(SLOWEST_MODULES_FIRST)

    items.sort(key=module_rank)  # stable: tests keep their order within a module
