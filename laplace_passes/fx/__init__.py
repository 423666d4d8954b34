"""Passes over the torch-level graph Dynamo captures: finding and re-tiling GLA sites."""

from laplace_passes.fx.fla_sites import install as enable_fla_sites
from laplace_passes.fx.retile import RetileGLA
from laplace_passes.fx.sites import GlaSite, find_gla_sites

__all__ = ["GlaSite", "RetileGLA", "enable_fla_sites", "find_gla_sites"]
