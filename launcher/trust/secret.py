"""The job's secret: only the job's own processes speak in its stores and its object collectives.

The head makes a fresh one for every job it starts (``Secret.new``) and hands it on without a command line: to
local processes (the keeper, simulated nodes, the local agent and so the ranks) in their environment
(``SECRET_ENV``, readable by their owner only: /proc/PID/environ is 0400), to ssh hosts in the first line of the
connection's stdin (``handoff_line`` / ``read_handoff``, with the environment the head forwards), to Slurm tasks
inside the task submitit pickles into a folder only its owner can read. A rank takes it out of its environment as
it starts, so what it starts later (data-loader workers, a user's subprocess) does not inherit it; a node process
keeps it in its own for the agent's workers.

Two uses (``launcher.trust.signed``): every key the launcher writes to a store lives under a namespace derived from the
secret (a stranger cannot guess the job's keys; torch's TCPStore lets any client list them, so this is not what
stops forgery), and every value carries an HMAC-SHA256 over its key and bytes (a value that does not verify is
ignored, or refused before it is unpickled). No torch here: the head uses it too."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from collections.abc import MutableMapping
from typing import Optional

log = logging.getLogger(__name__)

SECRET_ENV = "LAUNCHER_SECRET"
MAC_BYTES = 32  # HMAC-SHA256


class Secret:
    """A job's secret (32 random bytes). Never printed: its repr says nothing of it."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError(f"a job's secret needs at least 16 bytes, got {len(key)}")
        self._key = key

    @classmethod
    def new(cls) -> Secret:
        return cls(secrets.token_bytes(32))

    @classmethod
    def from_hex(cls, text: str) -> Secret:
        try:
            return cls(bytes.fromhex(text.strip()))
        except ValueError as exc:
            raise ValueError(f"{SECRET_ENV} is not the hex a launcher head writes ({exc})") from None

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] = os.environ, keep: bool = False) -> Optional[Secret]:
        """The secret this process was handed (taken out of ``environ`` unless ``keep``); None: none was."""
        text = environ.get(SECRET_ENV) if keep else environ.pop(SECRET_ENV, None)
        return cls.from_hex(text) if text else None

    def environ(self) -> dict[str, str]:
        """What a child process's environment needs to carry it."""
        return {SECRET_ENV: self._key.hex()}

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    def namespace(self) -> str:
        """The root of the job's keys in a store: derived from the secret, unguessable without it."""
        return "job-" + hmac.new(self._key, b"launcher store namespace", hashlib.sha256).hexdigest()[:24]

    def sign(self, key: str, value: bytes) -> bytes:
        """``value`` with its HMAC over ``key`` and ``value`` in front (a value moved to another key fails)."""
        return self._mac(key, value) + value

    def open(self, key: str, blob: bytes) -> Optional[bytes]:
        """The value of a signed ``blob`` read at ``key``; None when it does not verify."""
        mac, value = blob[:MAC_BYTES], blob[MAC_BYTES:]
        if len(blob) < MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, value)):
            return None
        return value

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).digest()


def handoff_line(environ: dict[str, str]) -> bytes:
    """Environment variables as the first line of a stdin (ssh: the job's secret and the forwarded environment,
    ``cluster.env`` included, never on a command line)."""
    return json.dumps(environ, sort_keys=True).encode() + b"\n"


def read_handoff(fd: int = 0) -> dict[str, str]:
    """The variables of ``handoff_line`` from the first line of ``fd`` (an ssh node process's stdin), read a byte at
    a time so nothing after it (the head's control words) is taken from the stream."""
    got = bytearray()
    while not got.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            raise ValueError("the head closed stdin before it sent the job's environment and secret")
        got += chunk
    environ = json.loads(got)
    if not isinstance(environ, dict) or not all(isinstance(v, str) for v in environ.values()):
        raise ValueError("the first line of stdin is not the environment a launcher head sends")
    return environ


class Refusals:
    """Says once per key that a value which does not verify was ignored (where it was read)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.said: set[str] = set()

    def __call__(self, key: str) -> None:
        if key not in self.said:
            self.said.add(key)
            log.warning(
                "ignored a value of %s in %s that does not verify: written by a process without the job's secret",
                key,
                self.where,
            )
