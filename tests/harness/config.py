"""The job's config exactly as ``python -m launcher overrides...`` composes and plans it, without running it."""

from __future__ import annotations

from pathlib import Path

from harness import REPO
from launcher.base.env import DistEnv


def compose(*overrides: str, run_dir: Path | None = None):
    """The job config exactly as ``python -m launcher overrides...`` composes it (Hydra compose API)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from launcher.config import register_configs, register_resolvers
    from launcher.config.keys import choice_overrides

    register_resolvers()
    register_configs()
    given = choice_overrides(list(overrides))  # as the command line: comm.hierarchical=true is the member
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=[f"run_dir={run_dir or '.'}", *given])


def plan(*overrides: str, run_dir: Path | None = None, gpus_visible: int = 0, environ: dict | None = None):
    """(JobConfig, LaunchPlan) for ``overrides`` on a machine with ``gpus_visible`` GPUs."""
    from launcher.launch.plan import plan_job

    job, launch_plan, _ = plan_job(compose(*overrides, run_dir=run_dir), DistEnv.resolve(environ or {}), gpus_visible)
    return job, launch_plan
