"""What a run is asked to do: the options of ``persia train`` (:class:`TrainConfig`), each checked as it is given,
without importing torch.

:mod:`.run_inputs` checks them against the model and the data before any process starts; :mod:`.train` re-exports
:class:`TrainConfig` for callers of its Python API. The RPC group's environment is read by
:mod:`persia_planner.modules.rpc_environment`, torch-free as well.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from persia_planner.errors import PlannerError
from persia_planner.limits import (
    MAX_ADAPT_REPLANS,
    MAX_ADAPT_THRESHOLD,
    MAX_EVAL_BATCHES,
    MAX_KEEP,
    MAX_LOCAL_TRAINERS,
    MAX_PS_DELAY_MS,
    MAX_SEED,
    MAX_STEPS,
)
from persia_planner.model.data_schema import BadRowPolicy, DataSchema
from persia_planner.model.dtypes import DType
from persia_planner.model.specs import DEFAULT_STALENESS, ModelSpec, Optimizer
from persia_planner.modules.data.source import (
    DataKind,
    DataSource,
)
from persia_planner.modules.data.split import DEFAULT_EVAL_SPLIT
from persia_planner.modules.train.best_checkpoint import EarlyStopMetric
from persia_planner.modules.train.lr_schedule import CONSTANT, LrSchedule
from persia_planner.modules.wire_dtypes import torch_dtype

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "DEFAULT_DENSE_LR",
    "DEFAULT_MAX_EPOCHS",
    "MAX_ID_SPACE",
    "MAX_SYNTHETIC_IDS",
    "DenseOptimizer",
    "PsCapacity",
    "TrainConfig",
    "TrainMode",
    "data_identity",
    "sparse_eps_of",
    "sparse_optimizer_of",
    "trainer_batch_size",
]

MAX_ID_SPACE = 1000.0
"""The largest ``--id-space``: ids drawn from a thousand times a table's rows already overflow any store."""
MAX_SYNTHETIC_IDS = 2**26
"""The most distinct ids of one synthetic feature: the generator keeps an 8-byte CDF entry per id (512 MiB)."""
MAX_DATA_WORKERS = 64
DEFAULT_SYNTHETIC_STEPS = 400
"""Synthetic data's steps when ``--steps`` is not given (data files train whole epochs)."""
MAX_EPOCHS = 100_000
MAX_SHUFFLE_ROWS = 1 << 26
"""The largest ``--shuffle-buffer``: 64 Mi rows of a reader's buffer already take gigabytes."""
MAX_EVAL_SPLIT = 0.5
DEFAULT_MAX_EPOCHS = 10
"""Data files without ``--epochs`` or ``--steps``: the most epochs a run trains while its validation AUC improves.
MovieLens-100K as clicks peaked after 2-4 epochs and fell after (docs/decisions/0030-measured-defaults.md)."""
_FILE_OPTIONS = {"--epochs": "epochs", "--eval-split": "eval_split", "--eval-data": "eval_data"}


# ---- --data: "synthetic" or "KIND:PATH" (:mod:`persia_planner.modules.data.source`)
# --------------------------------------------------


def data_identity(data: str) -> str:
    """``--data`` as a checkpoint records it: a path resolved, so that the same files under another spelling of their
    path are the same data."""
    return DataSource.parse(data).identity


class TrainMode(enum.StrEnum):
    """How the PS tables train: ``hybrid`` (asynchronously, staleness up to K) or ``sync`` (K = 0)."""

    HYBRID = "hybrid"
    SYNC = "sync"


class PsCapacity(enum.StrEnum):
    """The rows each server's store of a PS table holds: ``planned`` (what the plan charged it for, so a run that
    draws more distinct ids evicts) or ``unbounded`` (every id the synthetic data can draw: nothing is evicted, the
    reference a bounded run is compared with)."""

    PLANNED = "planned"
    UNBOUNDED = "unbounded"


class DenseOptimizer(enum.StrEnum):
    """The ``torch.optim`` optimizer of the dense network."""

    ADAGRAD = "adagrad"
    SGD = "sgd"
    ADAM = "adam"


DEFAULT_DENSE_LR = {DenseOptimizer.ADAM: 0.001, DenseOptimizer.ADAGRAD: 0.05, DenseOptimizer.SGD: 0.05}
"""The dense network's learning rate by optimizer when none is given. Adam at 0.001 is the default optimizer: it
matched or beat Adagrad at 0.05 on the synthetic teacher and on MovieLens-100K, and Adagrad at 0.05 threw a Criteo
sample's loss to 5 at its third step (docs/decisions/0030-measured-defaults.md)."""


def _choice(kind: type[enum.StrEnum], value: Any, option: str) -> Any:
    """``kind(value)``, or a one-line error naming the option and its choices."""
    try:
        return kind(value)
    except ValueError:
        choices = [member.value for member in kind]
        listed = " or ".join(choices) if len(choices) == 2 else "one of " + ", ".join(choices)
        raise PlannerError(f"{option} must be {listed}, got {value!r}") from None


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs (the options of ``persia train``).

    The enum fields accept their values as strings too (``mode="sync"``) and hold the enum afterwards.

    Attributes:
        steps: Training steps (each trainer runs this many batches); synthetic data: default 400; data files: at most
            this many, default None (every step of ``epochs`` epochs).
        epochs: Data files: passes over the training rows, each in its own seeded order (the shards dealt anew to the
            trainers, the rows shuffled within ``shuffle_buffer``); every trainer stops an epoch at the same step,
            when one has read all of its share. None: with ``steps`` 1; without, until the validation AUC stops
            improving (:attr:`early_stop_implied`), at most :data:`DEFAULT_MAX_EPOCHS`.
        eval_split: Data files without ``eval_data``: the share of rows held out for validation, by a hash of each
            row's content (:mod:`persia_planner.modules.data.split`); None: 0.05, or 0 with ``eval_data``.
        eval_data: Validation files of the same kind and schema as ``data`` (``"csv:PATH"``...), never trained on.
        shuffle_buffer: Data files: rows each data reader shuffles together (0: read in file order).
        batch_size: Samples per trainer and step (default: the model's global batch size / trainers).
        staleness: Bounded staleness K of the PS tables (``mode=sync`` forces 0).
        mode: ``hybrid`` (PS tables async with staleness K) or ``sync`` (K = 0: one gathered update per step,
            every step sees every update, reproducible).
        trainers: Trainer processes.
        data: ``"synthetic"``, or ``"criteo:PATH"``, ``"parquet:PATH"`` or ``"csv:PATH"`` (one file or a directory
            of files; :class:`persia_planner.modules.data.source.DataSource`).
        schema: How a Parquet / CSV file's columns feed the model (``--schema``); None: the model's ``data:``. After
            :func:`~.run_inputs.check_before_start`, the one the run reads with: with what the first pass measured.
        on_bad_row: What reading does with a bad row of a Parquet / CSV file (``--on-bad-row``); None: the schema's
            ``on_bad_row`` (:class:`~persia_planner.model.data_schema.BadRowPolicy`).
        data_workers: DataLoader worker processes per trainer reading Parquet, CSV or Criteo files (0: the trainer
            reads them itself); each reads its own part of the trainer's share.
        eval_batches: At most this many batches per trainer in each evaluation; None: data files, every held-out
            row (:attr:`eval_split` or ``eval_data``, the last partial batch padded and masked); synthetic data, 8
            batches drawn with another seed.
        eval_every: Also evaluate every this many steps (0: at each epoch's end and at the end); recorded in
            ``history``.
        early_stop: Stop when :attr:`early_stop_metric` has not improved for this many evaluations in a row (0:
            never), keeping the best evaluation's checkpoint (:mod:`.best_checkpoint`); needs ``checkpoint``.
        early_stop_metric: What :attr:`early_stop` watches on the validation rows: ``auc`` (higher is better) or
            ``ne``, the normalized entropy (lower is better).
        pipeline: Train through TorchRec's ``TrainPipelineSparseDist`` (:mod:`.pipeline`): the local tables' input
            all-to-all of the next batch and the PS rows of the staged batches overlap the current step.
        sparse_lr: Learning rate of the sparse optimizer (row-wise Adagrad by default).
        sparse_optimizer: ``rowwise_adagrad``, ``adagrad``, ``sgd`` or ``adam`` (local tables: CUDA only, fbgemm has
            no CPU adam), for every table; None: the one the model's tables name (``optimizer:`` in model.yaml, which
            the plan sized their state for).
        sparse_weight_decay: Decoupled weight decay of the embedding rows each step updates, local and PS tables
            alike (:attr:`persia_planner.modules.embedding.hybrid.SparseOptimizer.weight_decay`); 0: none.
        sparse_eps: The tables' optimizer epsilon (Adagrad's and Adam's denominator), local and PS tables alike;
            None: the optimizer's own (:attr:`persia_planner.model.specs.Optimizer.default_eps`).
        dense_lr: Learning rate of the dense optimizer; None: :data:`DEFAULT_DENSE_LR`'s for ``dense_optimizer``.
        dense_optimizer: ``adam`` (the default), ``adagrad`` or ``sgd``.
        lr_schedule: Warmup and decay of every learning rate, dense and sparse (``--lr-schedule``, a
            :class:`~.lr_schedule.LrSchedule` or its text); the default keeps the rates constant.
        ps_delay_ms: Added to every PS call (a stand-in for a slow network).
        ps_wire: The dtype PS rows and gradients travel in: ``fp32`` (exact), ``fp16`` or ``bf16`` (half the bytes,
            as Persia sends them; the servers keep each table's rows in its ``embedding_dtype``); torch's names
            (``float16``) are read alike (:meth:`persia_planner.model.dtypes.DType.parse`).
        checkpoint: Directory of the job's checkpoints (:mod:`persia_planner.modules.train.job_checkpoints`): one at the
            end, one every ``checkpoint_every`` steps, and one when a signal stops the job.
        checkpoint_every: Also checkpoint after every this many global steps (0: only at the end).
        keep: How many checkpoints of this run ``checkpoint`` keeps (the newest ones).
        resume: Start from the newest whole checkpoint in ``checkpoint``.
        overwrite: Train into a ``checkpoint`` directory that is not empty, replacing what it holds, without
            ``resume``.
        seed: Seed of the model, the data and the servers' row initialisers.
        progress: Show a progress bar (trainer 0).
        teacher_rows_scale: Synthetic data (``--id-space``): each feature's ids are drawn from this many times its
            table's rows. The default 0.02 keeps every id in the tables (their hot 2%); 1 draws from every row; above
            1 the data brings more distinct ids than the table has rows, as hashed ids from a larger space do, so a
            server's store fills and evicts while training.
        ps_capacity: ``planned`` (each server's store holds the rows the plan charged it for) or ``unbounded``
            (it holds every id the synthetic data can draw; needs ``data="synthetic"``).
        log_dir: Directory of the run's logs (:mod:`.metrics_log`, :mod:`persia_planner.modules.process_logs`): per-step
            metrics as JSON lines and TensorBoard events, the summary, one log file per process. ``resume`` appends to
            it; a run from scratch into one that holds metrics needs ``overwrite``.
        ssd_dir: Where the parameter servers keep the files of their ``ssd`` tables (on each server's host; None:
            its temporary directory).
        adapt: Re-plan while training (:mod:`.adapt`): after a warm-up window, when the measured step is more than
            ``adapt_threshold`` off the plan's prediction, refit the cost model, plan again and migrate to a plan
            predicted faster by more than the migration costs (through a checkpoint: needs ``checkpoint``).
        adapt_threshold: How far (a share of the predicted step) the measured step may be off before a re-plan.
        adapt_max: The most re-plans of a run (a rollback to the better plan counts).
        adapt_window: Steps of the warm-up after each start or migration, and of each measurement window after it.
        adapt_qcomms: The planner chose the plan's collectives' precisions (``Plan.qcomms_chosen``, and the model
            leaves them ``auto``): a re-plan chooses them again, as ``persia plan`` would; otherwise they stay.

    Raises:
        PlannerError: An option is out of range or not one of its choices (one line, naming the option).
    """

    steps: int | None = None
    epochs: int | None = None
    eval_split: float | None = None
    eval_data: str | None = None
    shuffle_buffer: int = 65_536
    batch_size: int | None = None
    staleness: int = DEFAULT_STALENESS
    mode: TrainMode = TrainMode.HYBRID
    trainers: int = 2
    data: str = "synthetic"
    schema: DataSchema | None = None
    on_bad_row: BadRowPolicy | None = None
    data_workers: int = 0
    eval_batches: int | None = None
    eval_every: int = 0
    early_stop: int = 0
    early_stop_metric: EarlyStopMetric = EarlyStopMetric.AUC
    early_stop_implied: bool = False
    """Set, not given: data files with neither ``epochs`` nor ``steps`` train until an epoch's evaluation is no better
    than the best before it (``early_stop`` 1, at most :data:`DEFAULT_MAX_EPOCHS` epochs); the best is kept only with
    ``checkpoint``."""
    pipeline: bool = False
    sparse_lr: float = 0.1
    sparse_optimizer: Optimizer | None = None
    sparse_weight_decay: float = 0.0
    sparse_eps: float | None = None
    dense_lr: float | None = None
    dense_optimizer: DenseOptimizer = DenseOptimizer.ADAM
    lr_schedule: LrSchedule = CONSTANT
    ps_delay_ms: float = 0.0
    ps_wire: DType = DType.FP32
    checkpoint: str | None = None
    checkpoint_every: int = 0
    keep: int = 2
    resume: bool = False
    overwrite: bool = False
    seed: int = 0
    progress: bool = True
    teacher_rows_scale: float = 0.02
    ps_capacity: PsCapacity = PsCapacity.PLANNED
    log_dir: str | None = None
    ssd_dir: str | None = None
    adapt: bool = False
    adapt_threshold: float = 0.10
    adapt_max: int = 2
    adapt_window: int = 20
    adapt_qcomms: bool = False
    data_rows: int | None = None
    """The data's training rows as :func:`~.run_inputs.check_before_start` counted them (None: not counted); sizes
    the progress."""

    def __post_init__(self) -> None:
        # frozen: the string-to-enum conversions go through object.__setattr__, once, here.
        object.__setattr__(self, "mode", _choice(TrainMode, self.mode, "--mode"))
        metric = _choice(EarlyStopMetric, self.early_stop_metric, "--early-stop-metric")
        object.__setattr__(self, "early_stop_metric", metric)
        object.__setattr__(self, "ps_wire", DType.parse(self.ps_wire, "--ps-wire"))
        object.__setattr__(self, "ps_capacity", _choice(PsCapacity, self.ps_capacity, "--ps-capacity"))
        object.__setattr__(self, "dense_optimizer", _choice(DenseOptimizer, self.dense_optimizer, "--dense-optimizer"))
        if self.dense_lr is None:
            object.__setattr__(self, "dense_lr", DEFAULT_DENSE_LR[self.dense_optimizer])
        if self.sparse_optimizer is not None:
            object.__setattr__(
                self, "sparse_optimizer", _choice(Optimizer, self.sparse_optimizer, "--sparse-optimizer")
            )
        if self.on_bad_row is not None:
            object.__setattr__(self, "on_bad_row", _choice(BadRowPolicy, self.on_bad_row, "--on-bad-row"))
        self._check_passes()
        if self.data != DataKind.SYNTHETIC.value and self.epochs is None and self.steps is None:
            object.__setattr__(self, "epochs", DEFAULT_MAX_EPOCHS)
            object.__setattr__(self, "early_stop_implied", not self.early_stop)
            object.__setattr__(self, "early_stop", self.early_stop or 1)
        if (self.steps is not None and self.steps < 1) or self.trainers < 1 or (self.eval_batches or 1) < 1:
            raise PlannerError("--steps, trainers and eval batches must be >= 1")
        for option, value, ceiling in (
            ("--steps", self.steps or 0, MAX_STEPS),
            ("--epochs", self.epochs or 0, MAX_EPOCHS),
            ("--shuffle-buffer", self.shuffle_buffer, MAX_SHUFFLE_ROWS),
            ("--eval-every", self.eval_every, MAX_STEPS),
            ("--checkpoint-every", self.checkpoint_every, MAX_STEPS),
            ("--trainers", self.trainers, MAX_LOCAL_TRAINERS),
            ("--eval-batches", self.eval_batches or 0, MAX_EVAL_BATCHES),
            ("--early-stop", self.early_stop, MAX_STEPS),
            ("--seed", self.seed, MAX_SEED),
        ):
            if value > ceiling:
                raise PlannerError(f"{option} must be at most {ceiling:,}, got {value:,}", fixes=(f"lower {option}",))
        if self.batch_size is not None and self.batch_size < 1:
            raise PlannerError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.staleness < 0:
            raise PlannerError(f"--staleness must be >= 0, got {self.staleness}")
        if not 0 <= self.ps_delay_ms <= MAX_PS_DELAY_MS:  # nan and inf fail this too
            raise PlannerError(
                f"--ps-delay-ms must be a number in [0, {MAX_PS_DELAY_MS:g}] (ms per PS call), got {self.ps_delay_ms}"
            )
        if self.eval_every < 0:
            raise PlannerError(
                f"--eval-every must be >= 0 (0: at each epoch's end and at the end), got {self.eval_every}"
            )
        self._check_early_stop()
        for name, value in (("--sparse-lr", self.sparse_lr), ("--dense-lr", self.dense_lr)):
            if not 0 < value < math.inf:  # nan fails this too
                raise PlannerError(f"{name} must be a finite number > 0, got {value}", fixes=(f"e.g. {name} 0.05",))
        self._check_regularisation()
        if not 0 < self.teacher_rows_scale <= MAX_ID_SPACE:  # nan fails this too
            raise PlannerError(
                f"--id-space must be a number in (0, {MAX_ID_SPACE:g}] (ids per table row), "
                f"got {self.teacher_rows_scale}",
                fixes=("e.g. --id-space 0.02 (the default: the tables' hot ids) or 4 (more ids than rows)",),
            )
        if self.checkpoint_every < 0:
            raise PlannerError(
                f"--checkpoint-every must be >= 0 steps (0: only at the end), got {self.checkpoint_every}"
            )
        if not 1 <= self.keep <= MAX_KEEP:
            raise PlannerError(f"--keep must be in [1, {MAX_KEEP}] checkpoints, got {self.keep}")
        if self.checkpoint_every and not self.checkpoint:
            raise PlannerError(
                "--checkpoint-every needs --checkpoint DIR", fixes=("pass the directory to keep the checkpoints in",)
            )
        self._check_adapt()
        if self.resume and not self.checkpoint:
            raise PlannerError("--resume needs --checkpoint DIR", fixes=("pass the directory of the checkpoint",))
        if self.resume and self.overwrite:
            raise PlannerError(
                "--resume continues the checkpoint that --overwrite would replace: pass one of them",
                fixes=("--resume to continue it", "--overwrite to train from scratch into it"),
            )
        tabular = DataSource.parse(self.data).tabular
        if self.schema is not None and not tabular:
            raise _schema_for_other_data(self.schema, self.data)
        if self.on_bad_row is not None and not tabular:
            raise PlannerError(
                f"--on-bad-row says what to do with bad rows of Parquet or CSV files, not of --data {self.data}",
                fixes=("drop --on-bad-row", "pass --data parquet:PATH or csv:PATH"),
            )
        if not 0 <= self.data_workers <= MAX_DATA_WORKERS:
            raise PlannerError(f"--data-workers must be in [0, {MAX_DATA_WORKERS}], got {self.data_workers}")
        if self.ps_capacity is PsCapacity.UNBOUNDED and self.data != "synthetic":
            raise PlannerError(
                "--ps-capacity unbounded needs --data synthetic: the ids of data files are not known before reading",
                fixes=("--ps-capacity planned",),
            )

    def _check_adapt(self) -> None:
        """``--adapt``'s options are in range, and a migration has a checkpoint directory to go through."""
        if not 0 <= self.adapt_threshold <= MAX_ADAPT_THRESHOLD:  # nan fails this too
            raise PlannerError(
                f"--adapt-threshold must be a share in [0, {MAX_ADAPT_THRESHOLD:g}] of the predicted step, got "
                f"{self.adapt_threshold}",
                fixes=("e.g. --adapt-threshold 0.1 (10%)",),
            )
        if not 1 <= self.adapt_max <= MAX_ADAPT_REPLANS:
            raise PlannerError(f"--adapt-max must be in [1, {MAX_ADAPT_REPLANS}] re-plans, got {self.adapt_max}")
        if not 1 <= self.adapt_window <= MAX_STEPS:
            raise PlannerError(f"--adapt-window must be in [1, {MAX_STEPS:,}] steps, got {self.adapt_window}")
        if self.adapt and not self.checkpoint:
            raise PlannerError(
                "--adapt needs --checkpoint DIR: a migration to a new plan saves the job there and resumes from it",
                fixes=("pass --checkpoint DIR",),
            )

    def _check_regularisation(self) -> None:
        """``--lr-schedule`` read from its text; ``--sparse-weight-decay`` shrinks a row by less than itself;
        ``--sparse-eps`` is a small non-negative number."""
        if isinstance(self.lr_schedule, str):
            object.__setattr__(self, "lr_schedule", LrSchedule.parse(self.lr_schedule))
        ceiling = 1 / self.sparse_lr  # lr * wd >= 1 would zero or flip a row at each update
        if not 0 <= self.sparse_weight_decay < ceiling:  # nan fails this too
            raise PlannerError(
                f"--sparse-weight-decay must be in [0, 1 / --sparse-lr) = [0, {ceiling:g}), got "
                f"{self.sparse_weight_decay}",
                fixes=("e.g. --sparse-weight-decay 1e-4", "0 for none"),
            )
        if self.sparse_eps is not None and not 0 <= self.sparse_eps <= 1:  # nan fails this too
            raise PlannerError(
                f"--sparse-eps must be in [0, 1], got {self.sparse_eps}",
                fixes=("e.g. --sparse-eps 1e-3", "leave it out for the optimizer's default"),
            )

    def _check_early_stop(self) -> None:
        if self.early_stop < 0:
            raise PlannerError(f"--early-stop must be >= 0 evaluations (0: never stop early), got {self.early_stop}")
        if self.early_stop and not self.checkpoint and not self.early_stop_implied:
            raise PlannerError(
                "--early-stop keeps the best evaluation's checkpoint: it needs --checkpoint DIR",
                fixes=("pass --checkpoint DIR",),
            )

    def _check_passes(self) -> None:
        """Steps, epochs and the validation data fit the kind of data; synthetic data's steps default to 400."""
        synthetic = self.data == DataKind.SYNTHETIC.value
        if synthetic:
            given = next((o for o, v in _FILE_OPTIONS.items() if getattr(self, v) is not None), None)
            if given is not None:
                raise PlannerError(
                    f"{given} reads data files; synthetic data is drawn fresh every step",
                    fixes=(f"drop {given}", "pass --data KIND:PATH"),
                )
            if self.steps is None:
                object.__setattr__(self, "steps", DEFAULT_SYNTHETIC_STEPS)
        if self.epochs is not None and self.epochs < 1:
            raise PlannerError(f"--epochs must be >= 1, got {self.epochs}")
        if self.shuffle_buffer < 0:
            raise PlannerError(f"--shuffle-buffer must be >= 0 rows (0: no shuffle), got {self.shuffle_buffer}")
        if self.eval_split is not None and not 0 <= self.eval_split <= MAX_EVAL_SPLIT:  # nan fails this too
            raise PlannerError(
                f"--eval-split must be in [0, {MAX_EVAL_SPLIT:g}] (the share of rows held out), got {self.eval_split}",
                fixes=(f"e.g. --eval-split {DEFAULT_EVAL_SPLIT:g}",),
            )
        if self.eval_data is not None:
            if self.eval_split:
                raise PlannerError(
                    "--eval-data and --eval-split both say what to validate on: pass one",
                    fixes=("--eval-data PATH to validate on other files", "--eval-split F to hold out rows"),
                )
            kind = DataSource.parse(self.eval_data).kind
            if kind is not DataSource.parse(self.data).kind:
                raise PlannerError(
                    f"--eval-data {self.eval_data} is {kind.value} but --data is {self.data}: the same reader and "
                    "schema read both",
                    fixes=(f"pass --eval-data {DataSource.parse(self.data).kind.value}:PATH",),
                )

    @property
    def held_out_share(self) -> float:
        """The share of the training files' rows held out for validation (0 with ``eval_data`` or synthetic)."""
        if self.data == DataKind.SYNTHETIC.value or self.eval_data is not None:
            return 0.0
        return DEFAULT_EVAL_SPLIT if self.eval_split is None else self.eval_split

    @property
    def passes(self) -> int:
        """Data files: the epochs the run trains (1 unless ``epochs`` says)."""
        return self.epochs or 1

    @property
    def effective_staleness(self) -> int:
        return 0 if self.mode is TrainMode.SYNC else self.staleness

    @property
    def ps_wire_dtype(self) -> torch.dtype:
        return torch_dtype(self.ps_wire)


def sparse_optimizer_of(cfg: TrainConfig, spec: ModelSpec) -> Optimizer:
    """The sparse optimizer a run applies to every table: ``cfg``'s if given, else the one the model's tables name
    (the plan sized their optimizer state for it)."""
    if cfg.sparse_optimizer is not None:
        return cfg.sparse_optimizer
    kinds = sorted({t.optimizer for t in spec.tables})
    if len(kinds) > 1:
        raise PlannerError(
            f"model {spec.name}: tables name different sparse optimizers ({', '.join(k.value for k in kinds)}); "
            "training applies one optimizer to every table",
            fixes=("give every table the same optimizer: in model.yaml",),
        )
    return kinds[0]


def sparse_eps_of(cfg: TrainConfig, spec: ModelSpec) -> float | None:
    """The tables' optimizer epsilon a run applies: ``cfg``'s if given, else the run's optimizer's own
    (:attr:`persia_planner.model.specs.Optimizer.default_eps`; None for SGD, which has none)."""
    return sparse_optimizer_of(cfg, spec).default_eps if cfg.sparse_eps is None else cfg.sparse_eps


def trainer_batch_size(cfg: TrainConfig, spec: ModelSpec, trainers: int) -> int:
    """Samples per step of each trainer: ``--batch-size``, else the model's ``batch_size`` shared by the trainers."""
    return cfg.batch_size or max(1, spec.batch_size // trainers)


def _schema_for_other_data(schema: DataSchema, data: str) -> PlannerError:
    """The error of a columns' schema given with data that has no columns to map: it names where the schema came
    from, --schema or a model's data:, and the fix for that."""
    if schema.from_file:
        return PlannerError(
            f"--schema {schema.source} maps the columns of Parquet or CSV files, not --data {data}",
            fixes=("drop --schema", "pass --data parquet:PATH or csv:PATH"),
        )
    return PlannerError(
        f"--data {data}: the model's columns (data: of {schema.source}) are those of Parquet or CSV files, which this "
        "data is not",
        fixes=("pass --data parquet:PATH or csv:PATH, files with those columns",),
    )
