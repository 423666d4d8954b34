"""fla calls that have no PyTorch replacement: a report line and a clear error, never Triton's.

Two places can meet one:

* While Dynamo traces, a substitute that cannot express a call (a feature the
  replacement does not model, such as `fused_recurrent_gla(gv=...)`) leaves
  it to fla where Triton runs, and elsewhere puts a
  `laplace::fla_call_not_replaced` node in the graph in its place
  (`leave_to_fla`). The backend's `ReportFlaCalls` pass turns each such node
  into a report line (so `inspect()` shows it), and running the graph
  raises `FlaCallNotReplaced` naming the call and the reason.
* At run time, eagerly (a model run without compiling, or the fla side of a
  graph break): fla routes its Triton kernels through its own backend
  registry (`fla.backends`). `guard_fla_kernels` registers a backend of
  highest priority on every registry, which accepts only calls on such a
  device and raises `FlaCallNotReplaced` naming the kernel (and notes it in
  the latest report) instead of Triton's "0 active drivers".
"""

from __future__ import annotations

import os
import sys

import torch
from torch import Tensor

from laplace_passes.infra.report import PassRecord, last_report

# Devices on which fla's Triton kernels can run.
TRITON_DEVICE_TYPES = ("cuda", "xpu", "npu")


EAGER = "reached eagerly, outside a laplace-compiled graph"
EAGER_FIXES = (
    "It ran uncompiled: `torch.compile(model).generate(...)` calls the model's own forward (use "
    "`model.compile(backend=\"laplace\")`, then `model.generate(...)`); a graph break runs the code after it "
    "eagerly (`torch._dynamo.explain` shows where); and a function fla runs under `torch.compiler.disable` is "
    "never traced (laplace_passes.fla.install(import_fla=True) before the first call covers the ones it replaces)."
)


# Said first when the eager call ran inside torch.utils.checkpoint: the likeliest cause by far.
IN_CHECKPOINT = (
    "It ran inside torch.utils.checkpoint, eagerly: Dynamo could not trace the checkpointed block and ran it as "
    "it is (TORCH_LOGS=graph_breaks says why). A module that caches a value on itself in its forward, as fla's "
    "RotaryEmbedding does, is the usual cause: `torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint "
    "= True` before the first call lets Dynamo trace such a block (the cache is then set in the forward only, "
    "not again when the backward recomputes the block)."
)


class FlaCallNotReplaced(RuntimeError):
    """An fla call laplace_passes has no PyTorch replacement for, reached where Triton cannot run."""

    def __init__(self, call: str, reason: str, device: str = "cpu", in_checkpoint: bool = False):
        self.call, self.reason = call, reason
        where = (f"{EAGER_FIXES} The latest report's 'declined' table lists the call (pass fla_calls, graph "
                 "'eager')." if reason == EAGER else "The report's 'declined' table has its row (pass fla_calls).")
        if in_checkpoint:
            where = f"{IN_CHECKPOINT} {where}"
        super().__init__(f"{call} was not replaced by laplace_passes ({reason}), and fla's Triton kernel for it "
                         f"cannot run on {device}. {where}")


def triton_can_run(device: torch.device) -> bool:
    return device.type in TRITON_DEVICE_TYPES


@torch.library.custom_op("laplace::fla_call_not_replaced", mutates_args=())
def not_replaced_marker(x: Tensor, call: str, reason: str) -> Tensor:
    """Raise FlaCallNotReplaced on a device without Triton; elsewhere pass x on (fla runs the call)."""
    if not triton_can_run(x.device):
        raise FlaCallNotReplaced(call, reason, str(x.device))
    return x.clone()


@not_replaced_marker.register_fake
def _marker_fake(x, call, reason):
    return torch.empty_like(x)


not_replaced_marker.register_autograd(lambda ctx, grad: (grad, None, None))

MARKER = torch.ops.laplace.fla_call_not_replaced.default


def leave_to_fla(original, call: str, reason: str, args: tuple, kwargs: dict, placeholder):
    """A substitute's way out for a call it cannot express.

    Where fla's Triton kernels can run, fla runs the call (behind a graph
    break). Elsewhere the call becomes `placeholder()`, outputs of the right
    shapes, the first passed through `laplace::fla_call_not_replaced`: the
    graph is captured and reported, and running it raises FlaCallNotReplaced
    before any output is used (a graph break would make Dynamo run the whole
    frame in fla, and meet Triton's error instead).
    """
    first = next(value for value in (*args, *kwargs.values()) if isinstance(value, Tensor))
    if triton_can_run(first.device):
        return torch.compiler.disable(original, reason=f"{call}: {reason}")(*args, **kwargs)
    outputs = placeholder()
    marked = not_replaced_marker(outputs[0], call, reason)
    return (marked, *outputs[1:])


_GUARDED: set[int] = set()


def guard_fla_kernels() -> int:
    """Register the refusing backend on every fla kernel registry not yet guarded; return how many now."""
    backends = sys.modules.get("fla.backends")
    if backends is None:
        return 0
    guard_class = _guard_class(backends.BaseBackend)
    # fla keeps its registries in these module-level dicts; `BackendRegistry.register` is public.
    registries = [(f"{fn.__module__}.{fn.__name__}", r) for fn, r in backends._function_registries.items()]
    registries += [(f"fla.ops.{name}", r) for name, r in backends._operation_registries.items()]
    for owner, registry in registries:
        if id(registry) not in _GUARDED:
            registry.register(guard_class(owner))
            _GUARDED.add(id(registry))
    return len(_GUARDED)


def _guard_class(base):
    class LaplaceTritonGuard(base):
        """Accepts fla kernel calls on devices Triton cannot use, and refuses them clearly."""

        backend_type = "laplace_guard"
        priority = -1_000  # before every other backend (lower runs first)

        def __init__(self, owner: str):
            super().__init__()
            self.owner = owner

        def verify(self, function_name, *args, **kwargs):
            device = _first_device(args, kwargs)
            return (device is not None and not triton_can_run(device)), None

        def get_implementation(self, function_name):
            call = self.owner if self.owner.endswith(function_name) else f"{self.owner}.{function_name}"

            def refuse(*args, **kwargs):
                device = _first_device(args, kwargs)
                error = FlaCallNotReplaced(call, EAGER, str(device), in_checkpoint=_inside_eager_checkpoint())
                _declined_in_latest_report(f"{call}: not replaced: {EAGER}")
                raise error

            return refuse

    return LaplaceTritonGuard


def _inside_eager_checkpoint() -> bool:
    """Whether the Python stack runs torch.utils.checkpoint's own code (a checkpointed block run eagerly)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("torch", "utils", "checkpoint.py")):
            return True
        frame = frame.f_back
    return False


def triton_error_call(error: BaseException) -> str | None:
    """For Triton's "0 active drivers" error: the outermost fla function on its traceback, else None."""
    if not isinstance(error, RuntimeError) or "active drivers" not in str(error):
        return None
    traceback = error.__traceback__
    while traceback is not None:
        code = traceback.tb_frame.f_code
        module = traceback.tb_frame.f_globals.get("__name__", "")
        if module == "fla" or module.startswith("fla."):
            return f"{module}.{code.co_name}"
        traceback = traceback.tb_next
    return "an fla function"


def _first_device(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            return value.device
    return None


def _declined_in_latest_report(line: str) -> None:
    """A row of the latest report's 'declined' table (pass fla_calls, graph 'eager') for a call met eagerly."""
    try:
        report = last_report()
    except LookupError:  # nothing compiled yet: the error itself names the call
        return
    if any(line in p.declined for p in report.passes):
        return
    report.passes.append(PassRecord("fla_calls", "eager", False, 0, 0, "an fla call met outside the graphs",
                                    [line]))
