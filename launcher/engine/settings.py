"""What an ``Engine`` runs with: the job's ``comm.*``, ``train.*`` (and ``optim.clip_grad_norm``) settings, then the
user's keyword overrides.

- Under ``python -m launcher script=...`` the rank's work hands the script's process its job (``hand_over``: the
  config frozen into the run dir, with the job's secret for signed collectives), so an ``Engine()`` in the script
  runs what the command line said (``comm.compress=bf16`` on it reaches the script's engine).
- Under plain ``torchrun`` (or any launcher that sets torchrun's variables) there is no job: the schema's defaults,
  the run dir ``runs/engine`` (``run_dir=`` to choose one; running again resumes from its newest checkpoint).

An override is a field's bare name (``compress="bf16"``, ``precision="bf16"``, ``checkpoint_async=True``) or its dotted
one (``comm.compress``); a name no section has, or a value its field refuses, is a ``ValueError`` naming it and the
fix before anything is built."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher.base.env import DistEnv
from launcher.config import CommConfig, ConfigError, JobConfig, OptimConfig, TrainConfig
from launcher.trust.secret import Secret

DEFAULT_RUN_DIR = "runs/engine"
ENGINE_MODEL = {"_target_": "torch.nn.Module"}  # (the schema needs one; a user's loop brings its own model)
SECTIONS = {"comm": CommConfig, "train": TrainConfig, "optim": OptimConfig}
OPTIM_KEYS = ("clip_grad_norm",)  # what an Engine reads of optim.* (the optimizer itself is the user's)

_handed: Optional[tuple[JobConfig, Optional[Secret], Any]] = None


def hand_over(job: JobConfig, secret: Optional[Secret], watch: Any = None) -> None:
    """The launcher's rank, before it runs a ``script=``: the job (its secret, its progress watch) an ``Engine`` in
    it reads."""
    global _handed
    _handed = (job, secret, watch)


def handed() -> tuple[Optional[JobConfig], Optional[Secret], Any]:
    """The job the launcher handed this process, its secret and watch; all None under plain torchrun."""
    return _handed if _handed is not None else (None, None, None)


def keys() -> dict[str, str]:
    """Every name an override may use -> its dotted key (``compress`` -> ``comm.compress``)."""
    names = {f"{section}.{f.name}": f"{section}.{f.name}" for section in ("comm", "train") for f in _fields(section)}
    names.update({f"optim.{name}": f"optim.{name}" for name in OPTIM_KEYS})
    names.update({key.split(".", 1)[1]: key for key in list(names)})
    return names


def _fields(section: str) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(SECTIONS[section])


def engine_job(overrides: dict[str, Any], job: Optional[JobConfig] = None) -> JobConfig:
    """``job`` (the launcher's, or the defaults) with ``overrides`` applied and checked; ``run_dir`` is one of them."""
    base = job or JobConfig(model=dict(ENGINE_MODEL), run_dir=DEFAULT_RUN_DIR)
    overrides = dict(overrides)
    run_dir = overrides.pop("run_dir", None)
    known, dotted = keys(), {}
    for name, value in overrides.items():
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=3)
            hint = f"did you mean {' or '.join(close)}?" if close else "see docs/configuration-reference.md"
            raise ValueError(
                f"Engine({name}=...): no comm.*, train.* or optim.clip_grad_norm setting is called {name!r}; HINT: "
                f"{hint}"
            )
        dotted[known[name]] = value.value if hasattr(value, "value") and not isinstance(value, str) else value
    config = OmegaConf.structured(base)
    if run_dir is not None:
        config.run_dir = str(run_dir)
    for key, value in dotted.items():
        try:
            OmegaConf.update(config, key, value, merge=False)
        except OmegaConfBaseException as exc:
            raise ValueError(f"Engine({key.split('.', 1)[1]}={value!r}): {str(exc).splitlines()[0]}") from None
    try:
        made = OmegaConf.to_object(config)
        assert isinstance(made, JobConfig)
        if job is None:  # plain torchrun: the job's shape is the world's (comm.shard=auto resolved on it)
            env = DistEnv.resolve()
            made.comm.resolve_shard(env.num_nodes, env.local_world_size)
    except (ConfigError, OmegaConfBaseException) as exc:
        raise ValueError(f"Engine({_said(dotted)}): {str(exc).splitlines()[0]}") from None
    return made


def _said(dotted: dict[str, Any]) -> str:
    return ", ".join(f"{key.split('.', 1)[1]}={value!r}" for key, value in dotted.items())
