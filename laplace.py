"""The name `laplace` in TORCH_LOGS: TORCH_LOGS="laplace" or "+laplace" shows what the laplace passes do.

torch reads TORCH_LOGS when it is imported, before any plugin, and accepts
only names it registered itself or importable modules. This empty module
makes `laplace` importable, so torch accepts the name and configures the
"laplace" logger, under which `laplace_passes.infra.logs` logs. Nothing else
imports it; there is nothing in it to use.
"""
