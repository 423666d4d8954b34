"""Inductor's C++ kernels of one graph built together, beside the codegen: a few g++ runs per graph.

    kernels_compiled_together()   within it, a graph's kernels are compiled in up to `compile_threads` libraries,
                                  in the background from the module's wait to the kernel's first call
    BATCHES                       what was built: kernels per library, and the batches that fell back

NOTE [kernels compiled together]
Inductor's C++ backend builds every kernel as a library of its own: one g++
run per kernel, each loading Inductor's precompiled header (about 150 MB)
and linking against libtorch, about 0.8 s whatever the kernel's size. The
39 kernels of `tiny`'s training step took 32.5 s of g++ that way and 4.7 s
as one translation unit (3.2 s as two, side by side), on a 2-core AVX-512
machine (benchmarks/bench_compile.py prints the runs and their seconds).

Within `kernels_compiled_together()`, `AsyncCompile.cpp_pybinding` (what a
wrapper module Inductor generates calls once per kernel, before it waits
for them all) hands back a deferred kernel. The first one the module waits
for builds every kernel deferred so far: each kernel's text unchanged in a
namespace of its own, the kernels split into translation units of about
equal length (up to `compile_threads`, each with at least MIN_LIBRARY_CHARS
of source: a g++ run's fixed cost is paid per library), each with one Python entry point per kernel
(`kernel_<i>`, its arguments parsed as Inductor's bindings parse them),
built side by side through Inductor's own code cache: its compiler, flags,
precompiled header, vector instruction set and cache folder. The machine
code of each kernel is the one g++ makes for it alone (a kernel calls no
other kernel); tests/test_kernel_batches.py compares outputs bit for bit.

NOTE [kernel builds beside the codegen]
The module's wait (`async_compile.wait(globals())`, as Inductor loads the
module it generated) does not block: it starts the batch's build in a
background thread and leaves a `LazyKernel` in place of each kernel. The
first call of a kernel waits for the build, then puts the kernel's function
in the module's globals, where the module's calls find it from then on. So
Inductor returns a compiled graph while its C++ is still being built, and
the next compile's Python codegen (the chunk-loop bodies, compiled with
their host graph: `compiled_bodies.compile_ahead`) runs beside it: the
first call of `tiny`'s training step no longer waits for each graph's g++
in turn (benchmarks/bench_compile.py). A kernel that is never called is
still built; a failed build's warning is raised by the first call, on the
caller's thread.

NOTE [a fork during a build]
A process that forks (a DataLoader worker, a user's own `os.fork`) while a
batch is still building, or is queued, leaves its child a copy of the
batch whose future the parent's builder thread would complete, and that
thread is not in the child: the child's first call of one of its kernels
waited forever. At the fork the child drops the builds that had not
returned, with their libraries' loaders in Inductor's code cache (each
waits for a compile on the parent's compile threads), and gets a builder
of its own, so that first call builds the batch again, there (Inductor's
code cache finds on disk what the parent finished, under its file lock),
on compile threads of its own: Inductor's thread pool is the parent's too,
and is started again as well. A build that had returned keeps its kernels,
in a future of the child's (the parent's future is not read: another
thread may have held its lock at the fork). A child's kernels are the
parent's. (A child still hangs in its first kernel when its parent ran
kernels with more than one OpenMP thread: GNU OpenMP's threads do not
survive a fork, with or without this package.)

What the batch does not expect it leaves to Inductor, kernel by kernel: a
source with anything but one `extern "C" void kernel(...)` after the
prefix header, an argument type Inductor's bindings do not parse, a single
kernel, one compile thread (Inductor then compiles each kernel as it is
defined and never waits on a future). A batch whose build fails is built
again kernel by kernel by Inductor, with a warning naming the error. The
environment variable LAPLACE_PASSES_KERNEL_BATCHES=0 leaves every kernel
to Inductor (to compare, or to debug a kernel as Inductor builds it).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import re
import sys
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, Sequence
from unittest import mock

from torch._inductor.codecache import CodeCacheFuture

from laplace_passes.infra.inductor_fast import wait_for_kernel_header
from laplace_passes.infra.threads import mark_background

_PREFIX_INCLUDE = "#include <torch/csrc/inductor/cpp_prefix.h>"
_ENTRY = re.compile(r'extern "C"\s+void\s+kernel\s*\(')
# How Inductor's Python bindings parse each argument type (after "const " is dropped): a tensor's
# data pointer, or a Python int or float.
_SCALAR_ARGUMENTS = ("int64_t", "uintptr_t", "float")
OFF_SWITCH = "LAPLACE_PASSES_KERNEL_BATCHES"  # "0": every kernel left to Inductor's own build
# The least source a library gets before a graph's kernels are split into more than one: the cpu target's
# graphs (40k to 180k characters) build in one, a Neuron target's unrolled ones (280k, 490k) in up to two.
MIN_LIBRARY_CHARS = 200_000


def batch_refusal(argtypes: Sequence[str], source: str) -> str | None:
    """Why a kernel is left to Inductor's own build, or None when it can join a batch."""
    if source.count('extern "C"') != 1 or not _ENTRY.search(source):
        return 'not one extern "C" void kernel(...)'
    if any(line.lstrip().startswith("#include") for line in source.replace(_PREFIX_INCLUDE, "").splitlines()):
        return "includes a header besides Inductor's prefix"
    for argtype in argtypes:
        parsed = _parsed_type(argtype)
        if not parsed.endswith("*") and parsed not in _SCALAR_ARGUMENTS:
            return f"an argument of type {argtype!r}"
    return None


def _parsed_type(argtype: str) -> str:
    return argtype.replace("const ", "").strip()


@dataclasses.dataclass
class Kernel:
    argtypes: tuple[str, ...]
    source: str


@dataclasses.dataclass
class BatchRecord:
    """One batch: the kernels in each library built, or why they fell back to one library per kernel."""

    kernels_per_library: list[int]
    fallback: str | None = None


class BatchLog:
    """What `kernels_compiled_together` built in this process, the latest batches (read by tests and benchmarks)."""

    KEPT = 256  # a long-running process compiles many graphs: their records are not kept forever

    def __init__(self) -> None:
        self.records: collections.deque[BatchRecord] = collections.deque(maxlen=self.KEPT)

    def clear(self) -> None:
        self.records.clear()


BATCHES = BatchLog()


class Batch:
    """The kernels one wrapper module defined before waiting: built together from the module's wait on.

    The module's wait starts the build in the background (`start`) and
    leaves a `LazyKernel` in place of each kernel; its first call waits for
    the build (`function`). NOTE [kernel builds beside the codegen].
    """

    def __init__(self, compile_threads: int) -> None:
        self.kernels: list[Kernel] = []
        self.compile_threads = compile_threads
        self.closed = False  # set at the module's wait: later kernels start a new batch
        self._built: Future | None = None
        self._functions: list[Callable] | None = None  # what `_build` returned, once it did
        self._loads: list[Callable] = []  # Inductor's loaders of its libraries, kept in Inductor's code cache
        self._fallback_warning: str | None = None  # set by a failed build, warned by the first call after it
        self._lock = threading.Lock()

    def add(self, kernel: Kernel) -> "DeferredKernel":
        self.kernels.append(kernel)
        return DeferredKernel(self, len(self.kernels) - 1)

    def start(self) -> None:
        """Close the batch and start building it in the background (once)."""
        with self._lock:
            self.closed = True
            if self._built is None:
                self._built = _builder().submit(self._build)
                _building.add(self)

    def forget_parents_build(self) -> None:
        """In a forked child: a build the parent had not finished is started again, here, at its first call.

        The parent's future is not touched (another thread of the parent may have held its lock at the fork):
        a build that returned gets a future of the child's own.
        """
        self._lock = threading.Lock()  # likewise
        if self._built is None:
            return
        if self._functions is not None:
            self._built = Future()
            self._built.set_result(self._functions)
            return
        self._built = None
        _forget_cached_loads(self._loads)  # they wait for the parent's compile threads

    def function(self, index: int) -> Callable:
        """The kernel's function, once the batch is built; a fallback's warning is raised on this thread."""
        self.start()
        functions = self._built.result()
        with self._lock:  # warned once, by the first call that finds it
            message, self._fallback_warning = self._fallback_warning, None
        if message is not None:
            warnings.warn(message, stacklevel=3)
        return functions[index]

    def _build(self) -> list[Callable]:
        self._functions = self._built_functions()
        return self._functions

    def _built_functions(self) -> list[Callable]:
        # NOTE [vector-ISA probes ahead of the codegen]: the header is being built in the background; a
        # build here would preprocess it a second time beside it.
        wait_for_kernel_header()
        if len(self.kernels) == 1:
            return _one_by_one(self.kernels)
        groups = split_evenly(self.kernels, libraries_for(self.kernels, self.compile_threads))
        try:
            functions = _built_together(groups, self._loads)
        except Exception as error:  # noqa: BLE001 - Inductor builds them one by one instead, as it would have
            message = str(error).strip()
            reason = f"{type(error).__name__}: {message.splitlines()[0] if message else ''}"
            BATCHES.records.append(BatchRecord([1] * len(self.kernels), fallback=reason))
            self._fallback_warning = (f"laplace_passes: {len(self.kernels)} Inductor kernels built together failed "
                                      f"({reason}); Inductor builds them one by one")
            return _one_by_one(self.kernels)
        BATCHES.records.append(BatchRecord([len(group) for group in groups]))
        by_index = {}
        for group, group_functions in zip(groups, functions):
            for (index, _), function in zip(group, group_functions):
                by_index[index] = function
        return [by_index[index] for index in range(len(self.kernels))]


_builder_lock = threading.Lock()
_builder_pool: ThreadPoolExecutor | None = None


def _builder() -> ThreadPoolExecutor:
    """One background thread builds the batches, in the order modules wait (each on Inductor's compile workers)."""
    global _builder_pool
    with _builder_lock:
        if _builder_pool is None:
            _builder_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="laplace-kernel-batches",
                                               initializer=mark_background)
        return _builder_pool


def wait_for_builds() -> None:
    """Return once every batch started so far is built: the builder builds them in order, one at a time."""
    _builder().submit(lambda: None).result()


# Batches whose build was started, while they are in use: a forked child starts again those not built yet.
_building: "weakref.WeakSet[Batch]" = weakref.WeakSet()


def _forget_builder() -> None:
    """In a forked child: the parent's builder thread is not there, so a new one starts when needed, and a
    batch it was building or had queued builds again there (its future would never complete: NOTE [a fork
    during a build])."""
    global _builder_pool, _builder_lock
    _builder_pool, _builder_lock = None, threading.Lock()
    for batch in list(_building):
        batch.forget_parents_build()
    _forget_inductors_thread_pool()


def _forget_cached_loads(loads: list[Callable]) -> None:
    """Drop `loads` from Inductor's code cache: a loader there waits for a compile submitted to the parent's
    compile threads, and the same library asked for again would get it back."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    cache = CppPythonBindingsCodeCache.cache
    for key in [key for key, load in cache.items() if any(load is ours for ours in loads)]:
        del cache[key]
    loads.clear()


def _forget_inductors_thread_pool() -> None:
    """Inductor's compile threads (`AsyncCompile.pool`, what a batch's builds are submitted to) are the parent's
    too, and Inductor's own fork handler resets its process pool only: a new pool starts when needed."""
    pool = getattr(sys.modules.get("torch._inductor.async_compile"), "AsyncCompile", None)
    pool = getattr(pool, "pool", None)
    if callable(getattr(pool, "cache_clear", None)):
        pool.cache_clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_builder)


class DeferredKernel(CodeCacheFuture):
    """What the wrapper module holds until it waits: its kernel, from the batch's libraries."""

    def __init__(self, batch: Batch, index: int) -> None:
        self.batch = batch
        self.index = index

    def result(self, timeout: float | None = None) -> Callable:
        self.batch.start()
        return LazyKernel(self.batch, self.index)


class LazyKernel:
    """A kernel whose batch is still building: its first call waits for it, then puts the function in its place.

    `scope` and `name`: the wrapper module's globals and the kernel's name
    there (set after the module's wait), so later calls find the function itself.
    """

    __slots__ = ("batch", "index", "scope", "name")

    def __init__(self, batch: Batch, index: int) -> None:
        self.batch, self.index = batch, index
        self.scope: dict | None = None
        self.name: str | None = None

    def __call__(self, *args):
        function = self.batch.function(self.index)
        if self.scope is not None and self.scope.get(self.name) is self:
            self.scope[self.name] = function
        return function(*args)


def libraries_for(kernels: Sequence[Kernel], compile_threads: int) -> int:
    """How many libraries to build `kernels` in: up to `compile_threads`, each with MIN_LIBRARY_CHARS of source.

    A g++ run costs its fixed part (the precompiled header loaded, libtorch linked) whatever it builds, and a
    first call on two cores is bound by its CPU seconds: a small graph built in one library, not two, made the
    cpu target's first call of tiny's training step 0.95x as long (docs/benchmarks.md).
    """
    source = sum(len(kernel.source) for kernel in kernels)
    return max(1, min(compile_threads, source // MIN_LIBRARY_CHARS))


def split_evenly(kernels: Sequence[Kernel], parts: int) -> list[list[tuple[int, Kernel]]]:
    """Kernels (with their indices) in at most `parts` groups of about equal source length, each in kernel order.

    Longest first onto the shortest group; ties by index, so the same kernels
    make the same groups (the same sources: Inductor's cache finds them).
    """
    groups: list[list[tuple[int, Kernel]]] = [[] for _ in range(max(1, min(parts, len(kernels))))]
    lengths = [0] * len(groups)
    for index in sorted(range(len(kernels)), key=lambda i: (-len(kernels[i].source), i)):
        lightest = lengths.index(min(lengths))
        groups[lightest].append((index, kernels[index]))
        lengths[lightest] += len(kernels[index].source)
    return [sorted(group, key=lambda pair: pair[0]) for group in groups if group]


def _built_together(groups: list[list[tuple[int, Kernel]]], loads: list[Callable]) -> list[list[Callable]]:
    """Each group one library, all submitted to Inductor's compile workers before waiting for any (their loaders
    appended to `loads`)."""
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    for group in groups:
        loads.append(CppPythonBindingsCodeCache.load_async(library_source([kernel for _, kernel in group]), "cpu",
                                                           submit_fn=AsyncCompile.submit))
    functions = []
    for group, load in zip(groups, loads):
        module = load()
        functions.append([getattr(module, f"kernel_{position}") for position in range(len(group))])
    return functions


def _one_by_one(kernels: Sequence[Kernel]) -> list[Callable]:
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return [CppPythonBindingsCodeCache.load_pybinding(list(kernel.argtypes), kernel.source) for kernel in kernels]


def library_source(kernels: Sequence[Kernel]) -> str:
    """One translation unit: each kernel in namespace `laplace_kernel_<i>`, then a module `kernel` of entry points."""
    parts = [_PREFIX_INCLUDE]
    for position, kernel in enumerate(kernels):
        body = kernel.source.replace(_PREFIX_INCLUDE, "").replace('extern "C"', "", 1)
        parts.append(f"namespace laplace_kernel_{position} {{\n{body}\n}}  // namespace laplace_kernel_{position}")
    parts.append(_BINDINGS_HEAD)
    parts.extend(_entry_point(position, kernel.argtypes) for position, kernel in enumerate(kernels))
    methods = "".join(f'    {{"kernel_{position}", kernel_{position}_py, METH_VARARGS, ""}},\n'
                      for position in range(len(kernels)))
    parts.append(_BINDINGS_TAIL.replace("@METHODS@", methods))
    return "\n".join(parts)


def _entry_point(position: int, argtypes: Sequence[str]) -> str:
    arguments = ", ".join(f"laplace_arg<{_parsed_type(argtype)}>(args, {n})" for n, argtype in enumerate(argtypes))
    return (f"static PyObject* kernel_{position}_py(PyObject*, PyObject* args) {{\n"
            f"    try {{\n"
            f"        laplace_check_arity(args, {len(argtypes)});\n"
            f"        laplace_kernel_{position}::kernel({arguments});\n"
            f"        Py_RETURN_NONE;\n"
            f"    }} catch (std::exception const& error) {{\n"
            f"        PyErr_SetString(PyExc_RuntimeError, error.what());\n"
            f"        return nullptr;\n"
            f"    }}\n"
            f"}}\n")


# The entry points take the arguments Inductor's wrapper passes its kernels: tensors, whose data pointer
# comes from the function Inductor exports for its own bindings (its address in the environment variable
# Inductor's loader sets before it loads a library), and Python ints and floats.
_BINDINGS_HEAD = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

static void* (*laplace_tensor_data_ptr)(PyObject* tensor);

template <typename T> static inline T laplace_arg(PyObject* args, Py_ssize_t n) {
    static_assert(std::is_pointer_v<T>, "a kernel argument is a tensor's pointer, an int or a float");
    return static_cast<T>(laplace_tensor_data_ptr(PyTuple_GET_ITEM(args, n)));
}
template <> inline int64_t laplace_arg<int64_t>(PyObject* args, Py_ssize_t n) {
    auto value = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n));
    if (value == -1 && PyErr_Occurred()) throw std::runtime_error("expected an int argument");
    return value;
}
template <> inline uintptr_t laplace_arg<uintptr_t>(PyObject* args, Py_ssize_t n) {
    auto value = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    if (value == reinterpret_cast<void*>(-1) && PyErr_Occurred()) throw std::runtime_error("expected an int argument");
    return reinterpret_cast<uintptr_t>(value);
}
template <> inline float laplace_arg<float>(PyObject* args, Py_ssize_t n) {
    auto value = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n));
    if (value == -1.0 && PyErr_Occurred()) throw std::runtime_error("expected a float argument");
    return static_cast<float>(value);
}

static void laplace_check_arity(PyObject* args, Py_ssize_t arity) {
    if (!PyTuple_CheckExact(args)) throw std::runtime_error("a tuple of arguments expected");
    if (PyTuple_GET_SIZE(args) != arity)
        throw std::runtime_error("expected " + std::to_string(arity) + " arguments");
}
"""

_BINDINGS_TAIL = r"""
static PyMethodDef laplace_methods[] = {
@METHODS@    {nullptr, nullptr, 0, nullptr}};

static struct PyModuleDef laplace_module = {PyModuleDef_HEAD_INIT, "kernel", nullptr, -1, laplace_methods};

PyMODINIT_FUNC PyInit_kernel(void) {
    const char* address = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if (!address) {
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR must be set");
        return nullptr;
    }
    char* end = nullptr;
    errno = 0;
    auto value = std::strtoull(address, &end, 10);
    if (errno != 0 || end == address || value == 0) {
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not an address");
        return nullptr;
    }
    laplace_tensor_data_ptr = reinterpret_cast<decltype(laplace_tensor_data_ptr)>(static_cast<uintptr_t>(value));
    return PyModule_Create(&laplace_module);
}
"""


_open = threading.local()


@contextlib.contextmanager
def kernels_compiled_together() -> Iterator[None]:
    """Inductor's C++ kernels of each wrapper module built in a few libraries (NOTE above); nothing else changes."""
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads

    if os.environ.get(OFF_SWITCH, "1") == "0":
        yield
        return
    own_cpp_pybinding = AsyncCompile.cpp_pybinding

    def cpp_pybinding(self, argtypes: list[str], source_code: str):
        threads = get_compile_threads()
        if threads <= 1 or batch_refusal(argtypes, source_code) is not None:
            return own_cpp_pybinding(self, argtypes, source_code)
        batch = getattr(_open, "batch", None)
        if batch is None or batch.closed:
            batch = _open.batch = Batch(threads)
        return batch.add(Kernel(tuple(argtypes), source_code))

    own_wait_futures = AsyncCompile._wait_futures

    def wait_futures(self, scope: dict) -> None:
        own_wait_futures(self, scope)
        for name, value in scope.items():
            if isinstance(value, LazyKernel):
                value.scope, value.name = scope, name

    with mock.patch.object(AsyncCompile, "cpp_pybinding", cpp_pybinding), \
            mock.patch.object(AsyncCompile, "_wait_futures", wait_futures):
        try:
            yield
        finally:
            _open.batch = None
