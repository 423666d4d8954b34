"""One call into torch-mlir: FX graph -> StableHLO module, its diagnostics captured.

torch-mlir prints the useful part of a failure ("failed to legalize operation
... name = \"torch.aten._linalg_eigh\"") to stderr through MLIR's diagnostic
handler, and raises with only "Failure while executing pass pipeline". We give
the importer our own MLIR context with a handler that keeps the messages, so
the error can name the op (see `diagnose.py`) and stderr stays quiet.
"""

from __future__ import annotations

import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from laplace_passes.lowering import _deps
from laplace_passes.lowering.clean_stablehlo import clean_module, dense_literal_hooks
from laplace_passes.lowering.collectives import has_collectives, import_with_collectives


class TorchMlirFailure(RuntimeError):
    """torch-mlir failed; `diagnostics` holds its messages and its exception text."""

    def __init__(self, diagnostics: str) -> None:
        super().__init__(diagnostics)
        self.diagnostics = diagnostics


def import_stablehlo(gm: torch.fx.GraphModule):
    """`torch_mlir.fx.stateless_fx_import(gm, output_type="stablehlo")`; the function is named `main`.

    Functional collectives become StableHLO collectives (`collectives.py`).
    Tensor literals are written inline (`dense<...>`, not `dense_resource`)
    and the module is cleaned for neuronx-cc (`clean_stablehlo.clean_module`:
    no f64 constants, no `arith` ops, no `dynamic_iota`) before it is returned.
    """
    tm_fx = _deps.torch_mlir_fx()
    from torch_mlir import ir
    from torch_mlir.compiler_utils import TorchMlirCompilerError
    from torch_mlir.dialects import torch as torch_dialect
    from torch_mlir.extras.fx_importer import FxImporter

    context = ir.Context()
    torch_dialect.register_dialect(context)
    messages: list[str] = []

    def keep(diagnostic) -> bool:
        messages.append(f"error: {diagnostic.message}")
        return True  # handled: not printed

    handler = context.attach_diagnostic_handler(keep)
    try:
        # Outside the compile's fake mode: the importer converts constants (real tensors) itself.
        with unset_fake_temporarily():
            if has_collectives(gm):  # torch-mlir refuses them: our own legalisation, then its pipelines
                module = import_with_collectives(gm, context, dense_literal_hooks())
            else:
                module = tm_fx.stateless_fx_import(
                    gm, output_type="stablehlo", fx_importer=FxImporter(context=context, hooks=dense_literal_hooks()),
                    model_name="main",
                )
        clean_module(module)
        return module
    except (TorchMlirCompilerError, ir.MLIRError) as error:
        raise TorchMlirFailure("\n".join([*messages, str(error)])) from error
    finally:
        handler.detach()
