"""Every wrong dotted path of a job (``model._target_``, ``data._target_``, ``train.loss``, ...) is named at once,
a line each, when the job is planned (before any process starts): what is wrong (the package not importable, a
module or a name in one missing, importing it raised, not callable) with "did you mean" from the module's names
(issue 48, item 3). The paths: ``models.lenet`` of this checkout, and ``mytx``, an own package in a temporary
directory, put on sys.path as running from its directory would."""

import sys
from types import SimpleNamespace

import pytest

from harness.config import plan
from launcher.config import ConfigError
from launcher.config.targets import Target, job_targets

NOT_ON_PATH = (
    "cannot be imported: no module named mytx on sys.path (the current directory, PYTHONPATH, installed); HINT: your "
    "own package: run from the directory that holds mytx/ (or mytx.py), or add that directory to PYTHONPATH (over "
    "ssh and Slurm: on every host); a library: install it where the job runs"
)


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        plan(*overrides)
    return str(info.value)


@pytest.fixture
def mytx(tmp_path, monkeypatch):
    """``mytx``: ``model.TinyNet``, ``data.make_data``, ``broken`` (imports a module that is not installed)."""
    package = tmp_path / "mytx"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text("class TinyNet:\n    def __init__(self, **kwargs):\n        pass\n")
    (package / "data.py").write_text("def make_data():\n    return [], []\n")
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
        data=SimpleNamespace(_target_="a.data"),
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
    job.model["_recursive_"], job.train.loss, job.train.metric, job.train.metrics = False, "model", None, {}
    job.data._target_ = None
    assert job_targets(job) == [Target("model._target_", "a.Net")]
