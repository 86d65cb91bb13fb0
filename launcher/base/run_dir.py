"""The run dir's layout: every file and folder a job writes in it, named here and nowhere else (``RunDir``).

The run dir is Hydra's (``hydra.run.dir=...``); every mode's ranks and heads write into the same one (a shared
file system in every multi-node mode). What it holds (who writes it):

  config.yaml                          the resolved job, frozen before the ranks start (the launcher; rank 0
                                       under torchrun or srun)
  .hydra/overrides.yaml                the command line's overrides (Hydra)
  logs/rank-<k>.log                    everything rank k logged or printed (every rank)
  logs/elastic/node-<n>/               torch's per-worker error and log files (node n's elastic agent)
  checkpoints/step-<N>.pt (+ .sha256)  the training state, names in ``checkpoint_names`` (rank 0)
  checkpoints/step-<N>/                a sharded job's instead: every rank's shards and own part (every rank)
  metrics.jsonl                        one JSON line per logged step and evaluation (rank 0); straggler lines
                                       (rank 0's watch)
  tensorboard/events.out.tfevents.*    metrics.jsonl's train and eval numbers as TensorBoard scalars,
                                       ``train.tensorboard=true`` (rank 0; one file per process that wrote)
  summary.json                         the run's summary, at the end (rank 0: training; the head: the entry,
                                       layout, exit and attempts, a script's too; rank 0 under torchrun)
  attempts/<launch>-attempt-<n>/       node-<k>.json: node k's start of attempt n (its first rank)
  membership.jsonl                     one JSON line per change of machines (the head; rank 0 when healing
                                       in place)
  trace.json                           a few steps' timeline, ``comm.trace=true`` (rank 0)
  plots/curves.png, plots/trace.png    the figures (the launcher at the end, or ``python -m launcher plot``)
  doctor.json                          the doctor's findings (rank 0)
  failures/<launch>/attempt-<n>/       rank-<k>.json: how rank k failed (every rank; its agent for a rank that
                                       ended without one)
  stops/<launch>/attempt-<n>/          rank-<k>.json: how rank k ended after a stop signal (its agent; a script's
                                       rank itself, also where no agent of the launcher's stands above it)
  watch/<launch>/attempt-<n>/          [round-<r>/] rank-<k>.json: rank k's progress, rank-<k>.arrivals.json
                                       (every rank's watch); request.json (the reporter: rank 0's watch)
  hangs/<launch>-attempt-<n>[-round-<r>]-<i>/
                                       report.json (the reporter); rank-<k>.fr.json (flight recorder) and
                                       rank-<k>.stack.txt (every rank's watch, when asked)
  requeues.json                        the requeues rank 0 asked for (rank 0 under Slurm)
  stop-requested.json                  the head's stop: checkpoint, no requeue (the Slurm head)
  <cluster.folder>/%j/                 the pickled task, Slurm's stdout and stderr (submitit)
  .ssh-check-<token>                   proof a host sees the head's run dir (the ssh head; each checked host
                                       writes and removes .ssh-check-<token>-<host>-<pid> beside it)

``<launch>``: the elastic run id or the Slurm job id (``local`` without one); ``<n>``: the 0-based attempt
(restarts or requeues so far). No torch or Hydra here: the head side and the base modules use it too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, init=False)
class RunDir:
    """A run dir; ``RunDir(path)`` (a str or a Path)."""

    path: Path

    def __init__(self, path: str | Path) -> None:
        object.__setattr__(self, "path", Path(path))

    def __str__(self) -> str:
        return str(self.path)

    # ------------------------------------------------------------------------------------------ the config
    @property
    def config(self) -> Path:
        """The resolved job, frozen once before the ranks start: the launcher (rank 0 under torchrun / srun)."""
        return self.path / "config.yaml"

    @property
    def overrides(self) -> Path:
        """Hydra's record of the command line's overrides (Hydra writes it; a bare rerun continues with them)."""
        return self.path / ".hydra" / "overrides.yaml"

    # ------------------------------------------------------------------------------------------ logs
    @property
    def logs(self) -> Path:
        """The logs folder: every rank's log, the elastic agents' files."""
        return self.path / "logs"

    def rank_log(self, rank: int) -> Path:
        """Everything rank ``rank`` logged or printed: that rank (its log handler and redirected output)."""
        return self.logs / f"rank-{rank}.log"

    @property
    def elastic_logs(self) -> Path:
        """Torch's elastic agents' folders, one per node (``node_logs``); the sim head prunes the empty ones."""
        return self.logs / "elastic"

    def node_logs(self, node: int) -> Path:
        """Node ``node``'s elastic agent's error and log files (torch's ``DefaultLogsSpecs``): that agent."""
        return self.elastic_logs / f"node-{node}"

    # ------------------------------------------------------------------------------------------ training
    @property
    def checkpoints(self) -> Path:
        """``step-<N>.pt`` (+ ``.sha256``) or a sharded job's ``step-<N>/`` (names in ``checkpoint_names``): the
        Checkpointer (rank 0; every rank for a sharded one); the head reads."""
        return self.path / "checkpoints"

    @property
    def metrics(self) -> Path:
        """One JSON line per logged step and evaluation: rank 0 (``train.metrics``); straggler lines: the watch."""
        return self.path / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard's event files: rank 0 (``train.tensorboard=true``, ``train.metrics.TensorBoardWriter``)."""
        return self.path / "tensorboard"

    @property
    def summary(self) -> Path:
        """The run's summary, written at the end by rank 0 (``launcher.report.summary``)."""
        return self.path / "summary.json"

    @property
    def attempt_markers(self) -> Path:
        """Each node's start of each attempt of the newest run (``launcher.report.attempts``)."""
        return self.path / "attempts"

    def attempt_marker(self, launch_id: str, attempt: int, node: int) -> Path:
        """Node ``node``'s start of ``attempt`` (its first rank)."""
        return self.attempt_markers / f"{launch_id or 'local'}-attempt-{attempt}" / f"node-{node}.json"

    def attempt_marker_files(self) -> Iterator[Path]:
        return self.attempt_markers.glob("*-attempt-*/node-*.json")

    @property
    def membership(self) -> Path:
        """One JSON line per change of machines: the head (``Membership``), rank 0 when healing in place."""
        return self.path / "membership.jsonl"

    @property
    def trace(self) -> Path:
        """The timeline of a few steps, every rank (``comm.trace=true``, Chrome's format): rank 0."""
        return self.path / "trace.json"

    @property
    def plots(self) -> Path:
        """The figures' folder: the launcher at the end, or ``python -m launcher plot RUN_DIR`` (``commands.plot``)."""
        return self.path / "plots"

    @property
    def curves_plot(self) -> Path:
        """Loss, accuracy, throughput, communication per step (``plot.plot_run``)."""
        return self.plots / "curves.png"

    @property
    def trace_plot(self) -> Path:
        """``trace.json`` drawn as a timeline (``plot.plot_trace``)."""
        return self.plots / "trace.png"

    @property
    def doctor(self) -> Path:
        """The doctor's findings (``doctor=true`` / ``preflight=true``): rank 0."""
        return self.path / "doctor.json"

    # ------------------------------------------------------------------------------------------ failures
    @property
    def failures(self) -> Path:
        """Every launch's failure records (``launcher.report.failures``)."""
        return self.path / "failures"

    def launch_failures(self, launch_id: str) -> Path:
        """One launch's attempts (``attempt-<n>``); the local launcher clears its own before it starts."""
        return self.failures / (launch_id or "local")

    def failure_attempt(self, launch_id: str, attempt: int) -> Path:
        """One attempt's records, ``rank-<k>.json`` (``failure_record_file``): every rank, and its agent for it."""
        return self.launch_failures(launch_id) / f"attempt-{attempt}"

    def failure_attempts(self, launch_id: str) -> list[Path]:
        """The attempt folders of ``launch_id`` written so far, oldest first."""
        return sorted(self.launch_failures(launch_id).glob("attempt-*"), key=lambda p: int(p.name.split("-")[1]))

    def failure_record(self, launch_id: str, attempt: int, rank: int) -> Path:
        """How rank ``rank`` failed in that attempt: that rank, or its agent when it ended without one."""
        return failure_record_file(self.failure_attempt(launch_id, attempt), rank)

    # ------------------------------------------------------------------------------------------ stops
    def stop_ends(self, launch_id: str, attempt: int) -> Path:
        """How each rank of one attempt ended after a stop signal, ``rank-<k>.json`` (``stop_end_file``): its
        agent (``report.stops.record_ends``), a script's rank itself."""
        return self.path / "stops" / (launch_id or "local") / f"attempt-{attempt}"

    def stop_end_attempts(self, launch_id: str) -> list[Path]:
        """The attempt folders of ``launch_id``'s stop records, oldest first."""
        folders = (self.path / "stops" / (launch_id or "local")).glob("attempt-*")
        return sorted(folders, key=lambda p: int(p.name.split("-")[1]))

    # ------------------------------------------------------------------------------------------ the watch
    def watch(self, launch_id: str, attempt: int, round_: int = 0) -> Path:
        """Where the ranks of one attempt (and one round of a job that heals in place) publish their progress:
        every rank's watch (``watch.publisher``); the reporter reads it and asks for dumps (``request_file``)."""
        where = self.path / "watch" / (launch_id or "local") / f"attempt-{attempt}"
        return where / f"round-{round_}" if round_ else where

    @property
    def hangs(self) -> Path:
        """Every hang's folder (``hang``)."""
        return self.path / "hangs"

    def hang(self, launch_id: str, attempt: int, round_: int, number: int) -> Path:
        """The ``number``-th hang report of an attempt (and round): the reporter's ``report.json`` and every rank's
        flight recorder and stacks (``flight_record_file``, ``stack_file``), written by each rank's watch when asked."""
        round_part = f"-round-{round_}" if round_ else ""
        return self.hangs / f"{launch_id or 'local'}-attempt-{attempt}{round_part}-{number}"

    # ------------------------------------------------------------------------------------------ Slurm, ssh
    @property
    def requeues(self) -> Path:
        """How many requeues rank 0 asked for under Slurm (``task_entry.requeue`` writes it before it asks)."""
        return self.path / "requeues.json"

    @property
    def stop_request(self) -> Path:
        """The Slurm head's stop (it was sent SIGTERM, SIGINT or SIGHUP): the ranks checkpoint, no requeue."""
        return self.path / "stop-requested.json"

    def submitit(self, folder: str) -> Path:
        """Submitit's folder (``cluster.folder``): the pickled task, which carries the job's secret."""
        return self.path / folder

    def submitit_jobs(self, folder: str) -> Path:
        """Submitit's per-job folders (``%j``: the Slurm job id), with Slurm's stdout and stderr: submitit."""
        return self.submitit(folder) / "%j"

    def host_check(self, token: str) -> Path:
        """The marker the ssh head writes and each checked host reads: it sees the head's run dir
        (``launch/ssh/hosts.py``, ``launch/ssh/host_check.py``)."""
        return self.path / f".ssh-check-{token}"

    def host_check_probe(self, token: str, host: str, pid: int) -> Path:
        """The file a checked host writes and removes beside the marker: the run dir is writable there."""
        return self.path / f"{self.host_check(token).name}-{host}-{pid}"

    def host_checks(self) -> Iterator[Path]:
        """Every host check's marker still there (a check in flight, or one that left it behind)."""
        return self.path.glob(self.host_check("*").name)


# Inside the folders above: a folder (given, as the watch hands the hang's folder to the ranks) and a rank.


def failure_record_file(attempt_folder: Path, rank: int) -> Path:
    """Rank ``rank``'s failure record in an attempt's folder (``RunDir.failure_attempt``)."""
    return attempt_folder / f"rank-{rank}.json"


def failure_record_files(attempt_folder: Path) -> Iterator[Path]:
    """Every failure record in an attempt's folder."""
    return attempt_folder.glob("rank-*.json")


def stop_end_file(stops_folder: Path, rank: int) -> Path:
    """Rank ``rank``'s end after a stop in an attempt's folder (``RunDir.stop_ends``)."""
    return stops_folder / f"rank-{rank}.json"


def stop_end_files(stops_folder: Path) -> Iterator[Path]:
    """Every rank's end in an attempt's folder of stop records."""
    return stops_folder.glob("rank-*.json")


def progress_file(watch_folder: Path, rank: int) -> Path:
    """Rank ``rank``'s progress, rewritten each beat by its watch (``RunDir.watch``)."""
    return watch_folder / f"rank-{rank}.json"


def arrivals_file(watch_folder: Path, rank: int) -> Path:
    """When rank ``rank`` entered its recent collectives (stragglers), every few seconds by its watch."""
    return watch_folder / f"rank-{rank}.arrivals.json"


def request_file(watch_folder: Path) -> Path:
    """The reporter's newest request for every rank's flight recorder and stacks (the hang's folder)."""
    return watch_folder / "request.json"


def report_file(hang_folder: Path) -> Path:
    """The reporter's report of a hang (``RunDir.hang``)."""
    return hang_folder / "report.json"


def flight_record_file(hang_folder: Path, rank: int) -> Path:
    """Rank ``rank``'s flight recorder (torch's JSON), written by its watch when the reporter asks."""
    return hang_folder / f"rank-{rank}.fr.json"


def stack_file(hang_folder: Path, rank: int) -> Path:
    """Rank ``rank``'s live stacks, every thread, written by its watch when the reporter asks."""
    return hang_folder / f"rank-{rank}.stack.txt"
