"""Every dotted path a job names, checked at once before any process starts: ``model._target_`` (and the
``_target_``\\ s nested in it, which Hydra's ``instantiate`` builds too), ``data._target_``, ``train.loss`` (unless a
built-in word), ``train.metric`` and each entry of ``train.metrics``. One ``ConfigError`` names every wrong one, a line
each, with what is wrong and the fix: the package is not importable from here (run from the directory that holds it,
or PYTHONPATH), a module or a name in one is missing ("did you mean" from the module's public names and the
package's modules, spelt as whole paths that resolve), importing it raised, or it names something not callable,
or it needs an argument the config does not give (``MulticlassF1Score`` without ``num_classes``: the key and the
override that gives it). What a path builds is built where the job starts too (``launch/plan.py``: the metrics;
``commands/dry_run.py``: everything), before any rank does.

A path resolves as Hydra resolves it (``hydra.utils.get_method``): its first part imported, then each next part an
attribute, else a submodule. Close spellings are tried (imported) only once something is wrong."""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional

from launcher.config.errors import ConfigError

LOSSES = ("cross_entropy", "model")  # train.loss's words; any other value is a dotted path
SHOWN = 8  # names listed when none is close


@dataclass(frozen=True)
class Target:
    """One dotted path of the job: its config key (``model._target_``), the path, and the words the key also takes."""

    key: str
    path: str
    words: tuple[str, ...] = ()
    args: Optional[tuple[str, ...]] = None  # the keyword arguments the job calls it with (None: not called with them)
    at: str = ""  # the config key that holds those arguments (model, data.kwargs, train.metrics.f1)
    classes_only: bool = False  # only a class is called now (a metric function is called with every batch instead)


def job_targets(job: Any) -> list[Target]:
    """Every dotted path ``job`` (a ``JobConfig``) names, with its key, in the config's order."""
    found = list(_nested(job.model, "model"))
    if job.data._target_ is not None:
        kwargs = tuple(job.data.kwargs)
        found.append(Target("data._target_", job.data._target_, args=kwargs, at="data.kwargs"))
    train = job.train
    if train.loss not in LOSSES:
        found.append(Target("train.loss", train.loss, LOSSES))
    metric = getattr(train, "metric", None)
    if isinstance(metric, str):
        found.append(Target("train.metric", metric))
    metrics = getattr(train, "metrics", None) or {}  # name -> path, or {_target_: path, **kwargs}
    for name, spec in metrics.items() if isinstance(metrics, Mapping) else enumerate(metrics):
        key = f"train.metrics.{name}"
        if isinstance(spec, str) and "." in spec:  # (a word without a dot is left to the trainer's own names)
            found.append(Target(key, spec, args=(), at=key, classes_only=True))
        elif isinstance(spec, Mapping) and isinstance(spec.get("_target_"), str):  # (scores.build: its arguments)
            given = tuple(str(k) for k in spec if k != "_target_")
            found.append(Target(f"{key}._target_", spec["_target_"], args=given, at=key, classes_only=True))
        else:
            found += _nested(spec, key)
    return found


def _nested(tree: Any, key: str) -> Iterator[Target]:
    """The ``_target_``\\ s of a config tree that ``instantiate`` builds (all of them unless ``_recursive_: false``)."""
    if isinstance(tree, Mapping):
        if isinstance(tree.get("_target_"), str):
            partial = tree.get("_partial_") is True  # (built later, with the rest of its arguments)
            given = None if partial or "_args_" in tree else tuple(str(k) for k in tree if not str(k).startswith("_"))
            yield Target(f"{key}._target_", tree["_target_"], args=given, at=key)
        if tree.get("_recursive_", True) is not False:
            for name, value in tree.items():
                if not str(name).startswith("_"):
                    yield from _nested(value, f"{key}.{name}")
    elif isinstance(tree, Sequence) and not isinstance(tree, str):
        for index, value in enumerate(tree):
            yield from _nested(value, f"{key}.{index}")


def check_targets(targets: Sequence[Target]) -> None:
    """Raise one ConfigError naming every target that does not resolve to something callable, or misses an argument
    it needs, a line each."""
    wrong = ((t, what_is_wrong(t.path, t.words) or _unmet(t)) for t in targets)
    lines = [f"{t.key}={t.path!r} {problem}" for t, problem in wrong if problem]
    if len(lines) == 1:
        raise ConfigError(lines[0])
    if lines:
        raise ConfigError(f"{len(lines)} dotted paths of the job are wrong:\n  " + "\n  ".join(lines))


def what_is_wrong(path: str, words: Sequence[str] = ()) -> Optional[str]:
    """What is wrong with ``path`` (after ``key=path``), with the fix; None if it resolves to something callable."""
    parts = path.split(".")
    if words and len(parts) == 1:
        close = difflib.get_close_matches(path, words)
        return f"is neither {', '.join(words)} nor a dotted path to a function{_did_you_mean(close)}"
    if not all(part.isidentifier() for part in parts):
        return "is not a dotted path (package.module.Name)"
    found = _resolve(parts)
    if isinstance(found, _Missing):
        return _missing(parts, found)
    if isinstance(found, _Raised):
        error = found.error
        said = f"{type(error).__name__}: {error}"
        missing = error.name if isinstance(error, ModuleNotFoundError) else None
        fix = f"install {missing} where the job runs" if missing else f"python -c 'import {found.module}' shows where"
        return f"cannot be imported: importing {found.module} raised {said}; HINT: {fix}"
    if not callable(found):
        kind = "a module" if isinstance(found, ModuleType) else f"a {type(found).__name__}"
        return f"is not callable: {path} is {kind}, not a class or function{_listing(found, path)}"
    return None


def _unmet(target: Target) -> Optional[str]:
    """What ``target`` (a path that resolves) needs that the config does not give it, with the override that does."""
    if target.args is None:
        return None
    found = _resolve(target.path.split("."))
    if target.classes_only and not isinstance(found, type):
        return None
    missing = missing_arguments(found, target.args)
    if not missing:
        return None
    said = " and ".join(missing)
    return f"cannot be built: it needs {said}, which {target.at} does not give; HINT: {overrides(target.at, missing)}"


def build_error(target: Target, made: Any, given: Sequence[str], exc: BaseException) -> str:
    """The error of building ``target`` (``made(**given)``, its arguments under ``target.at``) that raised ``exc``:
    the key, what it raised, and the fix (the arguments it misses, by the overrides that give them)."""
    missing = missing_arguments(made, given)
    cause = exc.__cause__ or exc  # the user's error, not Hydra's wrapper (instantiate's InstantiationException)
    if missing:
        fix = f"{overrides(target.at, missing)} (it needs {' and '.join(missing)})"
    else:
        fix = f"the keys under {target.at} are its arguments: give the one it names as {target.at}.NAME=VALUE"
    return f"{target.key}={target.path!r} failed to build: {type(cause).__name__}: {cause}; HINT: {fix}"


def overrides(at: str, missing: Sequence[str]) -> str:
    """The command-line overrides that give the ``missing`` arguments under the key ``at``."""
    return " ".join(f"+{at}.{name}=VALUE" for name in missing)


def missing_arguments(made: Any, given: Sequence[str]) -> list[str]:
    """The arguments ``made(**given)`` would be missing (those without a default); none when its signature is not
    known (a builtin)."""
    try:
        parameters = inspect.signature(made).parameters.values()
    except (TypeError, ValueError):
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in named and p.default is p.empty and p.name not in given]


@dataclass(frozen=True)
class _Missing:
    """``parts[at]`` is neither an attribute nor a submodule of ``owner`` (None: the first part, no such module)."""

    at: int
    owner: Any


@dataclass(frozen=True)
class _Raised:
    """Importing ``module`` raised ``error`` (the module's own code, or a module it imports is missing)."""

    module: str
    error: Exception


def _resolve(parts: Sequence[str]) -> Any:
    """The object ``parts`` names, or a ``_Missing`` / ``_Raised`` saying where it stopped."""
    obj: Any = None
    for at, part in enumerate(parts):
        name = ".".join(parts[: at + 1])
        if at > 0:
            try:
                obj = getattr(obj, part)
                continue
            except AttributeError:
                if not isinstance(obj, ModuleType):
                    return _Missing(at, obj)
            except Exception as exc:  # noqa: BLE001 - a module's own __getattr__: whatever it raises is reported
                return _Raised(".".join(parts[:at]), exc)
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a module it imports is missing, not this one
                return _Raised(name, exc)
            return _Missing(at, obj)
        except Exception as exc:  # noqa: BLE001 - the user's module: whatever importing it raises is reported
            return _Raised(name, exc)
    return obj


def _missing(parts: Sequence[str], where: _Missing) -> str:
    """The line for a path that stops at ``parts[where.at]``: what is missing, the close spellings that resolve."""
    at, owner, part = where.at, where.owner, parts[where.at]
    close = _corrections(parts)
    if owner is None:
        fix = (
            f"your own package: run from the directory that holds {part}/ (or {part}.py), or add that directory to "
            "PYTHONPATH (over ssh and Slurm: on every host); a library: install it where the job runs"
        )
        said = f"cannot be imported: no module named {part} on sys.path"
        searched = " (the current directory, PYTHONPATH, installed)"
        return said + (_did_you_mean(close) if close else f"{searched}; HINT: {fix}")
    here = ".".join(parts[:at])
    if isinstance(owner, ModuleType):
        package = hasattr(owner, "__path__")
        what = f"package {here} has no module or name {part}" if package else f"module {here} has no name {part}"
    else:
        what = f"{here} (a {type(owner).__name__}) has no attribute {part}"
    return f"cannot be imported: {what}{_did_you_mean(close) or _listing(owner, here)}"


def _corrections(parts: Sequence[str], start: int = 0) -> list[str]:
    """Whole paths, each ``parts`` with close spellings at the parts that do not resolve, that resolve (at most 3)."""
    found = _resolve(parts)
    if not isinstance(found, _Missing) or found.at < start:
        return [".".join(parts)] if not isinstance(found, (_Missing, _Raised)) and callable(found) else []
    fixes: list[str] = []
    for name in difflib.get_close_matches(parts[found.at], _names(found.owner), n=3, cutoff=0.6):
        tried = [*parts[: found.at], name, *parts[found.at + 1 :]]
        fixes += [fix for fix in _corrections(tried, found.at + 1) if fix not in fixes]
    return fixes[:3]


def _names(owner: Any) -> list[str]:
    """The names a next part may take: the top-level modules (owner None); else the public names of ``owner`` and,
    for a package, its modules."""
    if owner is None:  # on sys.path, or imported (an editable install's); not the standard library's (``this``)
        found = {m.name for m in pkgutil.iter_modules()} | {name.split(".")[0] for name in sys.modules}
        return sorted(found - set(sys.stdlib_module_names))
    names = {name for name in dir(owner) if not name.startswith("_")}
    if isinstance(owner, ModuleType) and hasattr(owner, "__path__"):
        names |= {m.name for m in pkgutil.iter_modules(owner.__path__) if not m.name.startswith("_")}
    return sorted(names)


def _did_you_mean(paths: Sequence[str]) -> str:
    return f" (did you mean {' or '.join(paths)}?)" if paths else ""


def _listing(owner: Any, here: str) -> str:
    """`` (here has: A, B, f)``: the classes and functions defined in a module (and a package's modules), for a path
    with no close spelling."""
    if not isinstance(owner, ModuleType):
        return ""
    own = {
        name
        for name in dir(owner)
        if not name.startswith("_")
        and callable(value := getattr(owner, name, None))
        and getattr(value, "__module__", None) == owner.__name__
    }
    if hasattr(owner, "__path__"):
        own |= {m.name for m in pkgutil.iter_modules(owner.__path__) if not m.name.startswith("_")}
    if not own:
        return ""
    more = ", ..." if len(own) > SHOWN else ""
    return f" ({here} has: {', '.join(sorted(own)[:SHOWN])}{more})"
