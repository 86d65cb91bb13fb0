"""``python -m launcher --help``: the manual on one screen (``hydra.help.template`` in conf/config.yaml), printed by
Hydra without importing torch (``launcher.commands.cli`` does, ~2 s here: the help would take 3.8 s instead of ~1)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from launcher.commands.pipes import quiet_closed_pipes
from launcher.config import CONF_DIR, register_configs, register_resolvers


def main() -> None:
    quiet_closed_pipes()  # `python -m launcher --help | head -3`: no traceback when the reader has gone
    register_resolvers()
    register_configs()

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def _help(cfg: DictConfig) -> None:  # Hydra prints the help and exits before any task runs
        raise AssertionError("python -m launcher --help ran a job")

    _help()
