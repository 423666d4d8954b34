"""The helper process's side of NOTE [bodies compiled in a helper process] (`body_helper`).

    python -m laplace_passes.unroll.body_worker

Reads requests from stdin, one frame each: a chunk-loop op, its arguments'
layouts and this process's Inductor configuration, or Inductor's codegen
request for a graph (`laplace_passes.infra.remote_codegen`). Compiles each
as the process that sent it would (`compiled_bodies.compiled_source`;
Inductor's codegen of the request), waits for its kernels to be built into
the shared Inductor cache, and answers on stdout with the wrapper module's
source or the compiled graph, or the error. Exits at the end of
stdin or after `body_helper.IDLE_EXIT_S` without a request.
"""

from __future__ import annotations

import os
import time

import torch

from laplace_passes.unroll.body_helper import IDLE_EXIT_S, read_frame, write_frame


def answer(request: dict) -> dict:
    """{"source": a chunk-loop body's wrapper module} or {"answer": a graph compiled, as bytes}, with its
    "seconds", once its kernels are in the cache; or {"error": what went wrong}."""
    from laplace_passes.infra.kernel_batches import wait_for_builds

    start = time.perf_counter()
    try:
        # The parent's compile_threads (`BodyHelper._request`): the kernels batched into the parent's libraries.
        with torch._inductor.config.patch(compile_threads=request["compile_threads"]):
            reply = _codegen(request) if "codegen" in request else _body(request)
        wait_for_builds()  # its kernels in the cache before the parent loads them
    except Exception as error:  # noqa: BLE001 - reported to the parent, which compiles it itself
        return {"error": f"{type(error).__name__}: {error}"}
    return {**reply, "seconds": time.perf_counter() - start}


def _body(request: dict) -> dict:
    from laplace_passes.unroll.compiled_bodies import compiled_source, signature_arguments

    namespace, name = request["op"].split("::")
    op = getattr(getattr(torch.ops, namespace), name).default
    with torch._inductor.config.patch(request["inductor_config"]):
        return {"source": compiled_source(op, signature_arguments(request["args"]))}


def _codegen(request: dict) -> dict:
    """Inductor's codegen as the parent runs it."""
    from laplace_passes.infra.inner import inductor_as_we_run_it
    from laplace_passes.infra.remote_codegen import codegen_from_payload

    with inductor_as_we_run_it():
        return {"answer": codegen_from_payload(request["codegen"])}


def main() -> None:
    # Both pipes on descriptors the processes this one starts (g++, Inductor's compile workers) do not inherit
    # (os.dup's are not inheritable): killed, this process closes its ends at once, and a request being
    # written to it fails there (NOTE [a stuck helper] in laplace_passes/unroll/body_helper.py).
    requests, replies, nothing = os.dup(0), os.fdopen(os.dup(1), "wb"), os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)
    os.close(nothing)
    os.dup2(2, 1)  # anything else written to stdout stays out of the replies
    from laplace_passes.infra.inductor_fast import start_isa_probes

    start_isa_probes()
    while (request := read_frame(requests, timeout=IDLE_EXIT_S)) is not None:
        write_frame(replies, answer(request))


if __name__ == "__main__":
    main()
