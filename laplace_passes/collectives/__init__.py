"""Collective rewrites (Muon's gather-and-broadcast into paired all-to-alls).

Not built yet: see the project's open issue on Muon communication.
"""
