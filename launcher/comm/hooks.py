"""Hooks that hold their owner weakly.

A hook registered on a tensor or module lives in C++ autograd state, invisible to Python's garbage collector: a
hook holding the reducer strongly would keep it, its topology and so the process groups (with their gloo threads)
alive until interpreter exit, where those threads crash the process (std::terminate) while it shuts down.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weak_hook(owner: object, method: str, *bound: object) -> Callable[..., None]:
    """A hook calling ``owner.method(*bound, *hook_args)`` while ``owner`` lives; nothing once it is gone."""
    ref = weakref.ref(owner)

    def hook(*args: Any) -> None:
        target = ref()
        if target is not None:
            getattr(target, method)(*bound, *args)

    return hook
