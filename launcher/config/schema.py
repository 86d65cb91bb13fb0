"""Typed schema of a job (cluster schemas in ``clusters.py``). Hydra composes YAML from ``conf/`` onto these
dataclasses; ``OmegaConf.to_object`` then builds them, which runs every ``__post_init__``: each check names the
value and the fix. The gradient sync's choices are Enums (``launcher/base/sync_modes.py``: OmegaConf refuses any
other value, ``config/keys.py`` names it first); other string choices stay ``str`` with a check: OmegaConf 2.3
rejects ``Literal`` annotations.

Checks that depend on the machine (GPUs present) live in the launch plan, not here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from launcher.base.checkpoint_names import is_complete
from launcher.base.liveness import TRAINER_TIMEOUT_S
from launcher.base.run_dir import RunDir
from launcher.config.clusters import ClusterConfig, SimClusterConfig, SlurmClusterConfig, SshClusterConfig
from launcher.config.comm import CommConfig as CommConfig
from launcher.config.errors import ConfigError as ConfigError  # (imported from here by keys.py, load.py, __init__.py)
from launcher.config.errors import _check
from launcher.config.targets import check_targets, job_targets

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class TrainConfig:
    epochs: int = 10  # passes over the training split
    max_steps: Optional[int] = None  # stop after this many optimiser steps in total (null = epochs decide)
    batch_size: int = 64  # GLOBAL batch, split evenly across ranks
    batch_size_per_rank: Optional[int] = None  # if set, each rank's batch is fixed and the global batch grows
    seed: int = 0  # the initial weights (the same on every rank) and each epoch's shuffle (one order, split
    #                across the ranks); rank r's own random streams (dropout, the loader's workers) start at seed + r
    resume: str = (
        "auto"  # auto (newest valid checkpoint in the run dir) | force (same, even if the job changed) | never | PATH
    )
    checkpoint_every_steps: int = 50  # a checkpoint every N optimiser steps, one at the end and one at a stop;
    #                                   0 = only at the end (and at a stop)
    checkpoint_async: bool = False  # write each checkpoint on a background thread: the loop waits only for a copy of
    #                                 the state (one write at a time; the next save, a stop and the end wait for it)
    keep_checkpoints: int = 3  # newest checkpoints kept on disk
    eval_every_epochs: int = 1  # evaluate on the held-out split every N epochs (and at the end)
    log_every_steps: int = 10  # one metrics.jsonl line every N steps
    threads_per_rank: Optional[int] = None  # torch intra-op threads per rank (also OMP_NUM_THREADS); null =
    #                                         OMP_NUM_THREADS when set (torchrun sets 1), else the cores the rank may
    #                                         run on / the ranks on its machine
    precision: str = "fp32"  # fp32 | bf16 | fp16: autocast on the rank's device (fp16 with a gradient scaler)
    accumulate_steps: int = 1  # micro-batches per optimiser step (the global batch stays train.batch_size);
    #                            gradients are synchronised once per step, after the last one
    loss: str = "cross_entropy"  # cross_entropy (classes last: (N, C) or per token (N, ..., C)) | model (forward(x,
    #                              targets) returns the loss, or .loss / ["loss"]) | pkg.module.fn(outputs, targets)
    labels_key: str = "labels"  # a dict batch's key of the targets (model(**batch) gets the others)
    metrics: dict[str, Any] = field(default_factory=dict)  # name -> {_target_: a torchmetrics Metric class or
    #   fn(preds, targets), its arguments beside}: computed over the whole evaluation, reported under the name
    metric: Optional[str] = None  # (older) pkg.module.fn(preds, targets): as train.metrics.fn, averaged over batches
    plots: bool = True  # render run_dir/plots/curves.png at the end (false: skip matplotlib's ~1 s; render it
    #                     later with python -m launcher plot RUN_DIR)
    tensorboard: bool = False  # rank 0 also writes metrics.jsonl's numbers as TensorBoard scalars into
    #                            run_dir/tensorboard/ (needs the tensorboard package: pip install tensorboard)

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, f"train.epochs={self.epochs} must be >= 1")
        _check(self.precision in PRECISIONS, f"train.precision={self.precision!r}; HINT: " + ", ".join(PRECISIONS))
        _check(self.accumulate_steps >= 1, f"train.accumulate_steps={self.accumulate_steps} must be >= 1")
        for name, spec in self.metrics.items():
            _check(name != "loss", "train.metrics.loss: the evaluation's loss is reported as loss; HINT: another name")
            _check(
                isinstance(spec, str) or (hasattr(spec, "get") and isinstance(spec.get("_target_"), str)),
                f"train.metrics.{name}={spec!r}; HINT: train.metrics.{name}._target_=torchmetrics.classification."
                "BinaryF1Score (a metric class; its arguments beside _target_), or a function of (preds, targets)",
            )
        if self.max_steps is not None:
            _check(self.max_steps >= 1, f"train.max_steps={self.max_steps} must be >= 1 (or null)")
        _check(self.batch_size >= 1, f"train.batch_size={self.batch_size} must be >= 1")
        if self.batch_size_per_rank is not None:
            _check(self.batch_size_per_rank >= 1, f"train.batch_size_per_rank={self.batch_size_per_rank} must be >= 1")
            _check(
                self.batch_size_per_rank % self.accumulate_steps == 0,
                f"train.batch_size_per_rank={self.batch_size_per_rank} does not split into train.accumulate_steps="
                f"{self.accumulate_steps} equal micro-batches; HINT: use train.batch_size_per_rank="
                f"{_round_up(self.batch_size_per_rank, self.accumulate_steps)}",
            )
        _check(
            self.checkpoint_every_steps >= 0, f"train.checkpoint_every_steps={self.checkpoint_every_steps} must be >= 0"
        )
        _check(self.keep_checkpoints >= 1, f"train.keep_checkpoints={self.keep_checkpoints} must be >= 1")
        _check(self.eval_every_epochs >= 1, f"train.eval_every_epochs={self.eval_every_epochs} must be >= 1")
        _check(self.log_every_steps >= 1, f"train.log_every_steps={self.log_every_steps} must be >= 1")
        if self.resume not in ("auto", "force", "never"):
            _check(
                Path(self.resume).is_file() or is_complete(Path(self.resume)),
                f"train.resume={self.resume!r} is not a checkpoint; "
                "HINT: use auto, force, never, a path to a .pt file or a sharded checkpoint's directory",
            )


@dataclass
class OptimConfig:
    name: str = "sgd"  # the optimiser: sgd | adamw
    lr: float = 0.1  # for one rank's batch when lr_scaling=linear, else for the global batch
    momentum: float = 0.9  # sgd's momentum (adamw has none: ignored there)
    weight_decay: float = 0.0  # L2 penalty (sgd) / decoupled weight decay (adamw)
    lr_scaling: str = "none"  # none | linear (lr x world size: more GPUs, larger batch, larger lr)
    scheduler: str = "cosine"  # none (constant after the warm-up) | cosine (to 0 at the end of optim.schedule_steps)
    warmup_steps: int = 0  # linear warm-up before the schedule
    # the steps the schedule spans; null = the steps the run takes (train.max_steps, or the epochs when fewer).
    # Set it to stop a run early and extend it later along one schedule (what a run of that length would follow)
    schedule_steps: Optional[int] = None
    clip_grad_norm: Optional[float] = None  # clip the global norm of the synchronised gradients to this; null = off

    def __post_init__(self) -> None:
        _check(self.name in ("sgd", "adamw"), f"optim.name={self.name!r} is unknown; HINT: use sgd or adamw")
        _check(self.lr > 0, f"optim.lr={self.lr} must be > 0")
        _check(self.lr_scaling in ("none", "linear"), f"optim.lr_scaling={self.lr_scaling!r}; HINT: none or linear")
        _check(self.scheduler in ("none", "cosine"), f"optim.scheduler={self.scheduler!r}; HINT: none or cosine")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        if self.schedule_steps is not None:
            _check(self.schedule_steps >= 1, f"optim.schedule_steps={self.schedule_steps} must be >= 1 (or null)")
        if self.clip_grad_norm is not None:
            _check(self.clip_grad_norm > 0, f"optim.clip_grad_norm={self.clip_grad_norm} must be > 0 (or null: off)")


DATASETS = ("digits", "synthetic", "idx")


@dataclass
class DataConfig:
    name: str = "digits"  # digits (bundled with scikit-learn) | synthetic | idx (MNIST/Fashion-MNIST files)
    image_size: int = 28  # the built-in sets' images are resized to image_size x image_size (your own are checked)
    channels: int = 1  # image channels (1 grey, 3 colour), given to the model as in_channels
    num_classes: int = 10  # label classes, given to the model
    path: Optional[str] = None  # idx: directory holding train-images-idx3-ubyte[.gz] and friends
    test_fraction: float = 0.2  # digits: held-out share (stratified, fixed split)
    train_samples: int = 4096  # synthetic: how many training samples it generates
    test_samples: int = 1024  # synthetic: how many held-out samples it generates
    _target_: Optional[str] = None  # your own data: a factory returning (train, test) map-style Datasets (test may
    #                                 be None); for the built-in image models a sample is (image tensor of shape
    #                                 (channels, image_size, image_size), int label), for your own model any structure
    #                                 of tensors; data.name is then ignored
    kwargs: dict[str, Any] = field(default_factory=dict)  # _target_: keyword arguments of the factory
    num_workers: int = 0  # DataLoader worker processes per rank (_target_ data; the built-in sets are tensors)

    @property
    def label(self) -> str:
        """What the banner and the summary call the data: the factory's path, or data.name."""
        return self._target_ or self.name

    def __post_init__(self) -> None:
        _check(self.num_workers >= 0, f"data.num_workers={self.num_workers} must be >= 0")
        if self._target_ is not None:  # (checked with the job's other dotted paths: config/targets.py)
            return
        _check(
            self.name in DATASETS, f"data.name={self.name!r} is unknown; HINT: use data=" + " or data=".join(DATASETS)
        )
        _check(self.image_size >= 1 and self.channels >= 1, "data.image_size and data.channels must be >= 1")
        _check(self.num_classes >= 2, f"data.num_classes={self.num_classes} must be >= 2")
        _check(0 < self.test_fraction < 1, f"data.test_fraction={self.test_fraction} must be in (0, 1)")
        if self.name == "idx":
            _check(
                self.path is not None and Path(self.path).is_dir(),
                f"data.path={self.path!r} is not a directory; HINT: data=idx data.path=/path/to/fashion-mnist "
                "(with train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-...)",
            )


@dataclass
class JobConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: Any = MISSING  # {_target_: dotted.path.to.nn.Module or factory, **kwargs}
    dry_run: bool = False  # print the resolved config and launch plan, start nothing
    doctor: bool = False  # check the cluster (reachability, interfaces, GPUs, link speeds) instead of training
    preflight: bool = False  # run the doctor's checks at the start of training and log them
    script: Optional[str] = None  # run this torchrun-compatible script instead of the built-in trainer
    script_args: list[str] = field(default_factory=list)  # the script's arguments: after --, or script_args=[--lr,0.1]
    run_dir: str = "."  # filled from Hydra's run dir; every file of the run goes there

    @property
    def run(self) -> RunDir:
        """The run dir (``run_dir``) with every file of the run named (``launcher.base.run_dir``)."""
        return RunDir(self.run_dir)

    def __post_init__(self) -> None:
        _check(
            isinstance(self.model, dict) and isinstance(self.model.get("_target_"), str),
            "model needs a _target_; HINT: model=lenet|mlp|resnet18, or model._target_=pkg.module.Class",
        )
        check_targets(job_targets(self))  # every wrong dotted path of the job (model, data, train) named at once
        if self.script is not None:
            _check(
                Path(self.script).is_file(),
                f"script={self.script!r} does not exist; HINT: give the path of a torchrun-compatible .py file",
            )
        if self.cluster.procs_per_node is not None:  # the job's shape, filled in by its mode: comm.shard=auto resolved
            self.comm.resolve_shard(self.cluster.nodes, self.cluster.procs_per_node)
        fewest = self.cluster.min_nodes if self.cluster.may_shrink else self.cluster.nodes  # null: not yet planned
        assert fewest is not None  # (may_shrink: min_nodes is set)
        per_node = self.cluster.procs_per_node or 1
        _check(
            not self.cluster.may_shrink or self.train.batch_size_per_rank is None or self.script is not None,
            f"cluster.min_nodes={fewest} < cluster.nodes={self.cluster.nodes} with train.batch_size_per_rank="
            f"{self.train.batch_size_per_rank}: on fewer machines the global batch would shrink and the run could "
            "not resume; HINT: set the global batch (train.batch_size=N train.batch_size_per_rank=null)",
        )
        trains = not self.doctor and self.script is None  # (the doctor trains nothing; a script= its own batches)
        if self.train.batch_size_per_rank is None and trains:
            for nodes in range(self.cluster.nodes, fewest - 1, -1):  # every world the job may run on
                world = nodes * per_node
                every = math.lcm(*(n * per_node for n in range(fewest, self.cluster.nodes + 1)))
                layout = (
                    f"cluster.nodes={self.cluster.nodes} x cluster.procs_per_node={self.cluster.procs_per_node}"
                    if nodes == self.cluster.nodes
                    else f"{nodes} node(s), allowed by cluster.min_nodes={fewest}, x {per_node} rank(s)"
                )
                micro = self.train.accumulate_steps
                split = f" x train.accumulate_steps={micro} micro-batches" if micro > 1 else ""
                _check(
                    self.train.batch_size % (world * micro) == 0,
                    f"train.batch_size={self.train.batch_size} is not divisible by the world size {world} "
                    f"({layout}){split}; HINT: use train.batch_size={_round_up(self.train.batch_size, every * micro)} "
                    "or set train.batch_size_per_rank",
                )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def register_configs() -> None:
    """Schemas Hydra composes onto: the job, and one per cluster kind (``conf/cluster/*.yaml`` extend them)."""
    cs = ConfigStore.instance()
    cs.store(name="job_schema", node=JobConfig)
    cs.store(group="cluster", name="sim_schema", node=SimClusterConfig)
    cs.store(group="cluster", name="slurm_schema", node=SlurmClusterConfig)
    cs.store(group="cluster", name="ssh_schema", node=SshClusterConfig)


def collective_timeout_s(comm: CommConfig) -> float:
    """The trainer's collective timeout: ``comm.timeout_s``, or ``TRAINER_TIMEOUT_S`` when not set."""
    return float(comm.timeout_s) if comm.timeout_s is not None else TRAINER_TIMEOUT_S
