"""Inductor's first compile, sooner: the same kernels, the same instruction set.

    fast_index_simplify()    index strides by expanding plain polynomials, not sympy.simplify
    dtype_rules_set_once()   Inductor's dtype handler set up once, not once per operation written
    start_isa_probes()       Inductor's vector-ISA probes, then its precompiled header, in the background
    wait_for_isa_probes()    before Inductor's codegen
    wait_for_kernel_header() before the first kernel is built

NOTE [index strides without sympy.simplify]
Inductor's C++ backend asks, for every load and store of every kernel, the
stride of its index along the vectorised loop (`stride_at_vec_range` in
`torch._inductor.sizevars`): it rewrites the index and calls
`sympy.simplify` twice, on the index and on the difference of two indices.
Those are mostly plain polynomials with integer coefficients
(`8192*x0 + 256*x1 + 16*x2 + x3 + 128`), where `sympy.simplify` takes about
10 ms each, its whole heuristic search, for what `sympy.expand` computes
exactly: a polynomial's expanded form is canonical, so the difference of
two indices expands to the same number the search finds. In a compile of
`tiny`'s training step it was 40% of the main process's CPU time
(`benchmarks/bench_compile.py`). Within `fast_index_simplify()`,
`torch._inductor.sizevars` sees a `sympy` whose `simplify` expands
expressions built only of symbols, rational numbers, sums and products,
and calls `sympy.simplify` on anything else (FloorDiv, ModularIndexing,
relations). The kernels Inductor writes are the same text either way
(tests/test_inductor_fast.py); the results of the patched functions are
lru-cached by Inductor, and equal to the unpatched ones.
"""

from __future__ import annotations

import contextlib
import operator
import os
import platform
import sys
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator
from unittest import mock

import sympy

from laplace_passes.infra.threads import mark_background

_POLYNOMIAL_PARTS = (sympy.Symbol, sympy.Rational, sympy.Add, sympy.Mul)


def is_plain_polynomial(expr) -> bool:
    """Built only of symbols, rational numbers, sums and products (no powers, functions or relations)."""
    return isinstance(expr, sympy.Basic) and all(isinstance(part, _POLYNOMIAL_PARTS)
                                                 for part in sympy.preorder_traversal(expr))


def simplify(expr, *args, **kwargs):
    """`sympy.simplify`, by expansion for a plain polynomial (canonical, exact)."""
    if not args and not kwargs and is_plain_polynomial(expr):
        return sympy.expand(expr)
    return sympy.simplify(expr, *args, **kwargs)


class _SympyWithPolynomialSimplify(types.ModuleType):
    """sympy, with `simplify` replaced: what `torch._inductor.sizevars` sees inside `fast_index_simplify`."""

    simplify = staticmethod(simplify)

    def __getattr__(self, name: str):
        return getattr(sympy, name)


_SYMPY = _SympyWithPolynomialSimplify("sympy")


@contextlib.contextmanager
def fast_index_simplify() -> Iterator[None]:
    """Inductor's stride analysis with polynomials expanded, not searched (NOTE above); nothing else changes."""
    from torch._inductor import sizevars

    if getattr(sizevars, "sympy", None) is not sympy:  # another torch: leave it as it is
        yield
        return
    with mock.patch.object(sizevars, "sympy", _SYMPY):
        yield


# NOTE [dtype rules set up once]
# Inductor's code generators ask `DtypePropagationOpsHandler()` for the dtype
# of every operation they write (`CSEProxy._default` in
# `torch._inductor.codegen.common`). The class is a singleton, but Python runs
# its `__init__` at each call, and that `__init__` sets one attribute per
# operation (about 200, then a `dir()` of the instance): 0.1 ms each time,
# 12,000 times for the forward graph of `tiny`'s training step on the trn2
# target, more for its backward. That first call took 47.8 s (twice) against
# 50.2 and 50.6 s with it (`benchmarks/bench_compile.py`, docs/benchmarks.md).
# Within `dtype_rules_set_once()` the `__init__` runs again only when the
# rules it reads changed since it last ran (a lowering registered since: the
# rules dict holds other objects, or more of them), so the handler has the
# attributes the unpatched one would have (a rule object changed in place
# would go unnoticed; torch replaces rules, never changes one). The other
# tables it reads (`pointwise_overrides_data`, `boolean_ops()`) are constants
# of their modules. The patch is on while any compile of this process is
# inside the context.

_rules_lock = threading.Lock()
_rules_users = 0
_original_dtype_init: Callable | None = None


def _dtype_handler_class():
    """Inductor's `DtypePropagationOpsHandler`, or None when this torch's is not the one described above."""
    try:
        from torch._inductor import dtype_propagation, utils
    except ImportError:
        return None
    handler = getattr(dtype_propagation, "DtypePropagationOpsHandler", None)
    rules = getattr(utils, "op_dtype_propagation_rules", None)
    if handler is None or "__init__" not in vars(handler) or not isinstance(rules, dict):
        return None
    return handler


def _init_when_rules_changed(self) -> None:
    from torch._inductor.utils import op_dtype_propagation_rules as rules

    seen = self.__dict__.get("_laplace_rules_seen")
    if seen is not None and len(seen) == len(rules) and all(map(operator.is_, seen, rules.values())):
        return
    _original_dtype_init(self)
    self._laplace_rules_seen = list(rules.values())


@contextlib.contextmanager
def dtype_rules_set_once() -> Iterator[None]:
    """Inductor's dtype handler set up again only when its rules changed (NOTE [dtype rules set up once])."""
    global _rules_users, _original_dtype_init
    handler = _dtype_handler_class()
    if handler is None:
        yield
        return
    with _rules_lock:
        if _rules_users == 0:
            _original_dtype_init = vars(handler)["__init__"]
            handler.__init__ = _init_when_rules_changed
        _rules_users += 1
    try:
        yield
    finally:
        with _rules_lock:
            _rules_users -= 1
            if _rules_users == 0:
                handler.__init__ = _original_dtype_init


# NOTE [vector-ISA probes ahead of the codegen]
# The first Inductor compile of a process on a CPU asks which vector
# instruction sets work (`torch._inductor.cpu_vec_isa.valid_vec_isa_list`):
# for each one the CPU reports, it builds a test library with g++ and loads
# it in a child process, one after the other, inside the codegen of the
# first graph. On a 2-core AVX-512 machine that was 7 to 10 s of the first
# call of `tiny`'s training step (benchmarks/bench_compile.py), while the
# second core sat idle through Dynamo, AOT Autograd and the passes before
# it. The laplace backend starts the same probes when it receives its first
# graph for Inductor (`start_isa_probes`), two at a time in a background
# thread, and waits for them just before Inductor's compile
# (`wait_for_isa_probes`); Inductor then finds their results in its caches.
# The probes are Inductor's own, unchanged: the same instruction set is
# picked. Anything unexpected in that module leaves the probes to Inductor.
#
# The same thread then builds Inductor's precompiled header for its C++
# kernels, which Inductor otherwise builds on the main thread as it compiles
# the first kernel: 6.7 s on that machine, once per machine (it is kept in
# the system's temporary folder, not in Inductor's cache folder). It asks
# Inductor's code cache for a library of the header alone, which builds the
# header with the flags of every kernel library and builds no library; the
# first kernels to be built wait for it (`wait_for_kernel_header`, NOTE
# [kernels compiled together] in `laplace_passes/infra/kernel_batches.py`),
# while Inductor's codegen of the first graph ran beside it.
#
# Fewer test builds: an instruction set whose macros are another's and whose
# flags are a subset of the other's builds whatever the other builds (AVX-512
# within AVX-512 VNNI, VNNI within AMX). So each such one waits for the first
# candidate before it in Inductor's order that implies it; when that one is
# valid, its test sources are answered with the results they got there
# (`_probed_implied`), without g++; any other source, and every instruction
# set implied by none or by a failed one, is built as Inductor would. On the
# 2-core AVX-512 VNNI machine: 4 test libraries instead of 6 (2.4 s of 6.8 s
# of g++ saved), and the probes take the longest chain, not the sum. The
# list Inductor reads, its order, the instruction set picked and each one's
# flags are the same (tests/test_inductor_fast.py).

_probes_lock = threading.Lock()
_probes: threading.Thread | None = None
_probes_done = threading.Event()
_HEADER_ONLY = "#include <torch/csrc/inductor/cpp_prefix.h>\n"


def start_isa_probes() -> None:
    """Start Inductor's vector-ISA probes, then its precompiled header, in the background, once per process."""
    global _probes
    with _probes_lock:
        if _probes is None:
            _probes = threading.Thread(target=_prepare_in_background, name="laplace-isa-probes", daemon=True)
            _probes.start()


def wait_for_isa_probes() -> None:
    """Return once the background probes are done (at once when none were started)."""
    if _probes is not None:
        _probes_done.wait()


def wait_for_kernel_header() -> None:
    """Return once the background header build is done too (at once when none was started)."""
    if _probes is not None:
        _probes.join()


def _probes_not_awaited_in_child() -> None:
    """In a forked child: the probes' thread is the parent's; what it had not finished Inductor runs itself.

    A new event, set: the parent's may have been locked by another of its threads at the fork.
    """
    global _probes_done
    if _probes is not None:
        _probes_done = threading.Event()
        _probes_done.set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_probes_not_awaited_in_child)


def _prepare_in_background() -> None:
    mark_background()
    try:
        _run_isa_probes()
    finally:
        _probes_done.set()
    _precompile_kernel_header()


def _run_isa_probes() -> None:
    try:
        from torch._inductor import cpu_vec_isa

        candidates = _isas_the_cpu_reports(cpu_vec_isa)
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="laplace-isa-probe",
                                initializer=mark_background) as pool:
            list(pool.map(_probe_chain, _implication_chains(candidates)))  # results cached on each VecISA
        cpu_vec_isa.valid_vec_isa_list()  # cached: what Inductor reads, built from the results above
    except Exception:  # noqa: BLE001 - a probe that fails here is run again, by Inductor, where it needs it
        return


def _implies(stronger, weaker) -> bool:
    """Whatever builds with `stronger`'s flags builds with `weaker`'s: the same macros, a subset of the flags."""
    return (type(weaker)._macro == type(stronger)._macro
            and set(type(weaker)._arch_flags.split()) <= set(type(stronger)._arch_flags.split()))


def _implication_chains(candidates: list) -> list[list]:
    """The candidates in chains, in Inductor's order: each one after the first earlier candidate that implies it."""
    chains: list[list] = []
    for isa in candidates:
        chain = next((chain for chain in chains if any(_implies(other, isa) for other in chain)), None)
        if chain is None:
            chains.append([isa])
        else:
            chain.append(isa)
    return chains


def _probe_chain(chain: list) -> None:
    """Probe a chain's instruction sets in order, each answered from a valid stronger one's test builds."""
    built: dict[str, bool] = {}  # test source -> whether it built, under the first valid one's flags
    for isa in chain:
        if built:
            _probed_implied(isa, built)
        else:
            results = _probed_recording(isa)
            if bool(isa):
                built = results


def _probed_recording(isa) -> dict[str, bool]:
    """`bool(isa)`, Inductor's own probe, recording what each of its test builds gave."""
    results: dict[str, bool] = {}
    build = isa.check_build

    def recording(code: str) -> bool:
        results[code] = build(code)
        return results[code]

    _probed_with(isa, recording)
    return results


def _probed_implied(isa, built: dict[str, bool]) -> None:
    """`bool(isa)` with the test sources a stronger valid instruction set built answered from `built`."""
    build = isa.check_build
    _probed_with(isa, lambda code: built[code] if code in built else build(code))


def _probed_with(isa, check_build: Callable[[str], bool]) -> None:
    """`bool(isa)` (Inductor's probe, its result cached on `isa`) with `check_build` building its test sources."""
    isa.check_build = check_build  # on this instance only: other probes run beside it
    try:
        bool(isa)
    finally:
        del isa.check_build


def _precompile_kernel_header() -> None:
    try:
        from torch._inductor import config
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        if config.cpp_cache_precompile_headers and sys.platform != "win32":  # as Inductor: none on Windows
            CppPythonBindingsCodeCache.load_async(_HEADER_ONLY, "cpu")  # builds the header; the library is never built
    except Exception:  # noqa: BLE001 - Inductor builds the header itself where it needs it
        return


def _isas_the_cpu_reports(cpu_vec_isa: types.ModuleType) -> list:
    """The instruction sets `valid_vec_isa_list` would probe on this x86 CPU (none elsewhere: left to Inductor)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]
