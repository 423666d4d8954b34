"""Inductor's kernels of a graph built together (laplace_passes.infra.kernel_batches): the same kernels, fewer g++ runs.

NOTE [kernels compiled together]: each kernel's text is unchanged, only
built beside the graph's other kernels, so a graph compiled within
`kernels_compiled_together()` must give bit for bit what Inductor's own
build gives, forward and backward, with static and symbolic sizes (integer
arguments), while Inductor defines the same kernels and the libraries are
at most `compile_threads` per graph. What the batch cannot build falls back
to Inductor's build with a warning, and what it does not expect is never
batched.
"""

import contextlib
import os
import sys
import threading
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch._dynamo
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.utils import fresh_inductor_cache

import laplace_passes
from tests import processes
from laplace_passes.infra import kernel_batches
from laplace_passes.infra.kernel_batches import BATCHES, Kernel, batch_refusal, kernels_compiled_together, split_evenly

KERNEL = '#include <torch/csrc/inductor/cpp_prefix.h>\nextern "C"  void  kernel(const float* in_ptr0, float* out_ptr0)\n{\n}\n'


def loss_and_grads(x, w, b):
    """A small training step's forward and gradients: pointwise, reduction, scan and layer-norm kernels between matmuls."""
    inputs = [t.detach().requires_grad_() for t in (x, w, b)]
    x, w, b = inputs
    h = torch.nn.functional.layer_norm(x @ w + b, (w.shape[1],))
    y = torch.softmax(h, -1) * torch.nn.functional.gelu(h) + h.cumsum(-1) / h.shape[-1]
    loss = (y @ w.t()).logsumexp(-1).sum()
    return (y, *torch.autograd.grad(loss, inputs))


def run_compiled(fn, inputs, batched: bool, dynamic: bool = False, compile_threads: int = 2):
    """`fn` compiled by Inductor from an empty cache, inside the batching or not; its outputs and Inductor's kernels."""
    torch._dynamo.reset()
    defined = []

    with contextlib.ExitStack() as stack:
        stack.enter_context(fresh_inductor_cache())
        stack.enter_context(torch._inductor.config.patch(compile_threads=compile_threads, fx_graph_cache=False))
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        if batched:
            stack.enter_context(kernels_compiled_together())
        stack.enter_context(mock.patch.object(AsyncCompile, "cpp_pybinding", _counting(defined)))  # sees each kernel first
        compiled = torch.compile(fn, backend="inductor", dynamic=dynamic)
        outputs = [compiled(*each) for each in inputs]
    return outputs, defined


def _counting(defined: list):
    inner = AsyncCompile.cpp_pybinding  # Inductor's, or the batch's within kernels_compiled_together

    def counting(self, argtypes, source_code):
        defined.append(source_code)
        return inner(self, argtypes, source_code)

    return counting


def assert_bitwise_equal(left, right):
    for a, b in zip(left, right, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y), (x - y).abs().max()


def test_a_training_step_is_bit_for_bit_inductors_own_build_with_fewer_libraries(monkeypatch):
    monkeypatch.setattr(kernel_batches, "MIN_LIBRARY_CHARS", 1)  # small graphs split too: the split is tested
    torch.manual_seed(0)
    inputs = [(torch.randn(24, 40), torch.randn(40, 48), torch.randn(48))]
    BATCHES.clear()
    batched, batched_kernels = run_compiled(loss_and_grads, inputs, batched=True)
    records = list(BATCHES.records)
    own, own_kernels = run_compiled(loss_and_grads, inputs, batched=False)
    assert_bitwise_equal(batched, own)
    assert sorted(batched_kernels) == sorted(own_kernels)  # the same kernels were defined
    assert records and all(record.fallback is None for record in records)
    assert sum(sum(record.kernels_per_library) for record in records) == len(own_kernels)
    # compile_threads (2) libraries per graph, or one per kernel where a graph has fewer
    assert all(len(record.kernels_per_library) == min(2, sum(record.kernels_per_library)) for record in records)
    assert sum(len(record.kernels_per_library) for record in records) < len(own_kernels)


def test_symbolic_sizes_pass_as_integer_arguments():
    def fn(x, w):
        y = torch.relu(x @ w) * x.shape[0]
        return (torch.softmax(y, -1) @ w.t()).cumsum(0) + y.sum(-1, keepdim=True), y.amax()

    torch.manual_seed(0)
    inputs = [(torch.randn(n, 16), torch.randn(16, 16)) for n in (5, 9, 33)]
    BATCHES.clear()
    batched, kernels = run_compiled(fn, inputs, batched=True, dynamic=True)
    assert any("int64_t" in source for source in kernels)  # the sizes reach the kernels as arguments
    assert BATCHES.records and all(record.fallback is None for record in BATCHES.records)
    own, _ = run_compiled(fn, inputs, batched=False, dynamic=True)
    assert_bitwise_equal(batched, own)


def test_a_batch_that_fails_to_build_is_built_kernel_by_kernel_with_a_warning(monkeypatch):
    def fn(x):
        return (x.sin() @ x).cos().sum(0) @ x

    inputs = [(torch.randn(12, 12),)]
    own, _ = run_compiled(fn, inputs, batched=False)
    broken = kernel_batches.library_source
    monkeypatch.setattr(kernel_batches, "library_source",
                        lambda kernels: broken(kernels) + "\n#error not a translation unit g++ builds\n")
    BATCHES.clear()
    with pytest.warns(UserWarning, match=r"Inductor kernels built together failed \(.*\); Inductor builds them one by one"):
        batched, _ = run_compiled(fn, inputs, batched=True)
    assert_bitwise_equal(batched, own)
    assert BATCHES.records and BATCHES.records[-1].fallback


def test_one_compile_thread_leaves_every_kernel_to_inductor():
    def fn(x):
        return (x.sin() @ x).cos() @ x.exp()

    inputs = [(torch.randn(8, 8),)]
    BATCHES.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="laplace_passes")  # no batch built, none failed
        (out,), _ = run_compiled(fn, inputs, batched=True, compile_threads=1)
    assert len(BATCHES.records) == 0
    torch.testing.assert_close(out, fn(*inputs[0]))


def test_the_environment_variable_leaves_every_kernel_to_inductor(monkeypatch):
    def fn(x):
        return (x.sin() @ x).cos() @ x.exp()

    monkeypatch.setenv(kernel_batches.OFF_SWITCH, "0")
    inputs = [(torch.randn(8, 8),)]
    BATCHES.clear()
    (out,), kernels = run_compiled(fn, inputs, batched=True)
    assert len(kernels) >= 2 and len(BATCHES.records) == 0
    torch.testing.assert_close(out, fn(*inputs[0]))


def test_the_laplace_backend_with_inner_inductor_builds_kernels_together():
    def fn(x, w):
        return torch.tanh(torch.relu(x @ w).cumsum(1) @ w) + x

    x, w = torch.randn(16, 16), torch.randn(16, 16)
    BATCHES.clear()
    torch._dynamo.reset()
    with fresh_inductor_cache(), torch._inductor.config.patch(compile_threads=2):
        out = laplace_passes.compile(fn, target="cpu", inner="inductor")(x, w)
    assert BATCHES.records and BATCHES.records[-1].fallback is None
    torch.testing.assert_close(out, fn(x, w))


@pytest.mark.parametrize("source, argtypes, reason", [
    (KERNEL, ["const float*", "float*"], None),
    (KERNEL, ["const int64_t", "float*", "const bfloat16*"], None),
    (KERNEL + KERNEL.split("\n", 1)[1], ["float*"], 'not one extern "C" void kernel'),
    (KERNEL.replace("kernel(", "other("), ["float*"], 'not one extern "C" void kernel'),
    ("#include <vector>\n" + KERNEL, ["float*"], "includes a header"),
    (KERNEL, ["float*", "double"], "an argument of type 'double'"),
])
def test_what_a_batch_takes(source, argtypes, reason):
    refusal = batch_refusal(argtypes, source)
    assert refusal == reason if reason is None else reason in refusal


def test_a_graph_is_split_into_libraries_of_enough_source_each_up_to_the_compile_threads():
    """A g++ run's fixed cost is paid per library: a small graph's kernels build in one."""
    def kernels(*lengths):
        return [Kernel(("float*",), "x" * n) for n in lengths]

    least = kernel_batches.MIN_LIBRARY_CHARS
    assert kernel_batches.libraries_for(kernels(least // 2, least // 2 - 1), 2) == 1
    assert kernel_batches.libraries_for(kernels(least, least), 2) == 2
    assert kernel_batches.libraries_for(kernels(least, least, least), 2) == 2  # no more than the threads
    assert kernel_batches.libraries_for(kernels(least, least, least), 8) == 3
    assert kernel_batches.libraries_for(kernels(1), 4) == 1


def test_split_evenly_balances_source_length_and_keeps_kernel_order():
    kernels = [Kernel(("float*",), "x" * length) for length in (50, 10, 40, 30, 20)]
    groups = split_evenly(kernels, 2)
    assert [[index for index, _ in group] for group in groups] == [[0, 1, 4], [2, 3]]
    assert groups == split_evenly(kernels, 2)  # the same sources each time: Inductor's cache finds them
    assert [len(group) for group in split_evenly(kernels, 8)] == [1] * 5
    assert split_evenly(kernels[:1], 2) == [[(0, kernels[0])]]


def test_each_kernel_keeps_its_text_in_a_namespace_of_its_own():
    source = kernel_batches.library_source([Kernel(("const float*", "float*"), KERNEL)] * 2)
    assert source.count("#include <torch/csrc/inductor/cpp_prefix.h>") == 1
    assert 'extern "C"' not in source
    for position in (0, 1):
        assert f"namespace laplace_kernel_{position} {{" in source
        assert f"laplace_kernel_{position}::kernel(laplace_arg<float*>(args, 0), laplace_arg<float*>(args, 1))" in source
        assert f'{{"kernel_{position}", kernel_{position}_py, METH_VARARGS, ""}}' in source
    assert "PyMODINIT_FUNC PyInit_kernel(void)" in source


def test_a_modules_wait_starts_the_build_and_the_first_call_waits_for_it(monkeypatch):
    """NOTE [kernel builds beside the codegen]: the wait returns at once; the first call waits, then the function
    itself takes the kernel's place in the module, so later calls go straight to it."""
    release, calls = threading.Event(), []

    def slow_build(self):
        release.wait(timeout=60)
        return [lambda *args: calls.append(args) or "ran"]

    monkeypatch.setattr(kernel_batches.Batch, "_build", slow_build)
    batch = kernel_batches.Batch(compile_threads=2)
    scope = {"cpp_fused_0": batch.add(Kernel(("float*",), "unused"))}
    with kernels_compiled_together():
        AsyncCompile()._wait_futures(scope)  # what a wrapper module's async_compile.wait(globals()) does
    lazy = scope["cpp_fused_0"]
    assert isinstance(lazy, kernel_batches.LazyKernel) and batch.closed and not release.is_set()  # returned while building
    release.set()
    assert lazy(1, 2) == "ran" and calls == [(1, 2)]
    assert not isinstance(scope["cpp_fused_0"], kernel_batches.LazyKernel)  # the function itself, from now on
    assert scope["cpp_fused_0"](3) == "ran" and calls[-1] == (3,)


# A forked child finishes a batch its parent was still building. In a subprocess: the fork happens there, with
# one OpenMP thread (GNU OpenMP's threads do not survive a fork, with or without the batches) and an Inductor
# cache of its own, so the batch really builds. The parent builds only once the child is done, so the child
# builds alone, on compile threads of its own.
_FORK_DURING_A_BUILD = r"""
import faulthandler, os, sys, threading
import torch
import torch._inductor.codecache as codecache
from torch._inductor.async_compile import AsyncCompile
from laplace_passes.infra import kernel_batches
from laplace_passes.infra.kernel_batches import Batch, Kernel

def kernel(constant):
    return ('#include <torch/csrc/inductor/cpp_prefix.h>\nextern "C" void kernel(const float* in_ptr0, float* out_ptr0)'
            '\n{\n    for (int i = 0; i < 4; ++i) out_ptr0[i] = 2.0f * in_ptr0[i] + %s;\n}\n' % constant)

release, compiling = threading.Event(), threading.Event()
if sys.argv[1] == "queued":  # the builder busy: the batch waits behind it
    kernel_batches._builder().submit(release.wait)
elif sys.argv[1] == "compiling":  # the batch's libraries submitted to Inductor's compile threads, held there
    inductors_compile = codecache._worker_compile_cpp

    def held_compile(*args):
        if not threading.current_thread().name.startswith("laplace"):  # on Inductor's threads, not the builder
            compiling.set()
            release.wait()
        return inductors_compile(*args)

    codecache._worker_compile_cpp = held_compile
AsyncCompile.pool().submit(lambda: None).result()  # Inductor's compile threads started, as by a compile
batch = Batch(compile_threads=2)
batch.add(Kernel(("const float*", "float*"), kernel("1.0f")))
batch.add(Kernel(("const float*", "float*"), kernel("5.0f")))
batch.start()
if sys.argv[1] == "compiling":
    assert compiling.wait(120)
x = torch.arange(4, dtype=torch.float32)
if sys.argv[1] == "built":  # built, and another thread holds its future's lock as the process forks
    batch.function(0)
    held = threading.Event()

    def hold_the_lock():
        with batch._built._condition:
            held.set()
            release.wait()

    threading.Thread(target=hold_the_lock, daemon=True).start()
    assert held.wait(10)
pid = os.fork()
if pid == 0:
    release.set()  # the child's own copy: what waits on it here is its own compile
    print("child forked", flush=True)
    faulthandler.dump_traceback_later(120, exit=True)
    outputs = [torch.empty(4), torch.empty(4)]
    for index, out in enumerate(outputs):
        batch.function(index)(x, out)
    os._exit(0 if [o.tolist() for o in outputs] == [(2 * x + 1).tolist(), (2 * x + 5).tolist()] else 3)
print("child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
release.set()
parents = torch.empty(4)
batch.function(1)(x, parents)
assert parents.tolist() == (2 * x + 5).tolist()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX")
@pytest.mark.parametrize("when", ["queued", "compiling", "built"])
def test_a_child_forked_during_a_build_builds_the_batch_itself(when, tmp_path):
    """NOTE [a fork during a build]: the child's copy of a batch queued, or compiling on Inductor's threads, would
    wait forever for the parent's threads; it builds the batch again, on threads of its own, and its kernels
    compute the same. A batch built keeps its kernels, and the fork does not wait for a lock of its future that
    another thread held."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "2",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[1])}
    done = processes.run([sys.executable, "-c", _FORK_DURING_A_BUILD, when], timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "child forked" in done.stdout, done.stderr[-3000:]
    assert "child exit 0" in done.stdout, done.stderr[-3000:]
