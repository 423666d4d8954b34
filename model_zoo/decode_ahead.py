"""Decode through a step compiled ahead of time by AOTInductor: no Dynamo and no Python wrapper between steps.

    step = AheadOfTimeStep(model)                 # or model.ahead_of_time_step; generate(..., decode="ahead-of-time")
    loop = step.loop(step.state_buffer(prefill_states))
    logits, greedy = loop(next_tokens)            # as DecodeStep's loop: the buffers advanced in place

NOTE [steps compiled ahead of time]: a `DecodeStep` call goes through
Dynamo (its cache lookup and the guards that choose between graphs), AOT
Autograd's runtime wrapper and Inductor's Python wrapper, which launches
each kernel from Python. At 1280 sequences of `tiny` those cost about a
tenth of a step. This step runs the same graph, after the same passes,
compiled by AOTInductor into a shared library whose C++ runner launches
the kernels: a step is one call into C++ with the tokens, the buffers and
the model's weights (docs/benchmarks.md has the figures).

Nothing guards that library, so the step keeps Dynamo for what guards are
for, once per loop: a loop's first call is a fully guarded `DecodeStep`
call whose graph runs op by op (the eager inner compiler). When Dynamo
compiles a new graph there (the first call of a batch class, or a model
changed in a way its guards see), that graph is exported with
`torch.export` (the batch dimension dynamic within its class: NOTE [batch
classes] in `model_zoo.decode`) and compiled by AOTInductor; later calls
of the loop run the library. The weights are inputs of the library, not
constants in it: each loop's first call looks them up again on the model
by the path Dynamo read them from, so weights trained or loaded between
loops are the ones used, and a weight whose shape, dtype, layout or device
changed rebuilds the library. The state buffers' layout is part of the
library's key too.

Libraries are kept on disk, under Inductor's cache directory
(``TORCHINDUCTOR_CACHE_DIR``), keyed by the graph's code, every input's
dtype, shape and layout, the batch class, torch's version and the CPU's
vector ISA: a new process (or a new model of the same architecture) loads
one in well under a second instead of compiling it again (13 to 36 s for
`tiny` on 2 cores). Inductor's own settings are not part of the key: a
program that changes them should use a cache directory of its own.

When the export or the compile fails (a graph with data-dependent control
flow, an op AOTInductor cannot compile), the step says why in its report's
notes and runs that batch class through a `DecodeStep` instead, every call
guarded: slower, never wrong. With LAPLACE_PASSES_STRICT=1 the error is
raised.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from laplace_passes.infra.logs import progress
from laplace_passes.infra.strict import strict_mode
from model_zoo.decode import _LARGEST_BATCH, DecodeStep, batch_class

# Bumped when what a library takes or returns changes: older libraries on disk are then never loaded.
PACKAGE_FORMAT = "laplace-decode-aot/1"
CACHE_SUBDIR = "laplace_decode_aot"
_STEP = "L['model_or_fn'].__self__"  # Dynamo's source for the DecodeStep whose `_step` it traced
_TOKENS = "L['args'][0]"
_STATE = re.compile(r"L\['args'\]\[1\]\[(\d+)\]$")
_BATCH_SIZE = re.compile(r"L\['args'\](\[0\]|\[1\]\[\d+\])\.size\(\)\[0\]$")
_ATTRIBUTE = re.compile(r"\._(?:modules|parameters|buffers)\['([\w.]+)'\]|\.(\w+)")


class AheadOfTimeStep(DecodeStep):
    """A decode step whose loops run an AOTInductor library after their first, guarded call (see the module
    docstring). `target` and `options` are the laplace backend's, as for `DecodeStep`; `cache_dir` (default:
    a folder under Inductor's cache directory) is where the libraries are kept."""

    def __init__(self, model: torch.nn.Module, *, target: Any = "cpu", cache_dir: str | None = None,
                 **options: Any) -> None:
        super().__init__(model, target=target, inner="eager", **options)
        self.cache_dir = cache_dir
        self._libraries: dict[tuple, _Library | None] = {}  # (batch class, buffer layout) -> library; None: declined
        self._fallback: DecodeStep | None = None
        self._target, self._options = target, options
        self._graphs_seen = 0
        self._built = 0

    @torch.no_grad()
    def logits_and_greedy(self, tokens: Tensor, states: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """A fully checked and guarded step (its graph run op by op); then this batch's library is made, loaded
        or refreshed for the calls that follow (see the module docstring)."""
        out = super().logits_and_greedy(tokens, states)
        key = _library_key(tokens.shape[0], states)
        graphs = self._graphs_of_this_call()
        library = self._libraries.get(key)
        if len(graphs) > 1:  # a graph break: no one graph is the step
            self._libraries[key] = self._declined(tokens, f"Dynamo split the step into {len(graphs)} graphs")
        elif graphs:  # Dynamo compiled a graph for this call: its library replaces any earlier one
            self._libraries[key] = self._build(graphs[0], tokens, states, key)
        elif key not in self._libraries:  # cannot happen while Dynamo guards on the batch and the layout
            self._libraries[key] = self._declined(tokens, "Dynamo ran a graph this step did not see compiled")
        elif library is not None and not library.refresh(self):
            self._libraries[key] = self._build(library.graph, tokens, states, key)
        return out

    def _unguarded(self, tokens: Tensor, states: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        library = self._libraries.get(_library_key(tokens.shape[0], states))
        if library is None:  # declined (the reason is in the report's notes): every call guarded
            return self._jit_step().logits_and_greedy(tokens, states)
        return library.run(tokens, states)

    def libraries_built(self) -> int:
        """Libraries made or loaded so far (one per batch class and buffer layout, and one per rebuild)."""
        return self._built

    def _graphs_of_this_call(self) -> list[torch.fx.GraphModule]:
        """The Dynamo graphs (after the passes) that the call just made compiled: none, or the step's one graph,
        or its pieces where Dynamo broke it."""
        seen, self._graphs_seen = self._graphs_seen, self.graphs_compiled()
        return [g.after for g in self.report.graphs if g.kind == "dynamo"][seen:]

    def _build(self, graph: torch.fx.GraphModule, tokens: Tensor, states: Sequence[Tensor],
               key: tuple) -> _Library | None:
        try:
            library = _Library.build(graph, self, tokens, states, key, self.cache_dir)
        except Exception as error:
            if strict_mode():
                raise
            return self._declined(tokens, f"{type(error).__name__}: {error}")
        self._built += 1
        return library

    def _declined(self, tokens: Tensor, reason: str) -> None:
        self.report.notes.append(f"decode step for {tokens.shape[0]} sequences not compiled ahead of time "
                                 f"({reason}); its batch class runs through a DecodeStep, every call guarded")

    def _jit_step(self) -> DecodeStep:
        if self._fallback is None:
            self._fallback = DecodeStep(self.model, target=self._target, **self._options)
        return self._fallback


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
    ("weight", path on the step) for a tensor of the model."""

    roles: list

    @classmethod
    def of(cls, graph: torch.fx.GraphModule) -> _Inputs:
        roles = []
        for node in graph.graph.find_nodes(op="placeholder"):
            source = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
            roles.append(_role(source, node.name))
        return cls(roles)

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


def _role(source: Any, name: str) -> tuple:
    if not isinstance(source, str):
        raise ValueError(f"graph input {name} has no source Dynamo recorded")
    if source == _TOKENS:
        return ("tokens",)
    if (state := _STATE.match(source)) is not None:
        return ("state", int(state.group(1)))
    if _BATCH_SIZE.match(source):
        return ("batch",)
    if source.startswith(_STEP + "."):
        return ("weight", source[len(_STEP):])
    raise ValueError(f"graph input {name} comes from {source}, neither the step's arguments nor the model")


def _resolve(step: DecodeStep, path: str) -> Tensor:
    """The tensor at `path` (Dynamo's source below the step: ".model._modules['norm']._parameters['weight']")."""
    value: Any = step
    for key, attribute in _ATTRIBUTE.findall(path):
        value = getattr(value, attribute) if attribute else _member(value, key)
    if "".join(m.group(0) for m in _ATTRIBUTE.finditer(path)) != path or not isinstance(value, Tensor):
        raise ValueError(f"model input {path} is not a tensor reached by attributes, modules and parameters")
    return value.detach()


def _member(module: Any, key: str) -> Any:
    for table in ("_modules", "_parameters", "_buffers"):
        members = getattr(module, table, {})
        if key in members:
            return members[key]
    raise ValueError(f"{type(module).__name__} has no module, parameter or buffer {key!r}")


def _spec(tensor: Tensor) -> tuple:
    return tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.device


class _Library:
    """One AOTInductor library of the step's graph and the weights it runs on."""

    def __init__(self, runner: Any, graph: torch.fx.GraphModule, inputs: _Inputs, weights: list[Tensor]) -> None:
        self.runner, self.graph, self.inputs, self.weights = runner, graph, inputs, weights
        self.weight_specs = [_spec(w) for w in weights]

    def run(self, tokens: Tensor, states: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        logits, greedy = self.runner(tokens, list(states), self.weights)
        return logits, greedy

    def refresh(self, step: DecodeStep) -> bool:
        """The model's weights looked up again (once per loop); False when one no longer fits the library."""
        try:
            weights = self.inputs.weights(step)
        except ValueError:
            return False
        if [_spec(w) for w in weights] != self.weight_specs:
            return False
        self.weights = weights
        return True

    @classmethod
    def build(cls, graph: torch.fx.GraphModule, step: DecodeStep, tokens: Tensor, states: Sequence[Tensor],
              key: tuple, cache_dir: str | None) -> _Library:
        inputs = _Inputs.of(graph)
        inputs.check_whole(len(states))
        weights = inputs.weights(step)
        (low, high, hint), _ = key
        examples = (torch.zeros(hint, dtype=tokens.dtype), [_like(s, hint) for s in states], weights)
        path = _package_path(graph, examples, key, cache_dir)
        if not os.path.exists(path):
            _compile_package(graph, inputs, examples, (low, high), path)
        return cls(torch._inductor.aoti_load_package(path), graph, inputs, weights)


def _like(buffer: Tensor, batch: int) -> Tensor:
    """A zero buffer of `batch` sequences with `buffer`'s other sizes and its layout (dimension order)."""
    order = _dim_order(buffer)
    shape = (batch, *buffer.shape[1:])
    dense = torch.zeros([shape[d] for d in order], dtype=buffer.dtype, device=buffer.device)
    return dense.permute([order.index(d) for d in range(buffer.dim())])


class _StepGraph(torch.nn.Module):
    """The traced graph with the step's arguments and the weights as its inputs (what is exported)."""

    def __init__(self, graph: torch.fx.GraphModule, inputs: _Inputs) -> None:
        super().__init__()
        self.graph_module, self.inputs = graph, inputs

    def forward(self, tokens: Tensor, states: list[Tensor], weights: list[Tensor]):
        return self.graph_module(*self.inputs.arguments(tokens, states, weights))


def _compile_package(graph, inputs: _Inputs, examples: tuple, batches: tuple[int, int], path: str) -> None:
    tokens, states, weights = examples
    low, high = batches
    if low == high:  # a single sequence: torch specialises the size
        dynamic = None
    else:
        batch = torch.export.Dim("batch", min=low, max=high)
        dynamic = ({0: batch}, [{0: batch}] * len(states), [None] * len(weights))
    sequences = "1 sequence" if low == high else f"{low} to {high} sequences" if high < _LARGEST_BATCH else \
        f"{low} or more sequences"
    with progress(f"decode step for {sequences}: export and AOTInductor compile"):
        program = torch.export.export(_StepGraph(graph, inputs), examples, dynamic_shapes=dynamic, strict=False)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Written whole or not at all: another process may be loading the same path.
        handle, staged = tempfile.mkstemp(suffix=".pt2", dir=os.path.dirname(path))
        os.close(handle)
        try:
            torch._inductor.aoti_compile_and_package(program, package_path=staged)
            os.chmod(staged, 0o644)  # mkstemp's 0600 would keep a shared cache folder's libraries from others
            os.replace(staged, path)
        finally:
            if os.path.exists(staged):
                os.remove(staged)


def _package_path(graph: torch.fx.GraphModule, examples: tuple, key: tuple, cache_dir: str | None) -> str:
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    tokens, states, weights = examples
    digest = hashlib.sha256()
    for part in (PACKAGE_FORMAT, torch.__version__, str(pick_vec_isa()), graph.code, repr(key),
                 repr([_spec(t)[:3] for t in (tokens, *states, *weights)])):
        digest.update(part.encode())
        digest.update(b"\0")
    for node in graph.graph.find_nodes(op="get_attr"):  # constants the passes made: their values are in the library
        constant = functools.reduce(getattr, node.target.split("."), graph)
        if isinstance(constant, Tensor):
            digest.update(node.target.encode())
            digest.update(constant.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    folder = cache_dir or os.path.join(inductor_cache_dir(), CACHE_SUBDIR)
    return os.path.join(folder, digest.hexdigest()[:32] + ".pt2")
