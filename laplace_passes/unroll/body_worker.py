"""The helper process's side of NOTE [bodies compiled in a helper process] (`body_helper`).

    python -m laplace_passes.unroll.body_worker

Reads requests from stdin, one frame each (a chunk-loop op, its arguments'
layouts, this process's Inductor configuration), compiles each body as the
process that sent it would (`compiled_bodies.compiled_source`), waits for
its kernels to be built into the shared Inductor cache, and answers on
stdout with the wrapper module's source, or the error. Exits at the end of
stdin or after `body_helper.IDLE_EXIT_S` without a request.
"""

from __future__ import annotations

import os
import time

import torch

from laplace_passes.unroll.body_helper import IDLE_EXIT_S, read_frame, write_frame


def answer(request: dict) -> dict:
    """{"source": the wrapper module's source, "seconds": ...}, or {"error": what went wrong}."""
    from laplace_passes.infra.kernel_batches import wait_for_builds
    from laplace_passes.unroll.compiled_bodies import compiled_source, signature_arguments

    start = time.perf_counter()
    try:
        namespace, name = request["op"].split("::")
        op = getattr(getattr(torch.ops, namespace), name).default
        with torch._inductor.config.patch(request["inductor_config"]):
            source = compiled_source(op, signature_arguments(request["args"]))
        wait_for_builds()  # its kernels in the cache before the parent loads them
    except Exception as error:  # noqa: BLE001 - reported to the parent, which compiles the body itself
        return {"error": f"{type(error).__name__}: {error}"}
    return {"source": source, "seconds": time.perf_counter() - start}


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else written to stdout stays out of the replies
    from laplace_passes.infra.inductor_fast import start_isa_probes

    start_isa_probes()
    while (request := read_frame(0, timeout=IDLE_EXIT_S)) is not None:
        write_frame(replies, answer(request))


if __name__ == "__main__":
    main()
