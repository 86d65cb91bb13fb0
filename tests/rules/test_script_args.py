"""Issue 47: a script's arguments after ``--`` reach it verbatim, as torchrun takes them: one ``script_args``
override, read back by Hydra and OmegaConf as typed (quotes, backslashes, commas, brackets, ``${...}``, ``=``),
frozen into the run dir and read back by every rank (every mode's ranks load the frozen config) into the script's
``sys.argv``; a ``script_args=`` Hydra cannot parse names the fix."""

import json
import sys

import pytest

from harness.config import plan
from launcher.commands.command_line import prepared
from launcher.config import ConfigError, freeze, load_frozen
from launcher.rank.work import run_script

ODD = ["config/x.py", "--device=cpu", "--lr=3e-4", 'say "hi"', "back\\slash", "a,b", "[x]", "${oc.env:HOME}",
       "it's", "", "=", 'end\\"', "tail\\", "x\\${y}", "$HOME", "--", "-m"]  # fmt: skip


def test_the_arguments_after_the_double_dash_arrive_verbatim(tmp_path):
    args = prepared(["script=tests/scripts/env_script.py", "train.max_steps=3", "--", *ODD])
    assert args[:2] == ["script=tests/scripts/env_script.py", "train.max_steps=3"]
    job, _ = plan(*args, run_dir=tmp_path)
    assert job.script_args == ODD


ARGV_SCRIPT = """import json, pathlib, sys
pathlib.Path(__file__).with_name("argv.json").write_text(json.dumps(sys.argv[1:]))
"""


def test_the_arguments_after_the_double_dash_reach_the_ranks_script_through_the_frozen_config(tmp_path, monkeypatch):
    """The head freezes the job into the run dir, each rank loads it and runs the script with its arguments: a
    ``${oc.env:HOME}`` arrives as typed, not as the home folder (nor any other resolved or unescaped text)."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # (run_script sets both, as a rank's process does)
    monkeypatch.setattr(sys, "path", list(sys.path))
    script = tmp_path / "argv_script.py"
    script.write_text(ARGV_SCRIPT)
    args = prepared([f"script={script}", "train.max_steps=3", "--", *ODD])
    job, _ = plan(*args, run_dir=tmp_path / "run")
    freeze(job)
    ranks = load_frozen(tmp_path / "run")
    assert ranks.script_args == ODD and ranks.script is not None
    run_script(ranks.script, ranks.script_args)
    assert json.loads((tmp_path / "argv.json").read_text()) == ODD


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
