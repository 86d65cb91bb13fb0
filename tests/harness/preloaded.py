"""The last module ``spawn_ranks``' fork server imports (harness.ranks ``RANK_PRELOAD``): what nearly every rank
imports after it was forked, then every object the preload made moved into the collector's permanent generation
(``gc.freeze``, as Python's docs advise before forking). Never imported by the test processes themselves.

Why, measured on the fast lane (216 ranks): a rank's first full collection (the ``gc.collect()`` that ends every
process group, launcher.group.rendezvous) walked the fork server's ~285,000 objects, touching their pages and so
copying them: 0.15 CPU-s of the 0.17 a rank that only meets at a barrier cost; and 203 of 216 ranks imported pytest
(their test module does), most the launcher's config, trainer and engine with Hydra's and OmegaConf's grammars. The
fast lane's pytest took 70 s before, 49 s with the freeze, 34 s with these imports too (and tests/conftest.py's
freeze in the test processes). Nothing here starts a thread or opens a process group (the fork server must stay
fork-safe)."""

import gc

import pytest  # noqa: F401  (a rank unpickles its function by its test module, which imports pytest)
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.profiler._cupti_monitor  # noqa: F401  (these two: imported by most ranks after the fork, seen)
import torch.utils.serialization  # noqa: F401
from omegaconf import OmegaConf

import launcher.comm.ddp_hook  # noqa: F401
import launcher.config  # noqa: F401
import launcher.engine  # noqa: F401
import launcher.train.trainer  # noqa: F401
import models.mlp  # noqa: F401  (the models package: every model the configs name)

OmegaConf.create({"a": "${b}", "b": 1}).a  # noqa: B018  (OmegaConf's grammar: loaded on the first interpolation)
gc.freeze()
