"""Inductor's first compile sooner (laplace_passes.infra.inductor_fast): the same kernels, the same instruction set.

NOTE [index strides without sympy.simplify], NOTE [dtype rules set up
once]: the patches may only make Inductor faster, never change what it
writes; checked by compiling the chunked GLA forward (pads, chunk reshapes,
transposes, concatenations: indices with FloorDiv and ModularIndexing as
well as plain polynomials) with and without them and comparing the
generated code.

NOTE [vector-ISA probes ahead of the codegen]: the backend's background
probes must leave Inductor with the instruction sets its own probes find,
and leave none for Inductor to run on the main thread, and its header
build must make the precompiled header a kernel's build asks for; checked
in fresh processes, whose probe caches start empty.
"""

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import subprocess
import sys

import pytest
import sympy
import torch
import torch._dynamo
from torch._inductor import cpu_vec_isa, dtype_propagation, sizevars
from torch._inductor import utils as inductor_utils
from torch._inductor.utils import run_and_get_code
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from laplace_passes.infra import inductor_fast
from laplace_passes.ops.chunked_forward import chunked_forward
from tests import processes
from tests.gla_cases import make_inputs


def generated_code(fast: bool) -> tuple[torch.Tensor, str]:
    for cached in (sizevars.stride_at, sizevars.simplify_index_in_vec_range, sizevars.stride_at_vec_range):
        cached.cache_clear()  # else the second compile reads the first one's answers
    torch._dynamo.reset()
    q, k, v, gk, h0 = make_inputs(1, 130, 2, 8, 6, gate_divisor=1.0)
    compiled = torch.compile(functools.partial(chunked_forward, scale=0.3, chunk_size=64, sub_chunk_size=4),
                             backend="inductor")
    with torch._inductor.config.patch(fx_graph_cache=False), _fast_compile() if fast else contextlib.nullcontext():
        result, code = run_and_get_code(compiled, q, k, v, gk, h0)
    # The AOT ID line numbers compiles in order; the rest is what Inductor wrote.
    return result[0], "\n".join(line for text in code for line in text.splitlines() if not line.startswith("# AOT ID"))


@contextlib.contextmanager
def _fast_compile():
    with inductor_fast.fast_index_simplify(), inductor_fast.dtype_rules_set_once():
        yield


def test_inductor_writes_the_same_kernels_with_polynomials_expanded(monkeypatch):
    expanded = []
    real = inductor_fast.simplify

    def counting(expr, *args, **kwargs):
        if inductor_fast.is_plain_polynomial(expr):
            expanded.append(expr)
        return real(expr, *args, **kwargs)

    monkeypatch.setattr(inductor_fast._SympyWithPolynomialSimplify, "simplify", staticmethod(counting))
    rules_set = []
    init = dtype_propagation.DtypePropagationOpsHandler.__init__
    monkeypatch.setattr(dtype_propagation.DtypePropagationOpsHandler, "__init__",
                        lambda self: rules_set.append(1) or init(self))
    fast_out, fast_code = generated_code(fast=True)
    fast_rules_set = len(rules_set)
    plain_out, plain_code = generated_code(fast=False)
    assert len(expanded) > 10  # the patch was on the path Inductor took
    # Set up at most once in the fast compile (never where an earlier compile of this process left it set up),
    # once per operation written without the patch.
    assert fast_rules_set <= 1 and len(rules_set) - fast_rules_set > 100
    assert fast_code == plain_code
    torch.testing.assert_close(fast_out, plain_out, rtol=0, atol=0)


def test_the_dtype_handler_is_set_up_again_when_a_rule_changed_and_restored_after_the_last_compile():
    importlib.import_module("torch._inductor.lowering")  # registers the rules, as a compile would have
    handler_class = dtype_propagation.DtypePropagationOpsHandler
    original = vars(handler_class)["__init__"]
    rules = inductor_utils.op_dtype_propagation_rules
    set_up = []
    with inductor_fast.dtype_rules_set_once():
        with inductor_fast.dtype_rules_set_once():  # a compile within a compile: one patch for both
            counted = inductor_fast._original_dtype_init
            inductor_fast._original_dtype_init = lambda self: set_up.append(1) or counted(self)
            try:
                handler = handler_class()
                handler_class()
                assert len(set_up) <= 1  # at most once, however many handlers are asked for
                before = len(set_up)
                inductor_utils.register_op_dtype_propagation_rules("laplace_test_op", rules["add"].type_promotion_kind,
                                                                    None)
                assert callable(handler_class().laplace_test_op)  # a rule registered since: set up again
                assert len(set_up) == before + 1
                rules["add"] = dataclasses.replace(rules["add"])  # the same name, another object: set up again
                handler_class()
                assert len(set_up) == before + 2
            finally:
                inductor_fast._original_dtype_init = counted
                rules.pop("laplace_test_op", None)
                if "handler" in locals() and hasattr(handler, "laplace_test_op"):
                    delattr(handler, "laplace_test_op")
        assert vars(handler_class)["__init__"] is inductor_fast._init_when_rules_changed  # the outer compile goes on
    assert vars(handler_class)["__init__"] is original


def test_only_plain_polynomials_are_expanded():
    x0, x1 = sympy.symbols("x0 x1", integer=True)
    index = 8192 * x0 + 256 * x1 + 16
    assert inductor_fast.simplify(index.subs(x0, x0 + 1) - index) == 8192
    assert inductor_fast.is_plain_polynomial(index)
    for other in (FloorDiv(x0, 4) + x1, ModularIndexing(x0, 1, 16), x0 ** 2, sympy.Lt(x0, 4)):
        assert not inductor_fast.is_plain_polynomial(other)


# Each run is a fresh process: Inductor's probe results are cached per process (their libraries on disk).
_PROBES_IN_A_FRESH_PROCESS = r"""
import json, threading, torch
from torch._inductor import cpu_vec_isa
from laplace_passes.infra import inductor_fast

main_thread_probes, test_builds = [], []
check_build = cpu_vec_isa.VecISA.check_build
def counted(isa, code):
    if threading.current_thread() is threading.main_thread():
        main_thread_probes.append(str(isa))
    test_builds.append(str(isa))
    return check_build(isa, code)
cpu_vec_isa.VecISA.check_build = counted
from torch._inductor import codecache
headers = {"main": [], "background": []}
precompile = codecache._precompile_header
def recorded(*args, **kwargs):
    path = precompile(*args, **kwargs)
    headers["main" if threading.current_thread() is threading.main_thread() else "background"].append(path)
    return path
codecache._precompile_header = recorded
if BACKGROUND:
    inductor_fast.start_isa_probes()
    inductor_fast.start_isa_probes()  # once per process
    inductor_fast.wait_for_isa_probes()
    inductor_fast.wait_for_kernel_header()
valid = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
codecache.CppPythonBindingsCodeCache.load_async(
    '#include <torch/csrc/inductor/cpp_prefix.h>\nextern "C" void kernel(float* out) { out[0] = 1; }\n', "cpu")
flags = [[str(isa), isa.build_arch_flags()] for isa in cpu_vec_isa.valid_vec_isa_list()]
print(json.dumps({"valid": valid, "picked": str(cpu_vec_isa.pick_vec_isa()), "main_thread_probes": main_thread_probes,
                  "test_builds": test_builds, "flags": flags,
                  "probe_threads": sum(t.name == "laplace-isa-probes" for t in threading.enumerate()),
                  "headers": headers}))
"""


def _probes(background: bool) -> dict:
    code = _PROBES_IN_A_FRESH_PROCESS.replace("BACKGROUND", str(background))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_background_isa_probes_and_header_leave_inductor_what_its_own_would_find():
    inductor_alone, ahead = _probes(background=False), _probes(background=True)
    assert ahead["valid"] == inductor_alone["valid"] and ahead["picked"] == inductor_alone["picked"]
    assert ahead["main_thread_probes"] == [] and ahead["probe_threads"] == 0  # done, and nothing left to Inductor
    # Each valid instruction set's flags (AVX-512's bf16 found or not) as Inductor's own probes set them.
    assert ahead["flags"] == inductor_alone["flags"]
    candidates = inductor_fast._isas_the_cpu_reports(cpu_vec_isa)
    implied = sum(len(chain) - 1 for chain in inductor_fast._implication_chains(candidates))
    if implied and inductor_alone["valid"][:1] == [str(candidates[0])]:  # a valid strongest one answers for others
        assert len(ahead["test_builds"]) < len(inductor_alone["test_builds"]), (ahead, inductor_alone)
    if sys.platform == "linux" and torch._inductor.config.cpp_cache_precompile_headers:
        # The background built the header a kernel's build asks for: the same file, so the same flags.
        assert len(ahead["headers"]["background"]) == 1 and ahead["headers"]["main"] == ahead["headers"]["background"]
        assert inductor_alone["headers"]["background"] == [] and len(inductor_alone["headers"]["main"]) == 1
    if sys.platform == "linux" and inductor_alone["valid"]:
        assert inductor_alone["main_thread_probes"], inductor_alone  # the counting saw Inductor's own probes


def test_the_waits_return_at_once_when_nothing_was_started(monkeypatch):
    monkeypatch.setattr(inductor_fast, "_probes", None)
    inductor_fast.wait_for_isa_probes()
    inductor_fast.wait_for_kernel_header()


_FORK_DURING_THE_PROBES = r"""
import faulthandler, os, sys, threading
from laplace_passes.infra import inductor_fast
release = threading.Event()
inductor_fast._run_isa_probes = lambda: release.wait(60)  # the probes still running as the process forks
inductor_fast._precompile_kernel_header = lambda: None
inductor_fast.start_isa_probes()
if sys.argv[1] == "locked":  # another thread holds the lock of the probes' event as the process forks
    held = threading.Event()

    def hold_the_lock():
        with inductor_fast._probes_done._cond:
            held.set()
            release.wait(60)

    threading.Thread(target=hold_the_lock, daemon=True).start()
    assert held.wait(10)
pid = os.fork()
if pid == 0:
    faulthandler.dump_traceback_later(20, exit=True)
    inductor_fast.wait_for_isa_probes()
    inductor_fast.wait_for_kernel_header()
    os._exit(0)
release.set()
print("child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX")
@pytest.mark.parametrize("event", ["free", "locked"])
def test_a_child_forked_during_the_probes_does_not_wait_for_the_parents_thread(event):
    """The probes' thread is not in a forked child: its waits return, and Inductor probes what it needs itself;
    the fork does not wait for a lock another thread held."""
    # processes.run: a child hung within the fork is killed with its parent when the wait runs over.
    done = processes.run([sys.executable, "-c", _FORK_DURING_THE_PROBES, event], timeout=60)
    assert done.returncode == 0 and "child exit 0" in done.stdout, done.stderr[-3000:]


def test_the_inductor_inner_compiler_starts_the_probes_and_waits_for_them(monkeypatch):
    from laplace_passes.infra.inner import EagerCompiler, InductorCompiler

    calls = []
    monkeypatch.setattr("laplace_passes.infra.inner.start_isa_probes", lambda: calls.append("start"))
    monkeypatch.setattr("laplace_passes.infra.inner.wait_for_isa_probes", lambda: calls.append("wait"))
    EagerCompiler().start()
    assert calls == []
    InductorCompiler().start()
    assert calls == ["start"]
    gm = torch.fx.symbolic_trace(lambda x: (x.sin() + 1,))  # Inductor takes graphs returning a tuple
    compiled = InductorCompiler().compile(gm, [torch.randn(8)], "inference")
    assert calls == ["start", "wait"]
    x = torch.randn(8)
    torch.testing.assert_close(compiled([x])[0], x.sin() + 1)


def test_an_instruction_set_is_implied_only_by_a_stronger_one_with_its_macros():
    avx512, vnni, avx2 = cpu_vec_isa.VecAVX512(), cpu_vec_isa.VecAVX512VNNI(), cpu_vec_isa.VecAVX2()
    assert inductor_fast._implies(vnni, avx512) and not inductor_fast._implies(avx512, vnni)
    assert not inductor_fast._implies(avx512, avx2)  # other macros (CPU_CAPABILITY_AVX2), other flags
    assert inductor_fast._implication_chains([vnni, avx512, avx2]) == [[vnni, avx512], [avx2]]


def test_an_implied_instruction_set_reuses_the_stronger_ones_builds_and_builds_what_it_alone_asks(monkeypatch):
    """Answered from the stronger one's test builds where they match; a source it alone builds still goes to g++."""
    built = []
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda isa, code: built.append((str(isa), code)) or True)

    class FreshAVX512(cpu_vec_isa.VecAVX512):  # unequal to the process's AVX-512, so not answered from its caches
        pass

    avx512 = FreshAVX512()
    answers = {cpu_vec_isa.VecISA._avx_code: True}  # its bf16 test source was not built by the stronger one
    inductor_fast._probed_implied(avx512, answers)
    expects_bf16 = torch.cpu._is_avx512_bf16_supported() and sys.platform != "win32"
    assert built == ([("avx512", cpu_vec_isa.VecAVX512._avx512_bf16_code)] if expects_bf16 else [])
    assert "check_build" not in vars(avx512)  # the instance's own override is gone
