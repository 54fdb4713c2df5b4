"""Exceptions that cross the public API (mirrors vllm/v1/engine/exceptions.py)."""


class EngineDeadError(RuntimeError):
    """The engine core died (its thread raised, or its process exited); every pending and
    future request fails with this."""
