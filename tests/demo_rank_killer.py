"""`laplace-passes demo` whose rank 1 SIGKILLs itself at its CALL-th optimizer step of torchrun's first attempt.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/demo_rank_killer.py CALL demo ...

For the restart test (tests/test_demo_distributed.py): the kill comes from
outside the demo's code (ShardedMuon.step wrapped here), as a lost rank would.
"""

import os
import signal
import sys

from model_zoo.muon import ShardedMuon

from laplace_passes.tools.cli import main


def kill_rank_1_at(step: int) -> None:
    original = ShardedMuon.step
    calls = 0

    def step_then_maybe_die(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == step and os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)

    ShardedMuon.step = step_then_maybe_die


if __name__ == "__main__":
    kill_rank_1_at(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
