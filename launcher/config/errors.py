"""The error every config check raises: bad user input, named with the value and the fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad user input, caught before any process starts (exit code 2)."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
