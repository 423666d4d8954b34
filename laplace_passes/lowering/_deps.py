"""Optional dependencies of the lowering inner compilers, imported only when used.

torch-mlir, iree-base-compiler and iree-base-runtime are the `lowering` extra
(`pip install -e ".[lowering]"`, versions pinned in setup.cfg). Nothing in
`laplace_passes` imports them at import time: a user of the eager or inductor
inner compilers never pays for them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL_HINT = (
    'install the lowering extra: pip install "laplace_passes[lowering]" '
    "(torch-mlir==20261001, iree-base-compiler==3.13.0, iree-base-runtime==3.13.0; "
    "install torch==2.13.0 first so pip keeps your torch build)"
)


class LoweringDependencyError(ImportError):
    """A package the lowering path needs is not installed."""


def require(module: str, package: str, purpose: str) -> ModuleType:
    """Import `module`, or fail naming the pip `package` and what it was needed for."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise LoweringDependencyError(
            f"{purpose} needs the package {package!r} (module {module!r} failed to import: {error}); {INSTALL_HINT}"
        ) from error


def torch_mlir_fx(purpose: str = "lowering ATen graphs to StableHLO") -> ModuleType:
    return require("torch_mlir.fx", "torch-mlir", purpose)


def iree_compiler(purpose: str = "compiling StableHLO with IREE") -> ModuleType:
    return require("iree.compiler", "iree-base-compiler", purpose)


def iree_runtime(purpose: str = "running IREE modules") -> ModuleType:
    return require("iree.runtime", "iree-base-runtime", purpose)


def check_stablehlo() -> None:
    """inner="stablehlo" can run: torch-mlir imports."""
    torch_mlir_fx('inner="stablehlo"')


def check_iree() -> None:
    """inner="iree" can run: torch-mlir, IREE's compiler and its runtime import."""
    torch_mlir_fx('inner="iree"')
    iree_compiler('inner="iree"')
    iree_runtime('inner="iree"')
