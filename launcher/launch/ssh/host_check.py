"""The check one host of an ssh job passes before anything starts (``+cluster=ssh``, run over ssh by the
head): ``python -m launcher.launch.ssh.host_check RUN_DIR TOKEN MASTER_ADDR PORT [NAMES]``.

Prints one JSON line, its ``HostFacts`` (the head reads it back with ``HostFacts.parse``): the host's name, the
address the head reached it on (from ``SSH_CONNECTION``), its GPU count, whether the tensorboard package is there,
how long a reverse look-up of the head's address takes, where it resolves MASTER_ADDR, and whether the run dir is the
head's (the token file the head wrote is there) and writable. With ``PORT`` other than "-" (only on the master
host), the port the rendezvous will use: a free one when ``PORT`` is 0, else ``PORT`` checked free. ``NAMES`` (the
job's hosts, comma-separated): each resolved, and each address found looked up in reverse, timed here
(``base/names.py``: c10d makes both on every store connection); the slow ones are said in ``slow_lookups``.
Problems go into ``problems``; the exit code is 0 whenever the JSON was printed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from launcher.base.names import slow_lookups, time_lookups
from launcher.base.run_dir import RunDir


@dataclass(frozen=True)
class HostFacts:
    """What one host's check found: one JSON line printed there (``line``), read by the head (``parse``)."""

    host: str  # its own name (socket.gethostname())
    addr: str  # its address, as the head reached it (SSH_CONNECTION's server side; "" without one)
    head: str  # the head's address, as this host sees it (SSH_CONNECTION's client side): where the keeper listens
    head_lookup_s: float  # a reverse look-up of ``head`` takes this long here (c10d makes one per connection)
    port: Optional[int]  # the master host's rendezvous port (None: not asked for, or not free)
    gpus: int
    tensorboard: bool  # the tensorboard package would import here
    problems: list[str]
    master_ip: str  # the address MASTER_ADDR resolves to here ("" where it does not)
    slow_lookups: list[str]  # each slow forward or reverse look-up of the job's names here, said with its fix

    def line(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, stdout: str, host: str) -> Optional[HostFacts]:
        """``host``'s facts from its check's output (its last line); None when that is no JSON object (the check
        failed before printing). A ``ValueError`` naming the host when the keys are not the ones read here."""
        try:
            raw: Any = json.loads(stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return None
        if not isinstance(raw, dict):
            return None
        keys = [f.name for f in fields(cls)]
        missing, unknown = [k for k in keys if k not in raw], sorted(set(raw) - set(keys))
        if missing or unknown:
            said = [f"without {', '.join(map(repr, missing))}"] if missing else []
            said += [f"with unknown {', '.join(map(repr, unknown))}"] if unknown else []
            raise ValueError(
                f"the host check on {host} answered {' and '.join(said)}: not this launcher's check; HINT: the same "
                "launcher version on every host (cluster.python, cluster.setup)"
            )
        return cls(**raw)


def check_this_host(
    run_dir: str, token: str, master_addr: str, port: str, names: str = "", keeper: str = "0"
) -> HostFacts:
    problems: list[str]
    name, problems = socket.gethostname(), []
    picked: Optional[int] = None  # the rendezvous port, on the master host
    connection = os.environ.get("SSH_CONNECTION", "").split()  # client address, port, server address, port
    addr = connection[2] if len(connection) == 4 else ""
    head = connection[0] if len(connection) == 4 else ""  # the head as this host sees it (the keeper)
    run = RunDir(run_dir)
    shared = run.host_check(token)
    try:
        if shared.read_text() != token:
            raise OSError("its content differs")
        mine = run.host_check_probe(token, name, os.getpid())
        mine.write_text(token)
        mine.unlink()
    except OSError as exc:
        problems.append(
            f"the run dir {run_dir} is not the head's or not writable here ({exc.strerror or exc}); HINT: the run "
            "dir must be on a file system every host shares (e.g. hydra.run.dir=/shared/runs/NAME)"
        )
    try:
        master_ip = socket.gethostbyname(master_addr)
    except OSError as exc:
        problems.append(
            f"cannot resolve cluster.master_addr={master_addr} ({exc}); HINT: set cluster.master_addr to an "
            "address every host reaches"
        )
        master_ip = ""
    if port != "-" and master_ip:
        from launcher.launch.ports import port_in_use

        if reason := port_in_use(master_ip, int(port)):
            hint = "cluster.master_port=0 takes a free one" if port != "0" else "is it this host's own address?"
            problems.append(f"cannot listen on {master_addr}:{port} here ({reason}); HINT: {hint}")
        elif port == "0":
            from launcher.launch.ports import free_port

            picked = free_port(master_ip)
        else:
            picked = int(port)
    from launcher.base.devices import gpu_count

    # the job's names both ways, this host's own name (torch's agent and gloo resolve it), and the head's address
    # where the head hosts the job's store (a keeper: c10d looks its peers up)
    lookups = time_lookups([n for n in (*names.split(","), master_addr, name, head if keeper == "1" else "") if n])
    found = next((x.seconds for x in lookups if x.kind == "reverse" and x.what == head), 0.0)
    slow = [x.said(name) for x in slow_lookups(lookups) if x.what != head]  # (the head's: head_lookup_s)
    tensorboard = findable("tensorboard")
    return HostFacts(name, addr, head, found, picked, gpu_count(), tensorboard, problems, master_ip, slow)


def findable(name: str) -> bool:
    """Whether ``name`` would import here (looked up, not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


if __name__ == "__main__":
    print(check_this_host(*sys.argv[1:7]).line(), flush=True)
