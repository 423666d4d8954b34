"""Inductor's codegen of a graph in another process, and its compiled graph loaded in this one.

    captured_codegen(compile_call)       runs a compile (compile_fx_inner inside) up to Inductor's codegen:
                                         the CodegenRequest the codegen would receive
    request.key                          what makes two codegens the same (None: not comparable, never sent)
    request.payload()                    the request as bytes for another process
    codegen_from_payload(payload)        the other process: Inductor's codegen, its result as bytes
    with answering_codegen(answers):     a codegen whose request key is in `answers` (key -> Future of
        compile_fx_inner(gm, ...)        those bytes) loads that result instead of generating code

Everything around the codegen stays Inductor's, in this process: its
decompositions, the inputs it checks, the post-compile steps (input
alignment, output strides), so a graph compiled elsewhere is wrapped as one
compiled here. Transport is Inductor's own (`torch._inductor.compile_fx_ext`,
what its subprocess compile mode sends), with one difference: the graph may
hold any op (Inductor's default refuses ops outside ATen and prims' safe
list, and the chunked forms hold `prims.iota`).

NOTE [what makes two codegens the same]
A result generated elsewhere is used only for a request with the same key:
the graph's code and that of its subgraphs, the values of its tensor
constants, each example input's layout (shape, stride, offset, dtype,
device, whether it requires grad), the inputs Inductor checks for
alignment, the codegen's keyword arguments but the graph's serial number,
the donated buffers of the tracing context and Inductor's portable
configuration. Inductor's codegen reads nothing else of the request (the
node metadata it reads, fake values, follow from the graph's code and its
inputs' layouts: each node's from its op and the values it takes). A request with
anything the key cannot compare (a callable argument, a custom pass in
Inductor's configuration, an input that is neither a tensor nor a number)
has no key and is never sent.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from laplace_passes.infra import logs

# Inductor's configuration entries that hold functions or passes: not in its portable configuration, so a
# process that received that configuration would compile with their defaults.
_UNPORTABLE_CONFIG = ("pre_grad_custom_pass", "joint_custom_pre_pass", "joint_custom_post_pass",
                      "post_grad_custom_pre_pass", "post_grad_custom_post_pass", "_pre_fusion_custom_pass",
                      "_fuse_ddp_communication_passes")


class CodegenRequest:
    """The arguments of Inductor's `fx_codegen_and_compile`, with the key of NOTE [what makes two codegens the same]."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence, inputs_to_check: Sequence[int],
                 graph_kwargs: Mapping[str, Any]) -> None:
        self.gm = gm
        self.example_inputs = list(example_inputs)
        self.inputs_to_check = list(inputs_to_check)
        self.graph_kwargs = dict(graph_kwargs)
        self.key = request_key(gm, example_inputs, inputs_to_check, graph_kwargs)

    def payload(self) -> bytes:
        """The request as Inductor's subprocess compile sends it, any op allowed in the graph."""
        from torch._inductor import config
        from torch._inductor.compile_fx_ext import (
            _current_fake_mode,
            _FakeTensorModeSerializer,
            _LoggerState,
            _LoweringSerializer,
            _VirtualizedSerializer,
            _WireProtocolInput,
        )
        from torch.fx._graph_pickler import GraphPickler, Options

        wire = _WireProtocolInput(
            self.gm, self.example_inputs, self.inputs_to_check, self.graph_kwargs,
            torch._guards.TracingContext.try_get(), config.save_config_portable(), _VirtualizedSerializer.serialize(),
            None, _LoggerState(), _LoweringSerializer(), _FakeTensorModeSerializer(_current_fake_mode()))
        return GraphPickler.dumps(wire, Options(ops_filter=None))


def captured_codegen(compile_call: Callable[[], Any]) -> CodegenRequest:
    """Run `compile_call` (a compile that reaches Inductor's codegen) up to the codegen: what it would receive."""
    captured: list[CodegenRequest] = []

    def capture(gm, example_inputs, inputs_to_check, compile_region_name=None, **graph_kwargs):
        captured.append(CodegenRequest(gm, example_inputs, inputs_to_check, graph_kwargs))
        raise _Captured()

    try:
        with _codegen_replaced(lambda original: capture):
            compile_call()
    except Exception:  # Inductor wraps what its codegen raises: ours, or an error before the codegen
        if not captured:
            raise
    if not captured:
        raise RuntimeError("the compile did not reach Inductor's codegen (Inductor's FX graph cache had it)")
    return captured[0]


class _Captured(Exception):
    """Stops a compile at its codegen (`captured_codegen`)."""


@contextlib.contextmanager
def answering_codegen(answers: Mapping[str, Future]) -> Iterator[list]:
    """Within it, a codegen whose request's key is in `answers` loads that answer; yields what was loaded.

    An answer that failed, or that fails to load, leaves the codegen to this
    process (the reason in the log): the same graph, generated here.
    """
    loaded: list[str] = []

    def answered(original):
        def codegen(gm, example_inputs, inputs_to_check, compile_region_name=None, **graph_kwargs):
            key = request_key(gm, example_inputs, inputs_to_check, graph_kwargs) if answers else None
            if key is not None and key in answers:
                try:
                    compiled = wait_and_load(answers[key], gm)
                except Exception as error:  # noqa: BLE001 - generated here instead, as without a helper
                    logs.log.info("the graph's code from the helper process not used (%s: %s); generating it "
                                  "here", type(error).__name__, error)
                else:
                    loaded.append(key)
                    return compiled
            return original(gm, example_inputs, inputs_to_check, compile_region_name, **graph_kwargs)

        return codegen

    with _codegen_replaced(answered):
        yield loaded


@contextlib.contextmanager
def _codegen_replaced(replacement) -> Iterator[None]:
    # compile_fx_inner calls the module's `fx_codegen_and_compile` by name.
    from torch._inductor import compile_fx

    original = compile_fx.fx_codegen_and_compile
    compile_fx.fx_codegen_and_compile = replacement(original)
    try:
        yield
    finally:
        compile_fx.fx_codegen_and_compile = original


def codegen_from_payload(payload: bytes) -> bytes:
    """Inductor's codegen and compile of a `CodegenRequest.payload()`; the compiled graph as bytes."""
    from torch._inductor.compile_fx_ext import _SerializedFxCompile, _WireProtocolPickledInput

    return _SerializedFxCompile._run_in_child(_WireProtocolPickledInput(payload)).value


def wait_and_load(answer: Future, gm: torch.fx.GraphModule):
    """The answer to a request, once it comes, loaded here (benchmarks/bench_compile.py times this wait)."""
    return load_answer(answer.result(), gm)


def load_answer(answer: bytes, gm: torch.fx.GraphModule):
    """The compiled graph `codegen_from_payload` made, loaded here (its kernels from the shared cache)."""
    from torch._inductor.compile_fx_ext import _OutOfProcessFxCompile, _WireProtocolPickledOutput
    from torch._inductor.output_code import CompiledFxGraphConstantsWithGm

    output = _WireProtocolPickledOutput(answer).deserialize(CompiledFxGraphConstantsWithGm(gm))
    _OutOfProcessFxCompile._postprocess(None, output)  # the helper's logs, warnings and metrics, replayed here
    return output.graph


def request_key(gm: torch.fx.GraphModule, example_inputs: Sequence, inputs_to_check: Sequence[int],
                graph_kwargs: Mapping[str, Any]) -> str | None:
    """NOTE [what makes two codegens the same]; None for a request the key cannot compare."""
    try:
        parts = [_graph_part(gm), [_input_part(x) for x in example_inputs], list(inputs_to_check),
                 _kwargs_part(graph_kwargs), _context_part(), _config_part()]
        return hashlib.sha256(pickle.dumps(parts, protocol=4)).hexdigest()
    except Exception:  # noqa: BLE001 - _NotComparable, or anything the key did not expect: never compared
        return None


class _NotComparable(Exception):
    pass


def _graph_part(gm: torch.fx.GraphModule) -> list:
    codes = [(name, module.code) for name, module in gm.named_modules() if isinstance(module, torch.fx.GraphModule)]
    constants = []
    for node in gm.graph.find_nodes(op="get_attr"):
        value = _attribute(gm, node.target)
        if isinstance(value, torch.Tensor):
            constants.append((node.target, _input_part(value), hashlib.sha256(
                value.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()))
        elif not isinstance(value, torch.fx.GraphModule):
            raise _NotComparable(f"constant {node.target} of type {type(value).__name__}")
    return [codes, constants]


def _attribute(gm: torch.nn.Module, target: str):
    value = gm
    for name in target.split("."):
        value = getattr(value, name)
    return value


def _input_part(x) -> tuple:
    if isinstance(x, torch.Tensor):
        if not all(isinstance(n, int) for n in (*x.shape, *x.stride(), x.storage_offset())):
            raise _NotComparable("an input with symbolic sizes")
        return ("tensor", tuple(x.shape), tuple(x.stride()), x.storage_offset(), str(x.dtype), str(x.device),
                x.requires_grad)
    if isinstance(x, (int, float, bool)) or x is None:
        return ("value", repr(x))
    raise _NotComparable(f"input of type {type(x).__name__}")


def _kwargs_part(graph_kwargs: Mapping[str, Any]) -> list:
    from torch._inductor.utils import BoxedBool

    part = []
    for name, value in sorted(graph_kwargs.items()):
        if name == "graph_id":  # a serial number of the compile, read by CUDA graphs only
            continue
        if isinstance(value, BoxedBool):
            value = bool(value)
        elif name == "boxed_forward_device_index" and value is not None:
            value = ("device index", value.value)
        elif isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
            value = tuple(value)
        elif not (isinstance(value, (int, float, bool, str)) or value is None):
            raise _NotComparable(f"codegen argument {name} of type {type(value).__name__}")
        part.append((name, value))
    return part


def _context_part() -> tuple:
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    return tuple(getattr(metadata, "bw_donated_idxs", None) or ())


def _config_part() -> bytes:
    from torch._inductor import config

    current = config.get_config_copy()
    if any(current.get(name) != config._config[name].default for name in _UNPORTABLE_CONFIG):
        raise _NotComparable("a custom pass in Inductor's configuration")
    return pickle.dumps(sorted(config.save_config_portable().items(), key=lambda item: item[0]), protocol=4)
