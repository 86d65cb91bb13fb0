"""The job's secret at work (``launcher.trust.secret``): a store whose keys live under a namespace derived from the
secret and whose values only the job's processes can sign (``SignedStore``), and pickles that are refused before
unpickling unless a job's process made them (``dumps`` / ``loads``). A store has no access control: a client that
lists its keys (TCPStore's ``list_keys``) can still delete or overwrite a value, hiding it (a denial of service
the network must prevent), but never make the launcher act on a value of its own."""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from launcher.base.errors import LauncherError
from launcher.trust.secret import Refusals, Secret


class Forged(LauncherError):
    """Bytes that do not verify with the job's secret (never unpickled, never acted on): a refusal, the rank's own
    error (``Kind.error``)."""


class SignedStore(dist.Store):
    """``inner`` seen through the job's secret: every key under the secret's namespace, every value signed over its
    key. torch's own users of the store (gloo's rendezvous of the process group) read through ``get``, which
    refuses a value that does not verify; the launcher's own readers use ``read``, which ignores it (said once).
    ``add`` counters cannot be signed: the launcher acts on none (torch's barriers may count with them).
    ``prefix``: the keys' common prefix (an attempt's), signed with each key: a value replayed into another attempt
    does not verify."""

    def __init__(self, inner: dist.Store, secret: Secret, prefix: str = "", where: str = "the job's store") -> None:
        super().__init__()
        self.inner, self.secret, self.where = inner, secret, where
        self._root = f"{secret.namespace()}/{prefix}/" if prefix else f"{secret.namespace()}/"
        self._prefix = f"{prefix}/" if prefix else ""
        self._refused = Refusals(where)
        dist.Store.set_timeout(self, inner.timeout)  # type: ignore[attr-defined]

    def _key(self, key: str) -> str:
        return self._root + key

    def set(self, key: str, value: Any) -> None:
        data = value if isinstance(value, bytes) else str(value).encode()
        self.inner.set(self._key(key), self.secret.sign(self._prefix + key, data))  # type: ignore[arg-type]

    def read(self, key: str) -> Optional[bytes]:
        """The value at ``key`` if it is there and verifies; None otherwise (a forged one is said once)."""
        full = self._key(key)
        if not self.inner.check([full]):
            return None
        value = self.secret.open(self._prefix + key, self.inner.get(full))
        if value is None:
            self._refused(self._prefix + key)
        return value

    def read_all(self, keys: list[str]) -> list[Optional[bytes]]:
        """``read`` of keys the caller knows are there, in one round trip (``multi_get``): each value if it verifies,
        else None (a forged one is said once)."""
        values = self.inner.multi_get([self._key(k) for k in keys])
        opened = [self.secret.open(self._prefix + k, v) for k, v in zip(keys, values)]
        for key, value in zip(keys, opened):
            if value is None:
                self._refused(self._prefix + key)
        return opened

    def get(self, key: str) -> bytes:
        full = self._key(key)
        value = self.secret.open(self._prefix + key, self.inner.get(full))
        if value is None:
            self._refused(self._prefix + key)
            raise Forged(f"{key} in {self.where} does not verify: written by a process without the job's secret")
        return value

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(self._key(key), amount)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check([self._key(k) for k in keys])

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        names = [self._key(k) for k in keys]
        if timeout is None:
            self.inner.wait(names)
        else:
            self.inner.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)
        dist.Store.set_timeout(self, timeout)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        raise NotImplementedError("compare_set: a signed value cannot be compared unsigned (the launcher uses none)")


def guard(store: dist.Store, secret: Optional[Secret], prefix: str, where: str = "the job's store") -> dist.Store:
    """``store``'s keys under ``prefix``, behind the job's secret when there is one (else a plain PrefixStore:
    torchrun, Slurm, by hand)."""
    return dist.PrefixStore(prefix, store) if secret is None else SignedStore(store, secret, prefix, where)


OBJECT_KEY = "object"  # what an object collective's bytes are signed as


def dumps(obj: Any, secret: Optional[Secret]) -> bytes:
    data = pickle.dumps(obj)
    return data if secret is None else secret.sign(OBJECT_KEY, data)


def loads(blob: bytes, secret: Optional[Secret], source: str) -> Any:
    """Unpickle ``blob`` from ``source`` (e.g. "rank 3") only if it verifies with the job's secret."""
    if secret is None:
        return pickle.loads(blob)
    data = secret.open(OBJECT_KEY, blob)
    if data is None:
        raise Forged(f"the bytes from {source} do not verify with the job's secret: not unpickled")
    return pickle.loads(data)
