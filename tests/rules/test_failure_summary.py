"""A failure record's one-line summary (``report.failures.summarize``): the error's type and the first line of its
message, whatever follows it. Issue 51 met ``failed too: rank 0 ..., after a peer failed ( to Tensor)``: the last
line of a multi-line torch error (a comm hook's failed future, wrapped by torch) stood for the whole error."""

import os
import sys

import pytest
import torch.distributed as dist

from launcher.base.env import DistEnv
from launcher.base.run_dir import RunDir
from launcher.rank.work import ScriptExited, run_script
from launcher.report.failures import FailureLog, format_report, load_newest, summarize

# what a healing sim job's rank 0 raised when rank 1 failed (its comm hook's future failed; torch wrapped it)
WRAPPED = (
    "Unable to cast Got the following error when running the callback: RuntimeError: [/__w/pytorch/pytorch/"
    "third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:13017. This is typically "
    "caused by a remote worker crashing.\n\nAt:\n  /x/launcher/comm/collectives.py(50): _checked\n"
    "  /x/launcher/comm/collectives.py(59): <lambda>\n to Tensor"
)


def test_the_error_a_failed_callback_raised_not_torchs_wrapper_nor_its_last_line():
    assert summarize(RuntimeError(WRAPPED)) == (
        "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
        "peer [127.0.0.1]:13017. This is typically caused by a remote worker crashing."
    )


def test_the_type_and_the_first_line_of_any_message():
    assert summarize(ValueError("boom")) == "ValueError: boom"
    assert summarize(RuntimeError("first line\nsecond line\n third")) == "RuntimeError: first line"
    assert summarize(KeyError("x")) == "KeyError: 'x'"
    assert summarize(RuntimeError()) == "RuntimeError"
    backend = dist.DistBackendError("NCCL error\nmore")  # a qualified name: torch.distributed.DistBackendError
    assert summarize(backend) == "torch.distributed.DistBackendError: NCCL error"


def test_a_syntax_error_is_named_by_its_own_line_not_the_source_it_quotes():
    try:
        compile("x = (1,\n", "job.py", "exec")
    except SyntaxError as exc:
        said = summarize(exc)
    assert said.startswith("SyntaxError: ") and "(1," not in said, said


ARGPARSE_SCRIPT = """
import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float)
parser.parse_args()
"""


# the rank's entry catches the script's end and records it (``rank.entry``): here a function of that file's name
ENTRY = """
def catch(record, run, *args):
    try:
        run(*args)
    except ScriptExited as exc:
        record(exc)
        return exc
"""


def test_a_scripts_exit_status_is_reported_with_its_own_last_error_line(tmp_path, capsys, monkeypatch):
    """Issue 60, item 6 (edge 10): a script that exits 2 on its own (argparse refusing an argument) is reported with
    its status and its own last line on stderr, the error it exited on, not a bare ``ScriptExited`` under an empty
    traceback; ``sys.exit("message")`` says its message on stderr, as Python would, and is reported by it."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # run_script puts the script's folder first, as a rank's
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # Python would: not for the later tests of this process
    script, scope = tmp_path / "train.py", {"ScriptExited": ScriptExited}
    script.write_text(ARGPARSE_SCRIPT)
    exec(compile(ENTRY, "/x/launcher/rank/entry.py", "exec"), scope)  # noqa: S102 - the rank's frame, by its name
    run, env = RunDir(tmp_path / "run"), DistEnv(rank=1, world_size=2, hostname="box", launch_id="L")
    exited = scope["catch"](FailureLog(run, env).record, run_script, str(script), ["--bogus"])
    said = f"script {script} exited with status 2; its last line on stderr: train.py: error: unrecognized arguments: "
    assert (exited.code, summarize(exited)) == (2, f"ScriptExited: {said}--bogus")
    report = format_report(load_newest(run, "L"), run).splitlines()
    assert report[:2] == [f"launcher: rank 1 (pid {os.getpid()}) on box failed:", f"ScriptExited: {said}--bogus"]
    script.write_text("import sys\nsys.exit('no data under /data: HINT: --data=DIR')\n")
    with pytest.raises(ScriptExited) as info:
        run_script(str(script), [])
    assert str(info.value).endswith("status 1; its last line on stderr: no data under /data: HINT: --data=DIR")
    assert capsys.readouterr().err.endswith("no data under /data: HINT: --data=DIR\n")
