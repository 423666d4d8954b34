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

import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads at import)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
