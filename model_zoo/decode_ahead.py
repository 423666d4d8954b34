"""Decode through a step compiled ahead of time by AOTInductor: no Dynamo and no Python wrapper between steps.

    step = AheadOfTimeStep(model)                 # or model.ahead_of_time_step; generate(..., decode="ahead-of-time")
    loop = step.loop(step.state_buffer(prefill_states))   # compile_missing=False: only a library compiled already
    logits, greedy = loop(next_tokens)            # as DecodeStep's loop: the buffers advanced in place

NOTE [steps compiled ahead of time]: a `DecodeStep` call goes through
Dynamo (its cache lookup and the guards that choose between graphs), AOT
Autograd's runtime wrapper and Inductor's Python wrapper, which launches
each kernel from Python. At 1280 sequences of `tiny` those cost about a
tenth of a step. This step runs the same graph, after the same passes on
Dynamo's graph (the passes on ATen graphs, unrolling and the graph-size
budget, change nothing in a decode step for the cpu target and are not
run), compiled by AOTInductor into a shared library whose C++ runner
launches the kernels: a step is one call into C++ with the tokens, the buffers and
the model's weights (docs/benchmarks.md has the figures).

Nothing guards that library, so the step keeps Dynamo for what guards are
for, once per loop: a loop's first call is a fully guarded `DecodeStep`
call of the JIT-compiled graph (Inductor, as the JIT step; its inner
compiler also records which of the step's Dynamo graphs ran). The library
is the one compiled from that graph: the first loop that runs a graph
exports it with `torch.export` (the batch dimension dynamic within its
class: NOTE [batch classes] in `model_zoo.decode`) and compiles it with
AOTInductor; later calls of the loop run that library. A model changed in
a way Dynamo's guards see (a hook added, a dtype changed) runs another
graph, so another library; changed back, it runs the first graph and its
library again. The weights are inputs of the library, not constants in
it: each loop's first call looks them up on the model by the path Dynamo
read them from, so weights trained, loaded or replaced between loops are
the ones used. A loop made with ``compile_missing=False`` (generate's
"auto") compiles nothing: it runs a library already compiled for its
graph and batch class, in this process or on disk, and otherwise the
JIT-compiled graph, the step's report saying so.

A loop declines the library, and runs every later call through the
step's JIT-compiled graph (as a `DecodeStep`'s loop does: slower, never
wrong), where the library could not serve it: Dynamo split the step into
several graphs or ran none (its recompile limit), the batch is empty, the
tokens, a buffer or a weight is not on the CPU, a state buffer is not
dense in its layout (the library is compiled for dense buffers), a weight
no longer has the library's dtype, shape or strides, or the export or
compile failed (data-dependent control flow, an op AOTInductor cannot
compile). The step's report says why in its notes; with
LAPLACE_PASSES_STRICT=1 a failed export or compile raises.

Libraries are kept on disk, under Inductor's cache directory
(``TORCHINDUCTOR_CACHE_DIR``), keyed by the graph's code, every input's
dtype, shape, strides and device, the batch class, torch's version, the
source of laplace_passes and model_zoo, and the CPU (its model and flags:
Inductor compiles for the machine it runs on): a new process, or a new
model of the same architecture, loads one in seconds instead of compiling
it again (15 to 40 s for `tiny` on 2 cores). Inductor's own settings are
not part of the key: a program that changes them should use a cache
directory of its own.
"""

from __future__ import annotations

import atexit
import functools
import gc
import hashlib
import os
import pathlib
import platform
import re
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from laplace_passes.infra.fx_helpers import input_source
from laplace_passes.infra.inner import InductorCompiler
from laplace_passes.infra.logs import progress, progress_log
from laplace_passes.infra.report import GraphRecord
from laplace_passes.infra.strict import strict_mode
from model_zoo.decode import _LARGEST_BATCH, DecodeLoop, DecodeStep, batch_class

# Bumped when what a library takes or returns changes: older libraries on disk are then never loaded.
PACKAGE_FORMAT = "laplace-decode-aot/2"
CACHE_SUBDIR = "laplace_decode_aot"
# Where the step's graph inputs come from, as `input_source` names them (the step's `_step(tokens, states)`).
_STEP = "model_or_fn.__self__."  # the DecodeStep whose `_step` Dynamo traced: its model's tensors lie below
_TOKENS = "args[0]"
_STATE = re.compile(r"args\[1\]\[(\d+)\]$")
_BATCH_SIZE = re.compile(r"args(\[0\]|\[1\]\[\d+\])\.size\(\)\[0\]$")


class AheadOfTimeStep(DecodeStep):
    """A decode step whose loops run an AOTInductor library after their first, guarded call (see the module
    docstring). `target` and `options` are the laplace backend's, as for `DecodeStep`, but for `inner` (always
    Inductor, which also records the graph each call runs); `guards_once_per_loop` applies to the loops that run
    the JIT-compiled graph (a library evaluates no guard); `cache_dir` (default: a folder under Inductor's cache
    directory) is where the libraries are kept."""

    def __init__(self, model: torch.nn.Module, *, target: Any = "cpu", cache_dir: str | None = None,
                 **options: Any) -> None:
        if "inner" in options:
            raise TypeError("AheadOfTimeStep takes no inner= (see its docstring); DecodeStep does")
        self._calls = threading.local()  # per thread: the graphs a loop's guarded first call ran
        super().__init__(model, target=target, inner=_RecordingInductor(self), **options)
        self.cache_dir = cache_dir
        # (id of the graph's record, batch class, layout, tokens' dtype) -> (the record, kept alive so that its id
        # is not reused, and its library or None where declined)
        self._libraries: dict[tuple, tuple[GraphRecord, _Library | None]] = {}
        # (the same key, cache_dir) -> the path where no library was found.
        self._not_on_disk: dict[tuple, str] = {}

    def loop(self, states: Sequence[Tensor], *, compile_missing: bool = True) -> AheadOfTimeLoop:
        """A loop over the buffers `states`; `compile_missing=False` runs a library only where one is already
        compiled (in this process or on disk), and the JIT-compiled graph otherwise (generate's "auto")."""
        return AheadOfTimeLoop(self, states, compile_missing)

    def libraries_ready(self) -> int:
        """Libraries compiled or loaded from disk so far (one per graph, batch class and layout)."""
        return sum(library is not None for _, library in self._libraries.values())

    def first_call(self, tokens: Tensor, states: Sequence[Tensor], compile_missing: bool) -> tuple[tuple, Any]:
        """A loop's first call, fully checked and guarded (the JIT-compiled graph), and (library, weights) for
        the loop's later calls: the library of the graph this call ran, or None (see the module docstring)."""
        self._calls.ran = []
        try:
            out = self.logits_and_greedy(tokens, states)
            return out, self._library_for(self._calls.ran, tokens, states, compile_missing)
        finally:
            del self._calls.ran

    def _library_for(self, ran: list[GraphRecord], tokens: Tensor, states: Sequence[Tensor],
                     compile_missing: bool) -> tuple | None:
        """(library, the model's weights now) for a loop whose first call ran the graphs `ran`, or None."""
        why = _why_no_library(ran, tokens, states)
        if why is not None:
            return self._declined(tokens, why)
        (record,) = ran
        key = (id(record), _library_key(tokens.shape[0], states), tokens.dtype)
        if key not in self._libraries:
            missing = self._not_on_disk.get((key, self.cache_dir))
            if not compile_missing and missing is not None and not os.path.exists(missing):
                return None  # still none: looked up by its path alone, not the graph hashed again
            library = self._build(record.after, tokens, states, key[1], compile_missing)
            if isinstance(library, _NotOnDisk):  # a later loop may find one compiled by then
                self._not_on_disk[key, self.cache_dir] = library.path
                return None
            self._libraries[key] = (record, library)
        library = self._libraries[key][1]
        if library is None:
            return None
        weights = library.current_weights(self)
        if weights is None:  # Dynamo's guards on the weights make this rare
            return self._declined(tokens, "a weight no longer fits the library compiled for this graph")
        return library, weights

    def _build(self, graph: torch.fx.GraphModule, tokens: Tensor, states: Sequence[Tensor], key: tuple,
               compile_missing: bool) -> Any:
        try:
            return _Library.build(graph, self, tokens, states, key, self.cache_dir, compile_missing)
        except _NotOnDisk as missing:
            self._note(tokens, "runs its JIT-compiled graph: no library compiled ahead of time for it on disk "
                       "(generate(..., decode=\"ahead-of-time\") compiles one)")
            return missing
        except Exception as error:
            if strict_mode() and compile_missing:  # a loop that compiles nothing has nothing to fail loudly
                raise
            return self._declined(tokens, f"{type(error).__name__}: {error}")

    def _declined(self, tokens: Tensor, reason: str) -> None:
        self._note(tokens, f"not compiled ahead of time ({reason}); its loop runs the JIT-compiled graph")

    def _note(self, tokens: Tensor, what: str) -> None:
        self._add_note(f"decode step for {tokens.shape[0]} sequences {what}")


class AheadOfTimeLoop(DecodeLoop):
    """A loop of an `AheadOfTimeStep`: its first call guarded, the later ones in the library that call chose
    (or, where there is none, through the step's JIT-compiled graph, as a `DecodeStep`'s loop runs)."""

    def __init__(self, step: AheadOfTimeStep, states: Sequence[Tensor], compile_missing: bool = True) -> None:
        super().__init__(step, states)
        self.compile_missing = compile_missing
        self.chosen: tuple | None = None  # (library, weights) the first call chose; None: the JIT graph

    def _guarded(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        if self.tokens_like is not None:  # a later call of a loop that runs the JIT graph with every guard
            return super()._guarded(tokens)
        out, self.chosen = self.step.first_call(tokens, self.states, self.compile_missing)
        return out

    def _later_calls_skip_guards(self) -> bool:
        return self.chosen is not None or self.step.guards_once_per_loop

    def _later(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        if self.chosen is None:
            return super()._later(tokens)
        library, weights = self.chosen
        return library.run(tokens, self.states, weights)


class _RecordingInductor(InductorCompiler):
    """Inductor, as a `DecodeStep` compiles its graphs, recording in the step's ``_calls.ran`` the Dynamo graph
    each guarded first call of a loop runs."""

    def __init__(self, step: AheadOfTimeStep) -> None:
        self.step = step

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str) -> Callable:
        # Called while the backend compiles the newest Dynamo graph, whose record is the report's last.
        record = [g for g in self.step.report.graphs if g.kind == "dynamo"][-1]
        calls, recorded = self.step._calls, kind in ("inference", "forward")
        compiled = super().compile(gm, example_inputs, kind)

        def run(args):
            # A graph cut into partitions runs one compiled piece per partition: its record counts once.
            if recorded and hasattr(calls, "ran") and not any(r is record for r in calls.ran):
                calls.ran.append(record)
            return compiled(args)

        run._boxed_call = True  # Inductor's callable takes its inputs as one list, which it may clear
        return run


def _why_no_library(ran: list[GraphRecord], tokens: Tensor, states: Sequence[Tensor]) -> str | None:
    """Why no library can serve this loop (see the module docstring), or None."""
    if len(ran) != 1:
        return f"Dynamo split the step into {len(ran)} graphs" if ran else "Dynamo ran no graph of its own"
    if tokens.shape[0] == 0:
        return "no sequences"
    devices = {t.device.type for t in (tokens, *states)}
    if devices != {"cpu"}:
        return f"libraries are built for the CPU here, and the step's tensors are on {sorted(devices)}"
    if any(s.stride() != _like(s, s.shape[0], "meta").stride() for s in states):
        return "a state buffer is not dense in its layout (state_buffer makes dense ones)"
    return None


def _library_key(batch: int, states: Sequence[Tensor]) -> tuple:
    """A library serves one batch class (NOTE [batch classes]) and one layout of the state buffers."""
    klass = (1, 1, 1) if batch < 2 else batch_class(batch)
    return klass, tuple(_dim_order(s) for s in states)


def _dim_order(tensor: Tensor) -> tuple[int, ...]:
    """The dimensions of `tensor` from outermost to innermost in memory."""
    return tuple(sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), -d)))


@dataclass
class _Inputs:
    """Where each input of the traced graph comes from: "tokens", ("state", i), "batch" (a batch size), or
    ("weight", its path on the step: "model.norm.weight") for a tensor of the model."""

    roles: list

    @classmethod
    def of(cls, graph: torch.fx.GraphModule) -> _Inputs:
        return cls([_role(input_source(node)) for node in graph.graph.find_nodes(op="placeholder")])

    def check_whole(self, layers: int) -> None:
        """The graph takes the tokens and every layer's buffer: it is the whole step, not a piece of it."""
        taken = {role for role in self.roles if role[0] in ("tokens", "state")}
        missing = {("tokens",), *(("state", i) for i in range(layers))} - taken
        if missing:
            raise ValueError(f"the step's graph does not take {sorted(missing)}: it is not the whole step")

    def weights(self, step: DecodeStep) -> list[Tensor]:
        return [_resolve(step, role[1]) for role in self.roles if role[0] == "weight"]

    def arguments(self, tokens: Tensor, states: Sequence[Tensor], weights: Sequence[Tensor]) -> list:
        """The graph's inputs in order, from the step's tokens, buffers and weights."""
        weights = iter(weights)
        by_role = {"tokens": lambda _: tokens, "state": lambda r: states[r[1]], "weight": lambda _: next(weights),
                   "batch": lambda _: tokens.shape[0]}
        return [by_role[role[0]](role) for role in self.roles]


def _role(source: str) -> tuple:
    """The role of a graph input that Dynamo took from `source` (`input_source`'s name for it)."""
    if source == _TOKENS:
        return ("tokens",)
    if (state := _STATE.match(source)) is not None:
        return ("state", int(state.group(1)))
    if _BATCH_SIZE.match(source):
        return ("batch",)
    if source.startswith(_STEP):
        return ("weight", source.removeprefix(_STEP))
    raise ValueError(f"a graph input comes from {source}, neither the step's arguments nor the model")


def _resolve(step: DecodeStep, path: str) -> Tensor:
    """The tensor at `path` below the step ("model.layers.0.mlp_norm.weight"): modules, parameters and buffers are
    attributes of their module."""
    value: Any = step
    for name in path.split("."):
        if not name.isidentifier() and not name.isdigit():
            raise ValueError(f"model input {path} is not a tensor reached by attributes, modules and parameters")
        if not hasattr(value, name):
            raise ValueError(f"{type(value).__name__} has no module, parameter or buffer {name!r}")
        value = getattr(value, name)
    if not isinstance(value, Tensor):
        raise ValueError(f"model input {path} is not a tensor reached by attributes, modules and parameters")
    return value.detach()


def _spec(tensor: Tensor) -> tuple:
    """What a library's code depends on in a tensor: dtype, shape, strides and device."""
    return tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.device


class _NotOnDisk(Exception):
    """No library of the graph on disk, at `path`, and none to be compiled."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


class _Library:
    """One AOTInductor library of the step's graph and the weights it runs on."""

    def __init__(self, runner: Any, inputs: _Inputs, weights: list[Tensor]) -> None:
        self.runner, self.inputs = runner, inputs
        self.weight_specs = [_spec(w) for w in weights]
        _LOADED.add(self)

    def run(self, tokens: Tensor, states: Sequence[Tensor], weights: list[Tensor]) -> tuple[Tensor, Tensor]:
        logits, greedy = self.runner(tokens, list(states), weights)
        return logits, greedy

    def current_weights(self, step: DecodeStep) -> list[Tensor] | None:
        """The model's weights, looked up again (once per loop), or None when one no longer fits the library."""
        try:
            weights = self.inputs.weights(step)
        except (ValueError, AttributeError):
            return None
        return weights if [_spec(w) for w in weights] == self.weight_specs else None

    @classmethod
    def build(cls, graph: torch.fx.GraphModule, step: DecodeStep, tokens: Tensor, states: Sequence[Tensor],
              key: tuple, cache_dir: str | None, compile_missing: bool = True) -> _Library:
        """The library of `graph` for the batch class and layout `key`: loaded from disk, or compiled (raises
        `_NotOnDisk` where there is none and `compile_missing` is False)."""
        inputs = _Inputs.of(graph)
        inputs.check_whole(len(states))
        _check_outputs(graph, inputs)
        weights = inputs.weights(step)
        if any(w.device.type != "cpu" for w in weights):
            raise ValueError("libraries are built for the CPU here, and a weight of the model is not on it")
        (low, high, hint), _ = key
        examples = (torch.empty(hint, dtype=tokens.dtype), [_like(s, hint) for s in states], weights)
        path = _package_path(graph, examples, key, cache_dir)
        if os.path.exists(path):
            try:
                return cls(torch._inductor.aoti_load_package(path), inputs, weights)
            except Exception:  # a file another build of torch wrote, or a damaged one: compiled again below
                if not compile_missing:  # perhaps a passing failure (a full temp directory): left for others
                    raise
                os.remove(path)
        if not compile_missing:
            raise _NotOnDisk(path)
        _compile_package(graph, inputs, examples, (low, high), path)
        return cls(torch._inductor.aoti_load_package(path), inputs, weights)


# The libraries this process loaded. A loader unpacks its package into a folder of its own in the temp directory
# and removes it when destroyed, which the interpreter's shutdown does not always do: released at exit, so that
# no run leaves a folder behind.
_LOADED: weakref.WeakSet[_Library] = weakref.WeakSet()


@atexit.register
def _release_loaded_libraries() -> None:
    for library in list(_LOADED):
        library.runner = None
    gc.collect()


def _check_outputs(graph: torch.fx.GraphModule, inputs: _Inputs) -> None:
    """The graph is the whole step: it writes every layer's buffer and returns the logits [B, vocab] and the
    greedy tokens [B] (a graph Dynamo cut short before the rest of the step ran as Python would not)."""
    (output,) = graph.graph.find_nodes(op="output")
    results = output.args[0]
    shapes = [getattr(r.meta.get("example_value"), "shape", None) if isinstance(r, torch.fx.Node) else None
              for r in (results if isinstance(results, (tuple, list)) else [results])]
    if len(shapes) != 2 or shapes[0] is None or len(shapes[0]) != 2 or shapes[1] is None or len(shapes[1]) != 1:
        raise ValueError(f"the step's graph returns {shapes}, not logits [B, vocab] and tokens [B]: it is not the "
                         "whole step")
    placeholders = list(graph.graph.find_nodes(op="placeholder"))
    written = {n.args[0] for n in graph.graph.nodes if n.op == "call_method" and n.target == "copy_"}
    unwritten = [i for i, role in enumerate(inputs.roles) if role[0] == "state" and placeholders[i] not in written]
    if unwritten:
        raise ValueError("the step's graph does not write every state buffer: it is not the whole step")


def _like(buffer: Tensor, batch: int, device: Any = None) -> Tensor:
    """An empty dense buffer of `batch` sequences with `buffer`'s other sizes and its layout (dimension order)."""
    order = _dim_order(buffer)
    shape = (batch, *buffer.shape[1:])
    dense = torch.empty([shape[d] for d in order], dtype=buffer.dtype, device=device or buffer.device)
    return dense.permute([order.index(d) for d in range(buffer.dim())])


class _StepGraph(torch.nn.Module):
    """The traced graph with the step's arguments and the weights as its inputs (what is exported)."""

    def __init__(self, graph: torch.fx.GraphModule, inputs: _Inputs) -> None:
        super().__init__()
        self.graph_module, self.inputs = graph, inputs

    def forward(self, tokens: Tensor, states: list[Tensor], weights: list[Tensor]):
        return self.graph_module(*self.inputs.arguments(tokens, states, weights))


def _compile_package(graph: torch.fx.GraphModule, inputs: _Inputs, examples: tuple, batches: tuple[int, int],
                     path: str) -> None:
    tokens, states, weights = examples
    low, high = batches
    if low == high:  # a single sequence: torch specialises the size
        dynamic = None
    else:
        batch = torch.export.Dim("batch", min=low, max=high)
        dynamic = ({0: batch}, [{0: batch}] * len(states), [None] * len(weights))
    sequences = "1 sequence" if low == high else f"{low} to {high} sequences" if high < _LARGEST_BATCH else \
        f"{low} or more sequences"
    # Shown with no logging set up: the wait is long (15 to 40 s on 2 cores) and happens once per library.
    progress_log.warning("compiling the decode step for %s ahead of time (AOTInductor), once; the library is kept "
                         "in %s", sequences, os.path.dirname(path))
    with progress(f"decode step for {sequences}: export and AOTInductor compile"):
        program = torch.export.export(_StepGraph(graph, inputs), examples, dynamic_shapes=dynamic, strict=False)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Written whole or not at all: another process may be loading the same path.
        handle, staged = tempfile.mkstemp(prefix=".partial-", suffix=".pt2", dir=os.path.dirname(path))
        os.close(handle)
        try:
            torch._inductor.aoti_compile_and_package(program, package_path=staged)
            os.chmod(staged, 0o644)  # mkstemp's 0600 would keep a shared cache folder's libraries from others
            os.replace(staged, path)
        finally:
            if os.path.exists(staged):
                os.remove(staged)


def _package_path(graph: torch.fx.GraphModule, examples: tuple, key: tuple, cache_dir: str | None) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    tokens, states, weights = examples
    digest = hashlib.sha256()
    codes = [m.code for m in graph.modules() if isinstance(m, torch.fx.GraphModule)]  # sub-graphs' too
    for part in (PACKAGE_FORMAT, torch.__version__, _machine(), _source_digest(), *codes, repr(key),
                 repr([_spec(t) for t in (tokens, *states, *weights)])):
        digest.update(part.encode())
        digest.update(b"\0")
    for module in graph.modules():  # constants the passes made: their values are in the library
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.find_nodes(op="get_attr"):
            constant = functools.reduce(getattr, node.target.split("."), module)
            if isinstance(constant, Tensor):
                digest.update(f"{node.target} {_spec(constant)}".encode())
                digest.update(constant.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    folder = cache_dir or os.path.join(inductor_cache_dir(), CACHE_SUBDIR)
    return os.path.join(folder, digest.hexdigest()[:32] + ".pt2")


@functools.cache
def _machine() -> str:
    """The CPU a library is compiled for (Inductor compiles for the machine it runs on): its model and flags."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    described = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join([platform.machine(), platform.processor(), str(pick_vec_isa()), *described])


@functools.cache
def _source_digest() -> str:
    """The source of laplace_passes and model_zoo: the ops and passes a graph's code names can change under it."""
    import laplace_passes

    digest = hashlib.sha256()
    for package in (pathlib.Path(laplace_passes.__file__).parent, pathlib.Path(__file__).parent):
        for source in sorted(package.rglob("*.py")):
            digest.update(str(source.relative_to(package.parent)).encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()
