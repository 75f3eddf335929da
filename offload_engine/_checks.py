"""Argument checks shared by the constructors (one home for each rule)."""

from __future__ import annotations

from offload_engine.errors import ConfigError


def check_int(
    value: object,
    what: str,
    *,
    minimum: int = 1,
    maximum: int | None = None,
    error: type[Exception] = ConfigError,
) -> int:
    """Return ``value`` if it is an int (a bool is not) in [minimum, maximum], else raise
    ``error`` with a message naming ``what``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        if maximum is not None:
            bound = f"an int in [{minimum}, {maximum}]"
        elif minimum == 1:
            bound = "a positive int"
        else:
            bound = f"an int >= {minimum}"
        raise error(f"{what} must be {bound}, got {value!r}")
    return value


def check_seconds(value: object, what: str, *, error: type[Exception] = ConfigError) -> float:
    """Return ``value`` as a positive number of seconds (a bool is not one), else raise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise error(f"{what} must be a positive number of seconds, got {value!r}")
    return float(value)
