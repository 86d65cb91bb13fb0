"""Ports for rendezvous stores: is one free here, take a free one."""

from __future__ import annotations

import socket

from launcher.config import ConfigError


def port_in_use(addr: str, port: int) -> str | None:
    """Why ``port`` cannot be bound on ``addr`` now, or None. Binds as the store does (SO_REUSEADDR): a previous
    run's socket in TIME_WAIT is no clash, a listener is."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def check_port(addr: str, port: int) -> None:
    """A fixed port must be free now; say which and how to fix it instead of a clash at rendezvous."""
    reason = port_in_use(addr, port)
    if reason and "assign requested address" in reason:
        raise ConfigError(
            f"cluster.master_addr={addr} is not an address of this machine ({reason}), and this machine hosts "
            "the rendezvous store (node 0); HINT: run node 0 on the machine cluster.master_addr names"
        )
    if reason:
        raise ConfigError(
            f"cluster.master_port={port} on {addr} is not free ({reason}); HINT: cluster.master_port=0 "
            "lets the launcher take a free port"
        )


def free_port(addr: str) -> int:
    """A port that is free on ``addr`` now (for agents that must all be told the port in advance)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]
