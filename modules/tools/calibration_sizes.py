"""How much ``persia calibrate`` measures (:class:`Sizes`): quick for CI and a first look, full for planning, tiny
for tests; and how long each measurement may repeat until it is quiet (:class:`~.noise.Quiet`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from persia_planner.modules.tools.noise import Quiet

__all__ = ["MiB", "Sizes"]

MiB = 1024**2


@dataclass(frozen=True)
class Sizes:
    """How much each benchmark measures (``quick`` for CI and a first look, the full one for planning)."""

    memory_bytes: int
    row_bytes: tuple[int, ...]
    dims: tuple[int, ...]
    poolings: tuple[int, ...]
    optimizers: tuple[str, ...]
    message_bytes: tuple[int, ...]
    rpc_rows: tuple[int, ...]
    repeats: int
    batch: int
    dlrm_shapes: tuple[tuple[int, int], ...]  # (sparse features, embedding dim) of the DLRM dense steps
    dlrm_batches: tuple[int, ...]
    step_steps: int  # steps of each small training job (:mod:`persia_planner.modules.tools.step_calibration`)
    disk_bytes: int = 256 * MiB  # the file the disk's rates are measured on
    disk_ios: int = 4096  # blocks read or written at random per measurement
    # When a measurement stops repeating (rounds of ``repeats`` calls), and how often a step job is run again
    quiet: Quiet = dataclasses.field(default_factory=Quiet)
    step_runs: int = 2
    step_budget_s: float = 200.0  # after it, no step job runs again and the phase is not retried

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        if quick:
            return cls(
                memory_bytes=64 * MiB,
                row_bytes=(64, 256, 1024),
                dims=(16, 64),
                poolings=(1, 8),
                optimizers=("sgd", "rowwise_adagrad"),
                message_bytes=(1024, 64 * 1024, 1 * MiB, 4 * MiB),
                rpc_rows=(1, 1024, 16384),
                repeats=5,
                batch=2048,
                dlrm_shapes=((8, 16), (26, 16), (26, 64)),
                dlrm_batches=(256, 2048),
                step_steps=40,
                disk_bytes=128 * MiB,
                disk_ios=2048,
                quiet=Quiet(max_repeats=20, max_s=1.0),
                step_runs=2,
                step_budget_s=200.0,
            )
        return cls(
            memory_bytes=256 * MiB,
            row_bytes=(64, 128, 256, 512, 1024),
            dims=(16, 32, 64, 128),
            poolings=(1, 4, 16),
            optimizers=("sgd", "rowwise_adagrad", "adagrad"),
            message_bytes=(1024, 16 * 1024, 256 * 1024, 1 * MiB, 4 * MiB, 16 * MiB),
            rpc_rows=(1, 256, 4096, 32768),
            repeats=9,
            batch=4096,
            dlrm_shapes=((4, 16), (8, 16), (13, 32), (26, 16), (26, 64), (40, 32)),
            dlrm_batches=(128, 1024, 4096),
            step_steps=80,
            disk_bytes=1024 * MiB,
            disk_ios=8192,
            quiet=Quiet(max_repeats=45, max_s=5.0),
            step_runs=3,
            step_budget_s=900.0,
        )

    @classmethod
    def tiny(cls) -> Sizes:
        """The least that still exercises every benchmark and fit: for tests (``--sizes tiny``), not for planning."""
        return cls(
            memory_bytes=4 * MiB,
            row_bytes=(64, 256),
            dims=(16, 32),
            poolings=(1, 4),
            optimizers=("sgd", "rowwise_adagrad"),
            message_bytes=(1024, 65536),
            rpc_rows=(1, 256),
            repeats=2,
            batch=256,
            dlrm_shapes=((4, 16), (8, 16)),
            dlrm_batches=(64, 256),
            step_steps=8,
            disk_bytes=8 * MiB,
            disk_ios=256,
            quiet=Quiet(max_repeats=4, max_s=0.2),
            step_runs=1,
            step_budget_s=60.0,
        )

    def longer(self, factor: float) -> Sizes:
        """The same measurements, each repeated up to ``factor`` times as long (``--repeat-until-quiet``)."""
        runs = max(self.step_runs, round(self.step_runs * factor))
        budget = self.step_budget_s * factor
        return dataclasses.replace(self, quiet=self.quiet.longer(factor), step_runs=runs, step_budget_s=budget)
