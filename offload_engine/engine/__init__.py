"""The engine: the manager, its sync facade, completions, stats and the handler contract.

It imports no medium: every medium stands on :mod:`offload_engine.engine.handler`.
"""
