"""XLA (jaxlib's CPU client) as a second, independent consumer of the StableHLO laplace_passes exports.

IREE is the project's own executor for lowered graphs (`inner="iree"`); XLA is
another compiler of the same text, and the one that runs collectives: a
module with `stablehlo.all_to_all` runs as one SPMD program on W CPU
replicas, each with its own inputs.

    outputs = run_module(text, inputs)                          # one device
    per_replica = run_spmd(text, [inputs_of_rank_0, ...], 4)    # W replicas
    torch.compile(model, backend="laplace", options={"inner": XlaCompiler()})

API (jax/jaxlib 0.10.2): `xla_client.make_cpu_client(num_devices=N)` (a
private client, whatever XLA_FLAGS says), `CompileOptions` with
`num_replicas`, `client.compile_and_load(text, devices, options)`, and
`execute_sharded` over one array per parameter built from each replica's
buffer. XLA checks only each argument's byte size, so the parameter types
are checked here; 64-bit values cross under `jax.enable_x64`.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from functorch.compile import make_boxed_func

from laplace_passes.lowering.stablehlo import LoweredGraph, StableHLOCompiler, lowered_graph

jax = pytest.importorskip("jax", reason="XLA's CPU client comes with jax/jaxlib (the 'test' extra)")
xla_client = pytest.importorskip("jaxlib.xla_client")
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

# LLVM -O0: about twice as fast to compile the tiny model's graphs, the same numbers to float rounding.
FAST_COMPILE = [("xla_backend_optimization_level", "0")]


@functools.lru_cache(maxsize=None)
def _client(num_devices: int):
    return xla_client.make_cpu_client(num_devices=num_devices)


@functools.lru_cache(maxsize=16)
def _compile(text: str, num_replicas: int):
    """(executable, [(shape, numpy dtype)] of its parameters)."""
    client = _client(num_replicas)
    options = xla_client.CompileOptions()
    options.num_replicas, options.num_partitions = num_replicas, 1
    options.env_option_overrides = FAST_COMPILE
    executable = client.compile_and_load(text, client.devices()[:num_replicas], options)
    proto = executable.hlo_modules()[0].as_serialized_hlo_module_proto()
    parameters = xla_client.XlaComputation(proto).program_shape().parameter_shapes()
    return executable, [(tuple(p.dimensions()), np.dtype(p.numpy_dtype())) for p in parameters]


def run_spmd(text: str, inputs_per_replica: list[list[np.ndarray]], num_replicas: int) -> list[list[np.ndarray]]:
    """Run `text`'s @main on `num_replicas` CPU replicas, replica r on inputs_per_replica[r]; outputs per replica."""
    if len(inputs_per_replica) != num_replicas:
        raise ValueError(f"{len(inputs_per_replica)} input lists for {num_replicas} replicas")
    executable, parameters = _compile(text, num_replicas)
    for replica, inputs in enumerate(inputs_per_replica):
        given = [(np.shape(a), np.asarray(a).dtype) for a in inputs]
        if given != parameters:
            raise ValueError(f"replica {replica}: @main takes {parameters}, got {given}")
    devices = executable.local_devices()
    holder = NamedSharding(Mesh(np.array(devices), ("replica",)), PartitionSpec())  # only carries the buffers
    with jax.enable_x64(True):
        arrays = [
            jax.make_array_from_single_device_arrays(
                shape, holder, [jax.device_put(np.asarray(inputs[i], order="C"), device)
                                for inputs, device in zip(inputs_per_replica, devices)])
            for i, (shape, _) in enumerate(parameters)
        ]
        per_output = executable.execute_sharded(arrays).disassemble_into_single_device_arrays()
        return [[np.asarray(output[r]) for output in per_output] for r in range(num_replicas)]


def run_module(text: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    return run_spmd(text, [inputs], 1)[0]


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def to_torch(array: np.ndarray) -> torch.Tensor:
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(array, copy=True))


class XlaModule:
    """A lowered graph compiled by XLA, callable with torch tensors (outputs in the ATen graph's order)."""

    def __init__(self, lowered: LoweredGraph) -> None:
        self.lowered = lowered
        _compile(lowered.text, 1)

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        results = run_module(self.lowered.text, [to_numpy(t) for t in inputs])
        return self.lowered.assemble_outputs([to_torch(r) for r in results])


class XlaCompiler(StableHLOCompiler):
    """An inner compiler: lowered exactly as inner="stablehlo", then compiled by XLA and run on every call."""

    name = "xla"

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str):
        self.compiled = getattr(self, "compiled", []) + [kind]
        return make_boxed_func(XlaModule(lowered_graph(gm, example_inputs)))
