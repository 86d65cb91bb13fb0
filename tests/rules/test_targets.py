"""Every wrong dotted path of a job (``model._target_``, ``data._target_``, ``train.loss``, ...) is named at once,
a line each, when the job is planned (before any process starts): what is wrong (the package not importable, a
module or a name in one missing, importing it raised, not callable) with "did you mean" from the module's names
(issue 48, item 3). The paths: ``models.lenet`` of this checkout, and ``mytx``, an own package in a temporary
directory, put on sys.path as running from its directory would."""

import sys
from types import SimpleNamespace

import pytest

from harness.config import plan
from launcher.commands.dry_run import built_here
from launcher.config import ConfigError
from launcher.config.rules import entry_words
from launcher.config.targets import job_targets

NOT_ON_PATH = (
    "cannot be imported: no module named mytx on sys.path (the current directory, PYTHONPATH, installed); HINT: your "
    "own package: run from the directory that holds mytx/ (or mytx.py), or add that directory to PYTHONPATH (over "
    "ssh and Slurm: on every host); a library: install it where the job runs"
)


DATA = """
def make_data():
    return [], []


def rooted(root, size=4):
    return [], []


def broken(**kwargs):
    raise RuntimeError("no files under /nowhere")
"""
F1 = "+train.metrics.f1._target_=torchmetrics.classification.MulticlassF1Score"


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        plan(*overrides)
    return str(info.value)


@pytest.fixture
def mytx(tmp_path, monkeypatch):
    """``mytx``: ``model.TinyNet``, ``wide.Wide`` (needs ``width``), ``data.make_data`` (and ``data.rooted``: needs
    ``root``; ``data.broken``: raises), ``broken`` (imports a module that is not installed)."""
    package = tmp_path / "mytx"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text("class TinyNet:\n    def __init__(self, **kwargs):\n        pass\n")
    (package / "data.py").write_text(DATA)
    (package / "wide.py").write_text("class Wide:\n    def __init__(self, width, depth=2, **kwargs):\n        pass\n")
    (package / "broken.py").write_text("import transformerz_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield package
    for name in [n for n in sys.modules if n == "mytx" or n.startswith("mytx.")]:
        del sys.modules[name]


def test_every_wrong_path_of_the_job_is_named_at_once(mytx):
    message = refusal(
        "model._target_=models.lenet.LeNett", "data._target_=mytx.dta.make_data", "train.loss=crossentropy"
    )
    assert message == (
        "3 dotted paths of the job are wrong:\n"
        "  model._target_='models.lenet.LeNett' cannot be imported: module models.lenet has no name LeNett (did you "
        "mean models.lenet.LeNet?)\n"
        "  data._target_='mytx.dta.make_data' cannot be imported: package mytx has no module or name dta (did you mean "
        "mytx.data.make_data?)\n"
        "  train.loss='crossentropy' is neither cross_entropy, model nor a dotted path to a function (did you mean "
        "cross_entropy?)"
    )


def test_a_misspelt_class_in_a_real_module():
    assert refusal("model._target_=models.lenet.LeNett") == (
        "model._target_='models.lenet.LeNett' cannot be imported: module models.lenet has no name LeNett (did you "
        "mean models.lenet.LeNet?)"
    )
    assert refusal("model._target_=models.lenet.Foo") == (  # nothing close: what the module defines
        "model._target_='models.lenet.Foo' cannot be imported: module models.lenet has no name Foo (models.lenet has: "
        "LeNet)"
    )


def test_a_misspelt_module(mytx):
    assert refusal("model._target_=models.lenett.LeNet") == (
        "model._target_='models.lenett.LeNet' cannot be imported: package models has no module or name lenett (did "
        "you mean models.lenet.LeNet?)"
    )
    assert refusal("model._target_=mytx.modle.TinyNett") == (  # both parts misspelt: a whole path that resolves
        "model._target_='mytx.modle.TinyNett' cannot be imported: package mytx has no module or name modle (did you "
        "mean mytx.model.TinyNet?)"
    )
    assert refusal("model._target_=modles.lenet.LeNet") == (  # the package itself
        "model._target_='modles.lenet.LeNet' cannot be imported: no module named modles on sys.path (did you mean "
        "models.lenet.LeNet?)"
    )


def test_a_package_not_importable_at_all():
    assert refusal("model._target_=mytx.model.TinyNet") == f"model._target_='mytx.model.TinyNet' {NOT_ON_PATH}"
    assert refusal("model._target_=mytx.model.TinyNet", "train.loss=mytx.losses.focal") == (
        "2 dotted paths of the job are wrong:\n"
        f"  model._target_='mytx.model.TinyNet' {NOT_ON_PATH}\n"
        f"  train.loss='mytx.losses.focal' {NOT_ON_PATH}"
    )


def test_the_fix_named_works(mytx):
    job, _ = plan("model._target_=mytx.model.TinyNet", "data._target_=mytx.data.make_data")  # from its directory
    assert (job.model["_target_"], job.data._target_) == ("mytx.model.TinyNet", "mytx.data.make_data")


def test_a_module_that_fails_to_import_or_a_path_not_callable(mytx):
    assert refusal("model._target_=mytx.broken.Net") == (
        "model._target_='mytx.broken.Net' cannot be imported: importing mytx.broken raised ModuleNotFoundError: No "
        "module named 'transformerz_not_installed'; HINT: install transformerz_not_installed where the job runs"
    )
    assert refusal("model._target_=models.lenet") == (
        "model._target_='models.lenet' is not callable: models.lenet is a module, not a class or function "
        "(models.lenet has: LeNet)"
    )


def test_every_dotted_path_of_a_job_is_found():
    """Nested ``_target_``\\ s that ``instantiate`` builds (not under ``_recursive_: false``), ``train.metrics``'
    entries (a path, or a ``_target_`` with arguments), the words of ``train.loss`` left out."""
    job = SimpleNamespace(
        model={"_target_": "a.Net", "encoder": {"_target_": "a.Enc", "layers": [{"_target_": "a.Layer"}]}},
        data=SimpleNamespace(_target_="a.data", kwargs={"root": "/d"}),
        train=SimpleNamespace(
            loss="a.loss", metric="a.acc", metrics={"f1": {"_target_": "b.F1", "num_classes": 2}, "top": "a.top"}
        ),
    )
    assert [(t.key, t.path) for t in job_targets(job)] == [
        ("model._target_", "a.Net"),
        ("model.encoder._target_", "a.Enc"),
        ("model.encoder.layers.0._target_", "a.Layer"),
        ("data._target_", "a.data"),
        ("train.loss", "a.loss"),
        ("train.metric", "a.acc"),
        ("train.metrics.f1._target_", "b.F1"),
        ("train.metrics.top", "a.top"),
    ]
    called = {t.key: (t.at, t.args) for t in job_targets(job) if t.args is not None}  # what each is built with
    assert called == {
        "model._target_": ("model", ("encoder",)),
        "model.encoder._target_": ("model.encoder", ("layers",)),
        "model.encoder.layers.0._target_": ("model.encoder.layers.0", ()),
        "data._target_": ("data.kwargs", ("root",)),
        "train.metrics.f1._target_": ("train.metrics.f1", ("num_classes",)),
        "train.metrics.top": ("train.metrics.top", ()),
    }
    job.model["_recursive_"], job.train.loss, job.train.metric, job.train.metrics = False, "model", None, {}
    job.data._target_ = None
    assert [(t.key, t.path) for t in job_targets(job)] == [("model._target_", "a.Net")]


def test_what_a_job_builds_without_an_argument_it_needs_is_named_with_the_override(mytx):
    """Issue 60, item 6 (edge 5): a metric, a model or a data factory called without an argument it needs is refused
    when the job is planned, naming its key and the override that gives it (before, F1 passed dry_run=true and
    failed at every rank's first step with a bare TypeError)."""
    assert refusal(F1) == (
        "train.metrics.f1._target_='torchmetrics.classification.MulticlassF1Score' cannot be built: it needs "
        "num_classes, which train.metrics.f1 does not give; HINT: +train.metrics.f1.num_classes=VALUE"
    )
    assert refusal("model._target_=mytx.wide.Wide", "data._target_=mytx.data.rooted") == (
        "2 dotted paths of the job are wrong:\n"
        "  model._target_='mytx.wide.Wide' cannot be built: it needs width, which model does not give; HINT: "
        "+model.width=VALUE\n"
        "  data._target_='mytx.data.rooted' cannot be built: it needs root, which data.kwargs does not give; HINT: "
        "+data.kwargs.root=VALUE"
    )
    job, _ = plan(F1, "+train.metrics.f1.num_classes=2", "model._target_=mytx.wide.Wide", "+model.width=8")
    assert job.train.metrics["f1"]["num_classes"] == 2 and job.model["width"] == 8  # given: planned


def test_a_metric_is_built_when_the_job_is_planned(mytx):
    """What only building it shows (a value it refuses) is named at planning too, before any rank starts."""
    said = refusal(F1, "+train.metrics.f1.num_classes=2", "+train.metrics.f1.average=most")
    assert said.startswith(
        "train.metrics.f1._target_='torchmetrics.classification.MulticlassF1Score' failed to build: ValueError: "
        "Expected argument `average` to be one of"
    ), said
    assert said.endswith(
        "HINT: the keys under train.metrics.f1 are its arguments: give the one it names as train.metrics.f1.NAME=VALUE"
    ), said


def test_the_dry_run_builds_the_users_data_and_names_its_error(mytx):
    job, _ = plan("data._target_=mytx.data.broken", "+data.kwargs.n=3", "model._target_=mytx.model.TinyNet")
    with pytest.raises(ConfigError) as info:
        built_here(job)
    assert str(info.value) == (
        "data._target_='mytx.data.broken' failed to build: RuntimeError: no files under /nowhere; HINT: the keys "
        "under data.kwargs are its arguments: give the one it names as data.kwargs.NAME=VALUE"
    )
    job, _ = plan("data._target_=mytx.data.make_data", "model._target_=mytx.model.TinyNet")
    with pytest.raises(ConfigError, match=r"^data._target_='mytx.data.make_data': its train set is not a non-empty"):
        built_here(job)  # (what it returned, checked as a rank checks it)


def test_the_entry_names_the_users_data(mytx):
    """Issue 60, item 6 (edge 4): process titles and summary.json's ``entry`` name the data a job trains on: the
    user's factory by its name, not ``data.name``'s default (``digits``)."""
    job, _ = plan("model._target_=mytx.model.TinyNet", "data._target_=mytx.data.make_data")
    assert entry_words(job) == "train TinyNet on make_data"
    assert entry_words(plan("data=synthetic")[0]) == "train LeNet on synthetic"
