"""Passes over the torch-level graph Dynamo captures: finding and re-tiling GLA sites."""

from laplace_passes.fla.install import install as enable_fla_sites  # the name the README and notes use
from laplace_passes.fx.retile import RetileGLA
from laplace_passes.fx.sites import GlaSite

__all__ = ["GlaSite", "RetileGLA", "enable_fla_sites"]
