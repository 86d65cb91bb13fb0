"""The manual read as a reviewer reads it (issue 51), by reading files only: README.md, docs/*.md, bench/README.md.

- Every test it cites exists: each ``tests/...`` path (a file or a folder), each ``tests/x.py::name`` (a ``def`` or
  ``class`` of that name in the file; a ``[param]`` id's parts appear in it), each test named bare in code
  (`` `test_launch` ``: a test module or a test function somewhere under tests/).
- No sample holds the developer's machine: no path of this checkout, no home folder
  (``/root``, ``/home/NAME``, ``/Users/NAME``), no temporary run dir (``/tmp/...``, ``/var/tmp/...``,
  ``pytest-of-...``) except the few fixed places a script of this repository documents (``DOCUMENTED_TMP``), and in
  code (fenced blocks and inline spans) no host name of the machine the samples were made on (``RECORDED_HOSTS``;
  not this machine's, which may be any word: a clone on a host named ``node`` passes). A sample says ``runs/...``
  for a run dir and ``<host>`` for the machine's name.
- Sample tracebacks are illustrative: a frame of this repository's code writes ``line N`` (line numbers move with
  every edit), and its file, its function and the statement it shows exist (so a renamed function or a rewritten
  line is caught instead).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness import REPO

DOCS = sorted([REPO / "README.md", REPO / "bench" / "README.md", *(REPO / "docs").glob("*.md")])
TESTS = REPO / "tests"

# a cited test: tests/<path>, optionally ::name and a [param] id
CITED = re.compile(r"(?<![\w/.-])(tests/[\w./-]*[\w/])(?:::(\w+)(?:\[([^\]\s`]+)\])?)?")
BARE = re.compile(r"`(test_\w+)`")  # a test named alone in code: `test_launch`, `test_store_and_gloo_...`

# /tmp places a script of this repository creates or tells the user to create, with the script that says so
DOCUMENTED_TMP = {
    "launcher-slurm": "slurm/start-cluster.sh",  # the local Slurm's root (LAUNCHER_SLURM_ROOT's default)
    "launcher-ssh-hosts": "scripts/ssh-hosts/start.sh",  # the ssh test machines' state (SSH_HOSTS_STATE's default)
    "tfvenv": "bench/torchft_heal.py",  # torchft's venv, made by the set-up in the script's docstring
}
TMP = re.compile(r"(?<![\w.~-])/(?:var/)?tmp/([\w.*-]+)")
HOMES = re.compile(r"(?<![\w.~-])/(?:root|home/[\w.-]+|Users/[\w.-]+)(?=/|\b)")
RECORDED_HOSTS = ("vm",)  # the machine the samples of 2026-11 were recorded on (`hostname`: vm)
# names the docs use on purpose: the ssh test machines (vm1.., dbgvm1..), the local Slurm's nodes, examples

FRAME = re.compile(r'^[ \t]*File "([^"]+)", line (\w+), in (\S+)[ \t]*\n[ \t]*(.*)$', re.MULTILINE)
REPO_ROOTS = ("launcher/", "tests/", "models/", "bench/", "scripts/")


def lines_of(text: str, start: int) -> int:
    return text.count("\n", 0, start) + 1


def where(doc: Path, text: str, start: int) -> str:
    return f"{doc.relative_to(REPO)}:{lines_of(text, start)}"


def code_of(text: str) -> list[tuple[int, str]]:
    """(offset, text) of each fenced block (indented ones too) and each inline code span."""
    fenced = list(re.finditer(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", text, flags=re.MULTILINE | re.DOTALL))
    outside = text
    for m in fenced:  # blanked, offsets kept
        outside = outside[: m.start()] + re.sub(r"[^\n]", " ", m.group()) + outside[m.end() :]
    spans = re.finditer(r"`([^`\n]+(?:\n[^`\n]+)?)`", outside)  # an inline span may wrap once
    return [(m.start(1), m.group(1)) for m in fenced] + [(m.start(1), m.group(1)) for m in spans]


def module_paths() -> dict[str, Path]:
    return {p.stem: p for p in TESTS.rglob("test_*.py")}


def defines(path: Path, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b", path.read_text(), re.M) is not None


def cited_test_problems(doc: Path, text: str) -> list[str]:
    problems = []
    for m in CITED.finditer(text):
        path, name, param = m.group(1), m.group(2), m.group(3)
        target = REPO / path
        if not target.exists():
            problems.append(f"{where(doc, text, m.start())}: {path} does not exist")
        elif name and not (target.is_file() and defines(target, name)):
            problems.append(f"{where(doc, text, m.start())}: {path} defines no {name}")
        elif param and (missing := [p for p in param.split("-") if p not in target.read_text()]):
            problems.append(f"{where(doc, text, m.start())}: {path}::{name}[{param}]: {missing} not in the file")
    return problems


def bare_test_problems(doc: Path, text: str, modules: dict[str, Path], written: str) -> list[str]:
    """``written``: what the launcher writes (its source, the configuration reference): a word of it named in code
    (`test_fraction`, a key; `test_metrics`, a field of summary.json) is no test."""
    problems = []
    for m in BARE.finditer(text):
        name = m.group(1)
        if name in modules or f"{name}_processes" in modules or re.search(rf"\b{name}\b", written):
            continue  # a module (jobs/<name>_processes.py holds a module's process tests), or the launcher's word
        if not any(defines(path, name) for path in modules.values()):
            problems.append(f"{where(doc, text, m.start())}: `{name}` is no test module or test under tests/")
    return problems


def machine_problems(doc: Path, text: str) -> list[str]:
    problems = []
    root = str(REPO)  # this checkout (not its parent: a clone under /tmp or /opt, whose paths the docs may name)
    for m in re.finditer(rf"(?<![\w.-]){re.escape(root)}(?=/|\b)", text):
        problems.append(f"{where(doc, text, m.start())}: {root} is this checkout; HINT: a relative path")
    for m in HOMES.finditer(text):
        problems.append(f"{where(doc, text, m.start())}: {m.group()} is a home folder; HINT: a relative path")
    for m in TMP.finditer(text):
        if m.group(1) not in DOCUMENTED_TMP:
            problems.append(f"{where(doc, text, m.start())}: {m.group()} is a temporary dir; HINT: runs/... instead")
    for m in re.finditer(r"(?<!/tmp/)pytest-of-", text):  # (elsewhere than /tmp: macOS's /private/var/...)
        problems.append(f"{where(doc, text, m.start())}: a pytest temporary dir; HINT: runs/... instead")
    for start, code in code_of(text):  # (the machines the samples were recorded on; not this one, whose name may
        for host in RECORDED_HOSTS:  # be any word the docs use: node, head, main)
            for m in re.finditer(rf"(?<![\w.<-]){re.escape(host)}(?![\w>-])", code):
                problems.append(
                    f"{where(doc, text, start + m.start())}: host name {host!r} of the machine the sample was made "
                    "on; HINT: <host>"
                )
    return problems


def frame_problems(doc: Path, text: str) -> list[str]:
    problems = []
    for m in FRAME.finditer(text):
        path, line, function, statement = m.group(1), m.group(2), m.group(3), m.group(4).strip()
        rel = path.removeprefix(".../").removeprefix(str(REPO) + "/")
        if not rel.startswith(REPO_ROOTS):
            continue  # Python's, torch's or another package's frame
        at = where(doc, text, m.start())
        source = REPO / rel
        if not source.is_file():
            problems.append(f"{at}: {rel} does not exist")
            continue
        if line != "N":
            problems.append(f"{at}: {rel} line {line}: sample tracebacks are illustrative; HINT: write line N")
        if function != "<module>" and not defines(source, function):
            problems.append(f"{at}: {rel} has no function {function}")
        shown = statement if statement and not statement.startswith(("File ", "...", "^")) else ""
        if shown and shown not in source.read_text():
            problems.append(f"{at}: {rel} has no line {shown!r}")
    return problems


def test_the_docs_are_the_ones_this_test_reads():
    names = {doc.relative_to(REPO).as_posix() for doc in DOCS}
    assert {"README.md", "bench/README.md", "docs/running.md", "docs/configuration-reference.md"} <= names


def test_every_test_the_docs_cite_exists():
    sources = [*(REPO / "launcher").rglob("*.py"), REPO / "docs" / "configuration-reference.md"]
    modules, written = module_paths(), "\n".join(path.read_text() for path in sources)
    problems = []
    for doc in DOCS:
        text = doc.read_text()
        problems += cited_test_problems(doc, text) + bare_test_problems(doc, text, modules, written)
    assert not problems, "the docs cite tests that do not exist:\n" + "\n".join(problems)


def test_no_sample_shows_the_developers_machine():
    problems = [p for doc in DOCS for p in machine_problems(doc, doc.read_text())]
    assert not problems, "the docs show the machine they were written on:\n" + "\n".join(problems)


def test_the_documented_temporary_places_are_documented_where_named():
    for name, script in DOCUMENTED_TMP.items():
        assert name in (REPO / script).read_text(), f"/tmp/{name}: {script} no longer names it; drop it here"


def test_sample_tracebacks_name_real_code_and_no_line_numbers():
    problems = [p for doc in DOCS for p in frame_problems(doc, doc.read_text())]
    assert not problems, "sample tracebacks that the code no longer matches:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "sample",
    [
        "see tests/rules/test_nothing_here.py",
        "`tests/jobs/test_launch.py::test_that_was_never_written`",
        "`test_no_such_module_or_test`",
    ],
)
def test_a_citation_of_a_missing_test_is_caught(sample):
    doc = REPO / "docs" / "x.md"
    assert cited_test_problems(doc, sample) + bare_test_problems(doc, sample, module_paths(), "")


@pytest.mark.parametrize(
    "sample",
    [
        "[launcher] run dir     : /tmp/h3",
        "launcher: log of rank 1: /tmp/pytest-of-root/pytest-3/test_x0/logs/rank-1.log",
        '  File "/root/launcher/launcher/base/faults.py", line 55, in fire',
        "```\nlauncher: rank 0 (pid 1) on vm failed:\n```",
        f"checkpoint {REPO}/runs/x/checkpoints/step-00000010.pt",
    ],
)
def test_a_developers_machine_in_a_sample_is_caught(sample):
    assert machine_problems(REPO / "docs" / "x.md", sample)


def test_placeholders_and_documented_places_pass():
    fine = "```\n[vm1] rank 0 on <host> via elastic; run dir runs/h3; /tmp/launcher-slurm/env.sh; vm2 node1\n```"
    assert machine_problems(REPO / "docs" / "x.md", fine) == []


def test_a_clone_anywhere_on_any_host_passes(monkeypatch):
    """Issue 60: a clone directly under the temp dir or /opt (the docs name documented places there) on a host
    named ``node`` (a word the docs use): the rule knows the developer's machine by what it can know, not by the
    clone's parent folder or this host's name."""
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "node")
    for clone in ("/tmp/tmp.Ab12", "/opt/launcher"):
        monkeypatch.setitem(globals(), "REPO", Path(clone))
        doc = Path(clone) / "docs" / "x.md"
        sample = "```\nnode 1 on node; /tmp/launcher-slurm/env.sh; /opt/conda/bin/python\n```"
        assert machine_problems(doc, sample) == [], clone
        assert machine_problems(doc, f"run dir {clone}/runs/x"), clone  # this checkout's own path still caught


def test_a_stale_frame_is_caught():
    doc = REPO / "docs" / "x.md"
    moved = '  File ".../launcher/base/faults.py", line 55, in fire\n    raise RuntimeError(f"injected'
    renamed = '  File ".../launcher/train/trainer.py", line N, in _fit_old\n    loss = self._step(world, raw)'
    rewritten = '  File ".../launcher/train/trainer.py", line N, in _train\n    loss = self._step(x, y)'
    for sample in (moved, renamed, rewritten):
        assert frame_problems(doc, sample), sample
    fine = '  File ".../launcher/train/trainer.py", line N, in _train\n    loss = self._step(world, raw)'
    assert frame_problems(doc, fine) == []
