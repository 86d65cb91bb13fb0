"""Rank 0's output to the console and to its log (``logs.py``): ``python -S -u tee.py LOG IN OUT IN OUT``,
one process for both streams, handed (``pass_fds``) the read end of the rank's stdout pipe and the console's stdout,
then the same for stderr. Each chunk read goes to its console stream, then to the log, whole:
stdout and stderr stay apart on the console and do not cut each other's lines where both reach one terminal or
file (``2>&1``), as two ``tee`` processes would. It ends when the rank and every process holding its output have
ended, after writing what was left (a rank killed by SIGKILL loses nothing it wrote). Torch-free, and quick to
start: run as a file, without site-packages, it imports only the standard library, and setproctitle for its title
(``name_this_process``)."""

from __future__ import annotations

import os
import selectors
import signal
import sys

CHUNK = 65536


def tee(log_path: str, sources: dict[int, int]) -> None:
    """Copy each fd of ``sources`` (read end -> console fd) to its console fd and to ``log_path`` until every one
    is at its end."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # (the umask decides)
    with selectors.DefaultSelector() as selector:
        for source in sources:
            selector.register(source, selectors.EVENT_READ)
        while selector.get_map():
            for key, _ in selector.select():
                data = os.read(key.fd, CHUNK)
                if not data:
                    selector.unregister(key.fd)
                    continue
                for out in (sources[key.fd], log):
                    write_all(out, data)


def write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:  # a console gone (its reader ended): the log still gets every line
        pass


def name_this_process(log_path: str) -> None:
    """Titled as the launcher's other processes are (``titles.py``: what ps, top and py-spy show): whose output it
    passes on, and the run dir. setproctitle is in site-packages, which ``-S`` leaves off ``sys.path``: its
    directories are added for that one import (as site's start-up finds them, a virtual environment's first);
    without setproctitle there, the process stays untitled."""
    import importlib
    import site

    here = os.path.dirname(os.path.abspath(sys.executable))
    venvs = (
        [os.path.dirname(here)]
        if any(os.path.isfile(os.path.join(d, VENV)) for d in (here, os.path.dirname(here)))
        else []
    )
    sys.path += [d for d in site.getsitepackages([*venvs, sys.prefix]) if d not in sys.path]
    try:
        titles = importlib.import_module("titles")  # launcher/base/titles.py, beside this file
    except ImportError:
        return
    logs, name = os.path.split(os.path.abspath(log_path))
    rank = name.split(".")[0].replace("-", " ")  # rank-0.log: "rank 0"
    titles.name_process(f"tee {rank}", f"to the console and logs/{name}", os.path.dirname(logs))  # (fits its argv)


VENV = "pyvenv.cfg"  # beside a virtual environment's bin/ (site.py's test)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C to the terminal: the rank's to answer; this one drains
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    name_this_process(sys.argv[1])
    fds = [int(arg) for arg in sys.argv[2:]]
    tee(sys.argv[1], dict(zip(fds[::2], fds[1::2])))


if __name__ == "__main__":
    main()
