"""fla imported after a compile started: install the replacements the moment its import finishes.

A model may import fla inside `forward` (a lazy import), which runs while
Dynamo traces it, after the laplace backend was looked up. Without a hook,
Dynamo would trace fla's own functions: its naive ones silently as un-tiled
graph nodes, its chunk ones into Triton's driver error. So when a compile
starts before fla is imported, `install_after_import` puts a one-shot finder
on `sys.meta_path`: it lets the regular finders find fla, and once fla's
package has run, installs every replacement, so the traced calls that follow
become GLA sites as if fla had been imported first. Importing laplace_passes
adds no hook; only a compile does.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable


def install_after_import(install: Callable[[], object]) -> bool:
    """Run `install` right after fla is imported; False when fla is already imported or not installed."""
    if "fla" in sys.modules or any(isinstance(finder, _FlaFinder) for finder in sys.meta_path):
        return False
    if importlib.util.find_spec("fla") is None:
        return False
    sys.meta_path.insert(0, _FlaFinder(install))
    return True


class _FlaFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the other finders return for `fla`, once."""

    def __init__(self, install: Callable[[], object]):
        self._install = install

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "fla":
            return None
        sys.meta_path.remove(self)  # one shot, and find_spec below must not find this finder again
        spec = importlib.util.find_spec("fla")
        if spec is not None and spec.loader is not None:
            spec.loader = _InstallingLoader(spec.loader, self._install)
        return spec


class _InstallingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, install: Callable[[], object]):
        self._loader = loader
        self._install = install

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        # fla's package has run (its __init__ imports its layers and models): the functions to replace exist.
        self._install()
