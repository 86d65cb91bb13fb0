"""The error every config check raises: bad user input, named with the value and the fix."""

from __future__ import annotations

from typing import TypeVar

from launcher.base.sync_modes import Mode

M = TypeVar("M", bound=Mode)


class ConfigError(ValueError):
    """Bad user input, caught before any process starts (exit code 2)."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def not_a_choice(key: str, value: object, kind: type[Mode]) -> str:
    """What is wrong with ``key=value`` where ``kind``'s members are the choices: the value, the members, the fix."""
    shown = str(value).lower() if isinstance(value, bool) else value
    return f"{key}={shown!r} is not a choice; HINT: {key}={kind.spelled()}"


def _member(kind: type[M], value: object, key: str) -> M:
    """``value`` (a member, or the text of one) as a member of ``kind``; else a ConfigError naming both."""
    member = kind.of(value)
    if member is None:
        raise ConfigError(not_a_choice(key, value, kind))
    return member
