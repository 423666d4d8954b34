"""Two fixed pieces of work timed on one thread, so first-compile seconds can be compared across machines.

    python -m benchmarks.reference_work          # prints both, median [min-max] of three runs each

A first compile is one thread of Python (Dynamo, AOT Autograd, the passes,
Inductor's codegen: graph building, code generation, sympy) and g++ runs
on the other cores. The matmul rate and copy bandwidth that the other rows
are read against say nothing about either, and the same code's first
compile took 22 s in one session and 33 s in another on machines of the
same kind. So `bench_compile` and `bench_paths` print, beside their compile
figures, the CPU seconds of:

- python: a torch.fx graph of 3,000 nodes built, its module's code
  generated, and copied with its code generated again; then sympy
  expansions of 58 cubic polynomials in three integer symbols (sympy's cache
  cleared first, the garbage collector paused);
- g++: one translation unit including ATen's vector headers (what every
  Inductor kernel library includes) with a small vectorised loop, compiled
  with -O3 -march=native to an object file (no link), by the compiler
  Inductor uses; the child's user and system seconds.

CPU seconds, not wall-clock, so other work on the machine moves them less
(a hypervisor's stolen time still does). They are read before first
compiles are compared: where they differ, so do the machines, or the same
machine's minutes. The compiler's seconds need the `resource` module (not
on Windows), and a compiler that runs the unit.
"""

from __future__ import annotations

import gc
import os
import subprocess
import tempfile
import time

from benchmarks.common import rusage_seconds, spread, stats

REFERENCE_SOURCE = r"""
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <cmath>
#include <cstdint>

extern "C" void kernel(const float* in, float* out, int64_t n) {
    using Vec = at::vec::Vectorized<float>;
    int64_t i = 0;
    for (; i + Vec::size() <= n; i += Vec::size()) {
        (Vec::loadu(in + i).neg().exp() + Vec(1.0f)).reciprocal().store(out + i);
    }
    for (; i < n; ++i) {
        out[i] = 1.0f / (1.0f + std::exp(-in[i]));
    }
}
"""


def python_seconds() -> float:
    """CPU seconds of this thread for the fixed Python work (module docstring)."""
    import sympy
    import torch
    import torch.fx
    from sympy.core.cache import clear_cache

    clear_cache()  # else a second run finds every expansion cached
    gc.collect()
    gc.disable()
    try:
        start = time.thread_time()
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        for i in range(3000):
            x = graph.call_function(torch.add if i % 2 else torch.mul, (x, i))
        graph.output(x)
        built = torch.fx.GraphModule(torch.nn.Module(), graph)
        torch.fx.GraphModule(torch.nn.Module(), built.graph.__deepcopy__())
        a, b, c = sympy.symbols("a b c", integer=True, nonnegative=True)
        for n in range(2, 60):
            sympy.expand((a + 2 * b + 3 * c + n) ** 3).subs(a, 7)
        return time.thread_time() - start
    finally:
        gc.enable()


def compiler_command(source: str, output: str) -> list[str]:
    """The compile of the reference unit: Inductor's C++ compiler, torch's headers, -O3 for this CPU."""
    import torch.utils.cpp_extension
    from torch._inductor.cpp_builder import get_cpp_compiler

    includes = [f"-I{path}" for path in torch.utils.cpp_extension.include_paths()]
    return [get_cpp_compiler(), "-std=c++17", "-O3", "-march=native", "-fPIC", *includes, "-c", source, "-o", output]


def compiler_seconds() -> float | None:
    """User and system seconds of one compile of the reference unit; None where it cannot be timed (no
    `resource` module, no compiler, or a failed compile)."""
    try:
        import resource
    except ImportError:  # Windows: no child's CPU seconds to read
        return None
    with tempfile.TemporaryDirectory(prefix="laplace_reference_") as folder:
        source = os.path.join(folder, "reference.cpp")
        with open(source, "w") as f:
            f.write(REFERENCE_SOURCE)
        try:
            command = compiler_command(source, os.path.join(folder, "reference.o"))
        except Exception:  # noqa: BLE001 - no compiler Inductor could use: nothing to time
            return None
        before = rusage_seconds(resource.RUSAGE_CHILDREN)
        try:
            done = subprocess.run(command, capture_output=True, text=True)
        except OSError:
            return None
        return rusage_seconds(resource.RUSAGE_CHILDREN) - before if done.returncode == 0 else None


def measure(repeats: int = 3) -> dict:
    """`stats` cells of both, in CPU seconds; "cxx_s" is None where the compile could not be timed."""
    python = [python_seconds() for _ in range(repeats)]
    cxx = [compiler_seconds() for _ in range(repeats)]
    return {"python_s": stats(python), "cxx_s": None if None in cxx else stats(cxx)}


def text(reference: dict) -> str:
    """One line: both figures, median [min-max]."""
    cxx_s = reference["cxx_s"]
    cxx = "g++ not timed (no compiler, or it failed)" if cxx_s is None else f"g++ {spread(cxx_s, '.2f')} s"
    return (f"  reference work, CPU seconds on one thread (first compiles compare across machines through these): "
            f"python {spread(reference['python_s'], '.2f')} s, {cxx}")


def main() -> dict:
    reference = measure()
    print(text(reference).strip(), flush=True)
    return reference


if __name__ == "__main__":
    main()
