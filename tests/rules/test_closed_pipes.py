"""Issue 60, item 6 (edge 8): a command's console is a pipe whose reader has gone (``python -m launcher export RUN OUT
| head -1``): the rest of what it writes is dropped, no traceback, and the process goes on to its end
(``launcher.commands.pipes``; each command's ``main`` installs it: tests/jobs/test_export.py runs them so)."""

import io
import os
import sys

from launcher.commands.pipes import DroppingWrites, quiet_closed_pipes


def test_a_write_to_a_pipe_whose_reader_has_gone_is_dropped_and_the_pipe_left():
    read, write = os.pipe()
    os.close(read)  # the reader has gone (head -1 has its line)
    try:
        out = io.TextIOWrapper(io.BufferedWriter(DroppingWrites(write)), encoding="utf-8")
        print("a line nobody reads", file=out, flush=True)  # EPIPE: no BrokenPipeError
        print("and the next one", file=out, flush=True)
        assert os.path.samestat(os.fstat(write), os.stat(os.devnull))  # the descriptor: /dev/null from then on
    finally:
        os.close(write)


def test_stdout_and_stderr_are_wrapped_as_they_were(monkeypatch):
    read, write = os.pipe()
    try:
        raw = [io.FileIO(write, "w", closefd=False) for _ in range(2)]
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(raw[0]), encoding="ascii"))
        monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw[1], line_buffering=True, write_through=True))  # -u
        quiet_closed_pipes()
        assert isinstance(sys.stdout.buffer.raw, DroppingWrites) and sys.stdout.fileno() == write  # type: ignore
        assert isinstance(sys.stderr.buffer, DroppingWrites) and sys.stderr.write_through  # (unbuffered stays so)
        assert (sys.stdout.encoding, sys.stdout.line_buffering, sys.stderr.line_buffering) == ("ascii", False, True)
        print("through", flush=True)
        sys.stderr.write("and unbuffered")
        assert os.read(read, 100) == b"through\nand unbuffered"
    finally:
        os.close(read)
        os.close(write)
