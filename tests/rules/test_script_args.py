"""Issue 47: a script's arguments after ``--`` reach it verbatim, as torchrun takes them: one ``script_args``
override, read back by Hydra and OmegaConf as typed (quotes, backslashes, commas, brackets, ``${...}``, ``=``);
a ``script_args=`` Hydra cannot parse names the fix."""

import pytest

from harness.config import plan
from launcher.commands.command_line import prepared
from launcher.config import ConfigError

ODD = ["config/x.py", "--device=cpu", "--lr=3e-4", 'say "hi"', "back\\slash", "a,b", "[x]", "${oc.env:HOME}",
       "it's", "", "=", 'end\\"', "tail\\", "x\\${y}", "$HOME", "--", "-m"]  # fmt: skip


def test_the_arguments_after_the_double_dash_arrive_verbatim(tmp_path):
    args = prepared(["script=tests/scripts/env_script.py", "train.max_steps=3", "--", *ODD])
    assert args[:2] == ["script=tests/scripts/env_script.py", "train.max_steps=3"]
    job, _ = plan(*args, run_dir=tmp_path)
    assert job.script_args == ODD


def test_no_double_dash_leaves_the_command_line_as_it_was():
    args = ["script=train.py", "script_args=[a,b]", "--cfg", "job"]
    assert prepared(args) == args


def test_script_args_twice_is_refused():
    with pytest.raises(ConfigError, match=r"given twice \(script_args= and after --\)"):
        prepared(["script=train.py", "script_args=[a]", "--", "b"])


def test_an_unparsable_script_args_names_the_double_dash_and_the_quoting():
    with pytest.raises(ConfigError) as refused:
        prepared(["script=train.py", "script_args=[config/x.py,--device=cpu]"])
    said = str(refused.value)
    assert "'script_args=[config/x.py,--device=cpu]' is not a list Hydra can read" in said
    assert "-- config/x.py --lr=3e-4" in said and '\'script_args=["config/x.py","--lr=3e-4"]\'' in said


def test_a_node_process_reads_back_the_jobs_words_verbatim():
    """The node process's command line carries what the job runs (``ps``, room for its title) after ``--``."""
    from launcher.base.node_args import NodeArgs

    args = NodeArgs("runs/x", 2, 1, "10.0.0.1:29500", "id", "10.0.0.2", members="a,b", words=("t.py", *ODD))
    assert NodeArgs.parse(args.argv("python")[4:]) == args
    plain = NodeArgs("runs/x", 2, 0, "10.0.0.1:29500", "id", "10.0.0.1", head_restarts=True, attempt=2)
    assert NodeArgs.parse(plain.argv("python")[4:]) == plain
