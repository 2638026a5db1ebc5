"""``--lr-schedule``: learning-rate warmup and decay, for the dense optimizer and every embedding table alike.

:class:`LrSchedule` is the option (torch-free, checked as :class:`.config.TrainConfig` is built): a linear warmup over
the first ``warmup`` steps, then a ``cosine`` or ``linear`` decay to ``min`` times the base rate at the run's last step,
or no decay. :class:`ScheduledRates` applies it with torch's ``LambdaLR`` to an optimizer whose param groups are the
dense network's, the data-parallel replicas' and TorchRec's fused optimizer's (DMP's ``fused_optimizer``, a
``KeyedOptimizer``): a scheduler on it moves every table it holds, the local tables and the PS tables alike. The
factor of a step is a function of the job's step number alone, so a resumed run (or a migrated one, ``--adapt``)
continues the curve where the checkpoint left it without any scheduler state in the checkpoint.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from persia_planner.errors import PlannerError

__all__ = ["CONSTANT", "MAX_WARMUP_STEPS", "Decay", "LrSchedule", "ScheduledRates"]

MAX_WARMUP_STEPS = 10**9
"""The longest warmup (``--steps``' own ceiling)."""

_EXAMPLES = ("constant", "warmup=500", "cosine", "warmup=500,decay=cosine,min=0.1", "linear")


class Decay(enum.StrEnum):
    """How the rate falls after the warmup: ``none`` (stays at the base rate), ``cosine`` or ``linear`` (to ``min``
    times the base rate at the run's last step)."""

    NONE = "none"
    COSINE = "cosine"
    LINEAR = "linear"


@dataclass(frozen=True)
class LrSchedule:
    """A learning-rate schedule: the factor each step's rate is the base rate times (:meth:`factor`).

    Attributes:
        warmup_steps: The first steps' rates rise linearly, ``(step + 1) / warmup_steps`` of the base rate.
        decay: The fall after the warmup.
        min_factor: Where a decay ends, as a share of the base rate (in ``[0, 1]``).
    """

    warmup_steps: int = 0
    decay: Decay = Decay.NONE
    min_factor: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "decay", Decay(self.decay))
        if isinstance(self.warmup_steps, bool) or not 0 <= self.warmup_steps <= MAX_WARMUP_STEPS:
            raise _bad(str(self.warmup_steps), f"warmup must be a step count in [0, {MAX_WARMUP_STEPS:,}]")
        if not 0.0 <= self.min_factor <= 1.0:  # nan fails this too
            raise _bad(str(self.min_factor), "min must be a share of the base rate in [0, 1]")

    @classmethod
    def parse(cls, text: str) -> LrSchedule:
        """``--lr-schedule``'s text: ``constant``, ``cosine``, ``linear``, or comma-separated ``warmup=STEPS``,
        ``decay=none|cosine|linear`` and ``min=SHARE`` (``warmup=500,decay=cosine,min=0.1``).

        Raises:
            PlannerError: Anything else, in one line with examples.
        """
        words = [w.strip() for w in text.strip().lower().split(",") if w.strip()]
        if words in ([], ["constant"]):
            return cls()
        values: dict[str, Any] = {}
        for word in words:
            key, sep, value = word.partition("=")
            key = key.strip()
            if not sep and key in (Decay.COSINE, Decay.LINEAR):
                key, value = "decay", key
            elif not sep or key not in ("warmup", "decay", "min"):
                raise _bad(text, f"{word!r} is not warmup=STEPS, decay=cosine|linear|none or min=SHARE")
            if key in values:
                raise _bad(text, f"{key} is given twice")
            values[key] = value.strip()
        try:
            warmup = int(values.get("warmup", "0"))
        except ValueError:
            raise _bad(text, f"warmup={values['warmup']} is not a whole number of steps") from None
        try:
            decay = Decay(values.get("decay", Decay.NONE.value))
        except ValueError:
            raise _bad(text, f"decay={values['decay']} is not cosine, linear or none") from None
        try:
            floor = float(values.get("min", "0"))
        except ValueError:
            raise _bad(text, f"min={values['min']} is not a number") from None
        if "min" in values and decay is Decay.NONE:
            raise _bad(text, "min is where a decay ends, but no decay is given")
        return cls(warmup, decay, floor)

    def __str__(self) -> str:
        """The canonical ``--lr-schedule`` text of this schedule (:meth:`parse` reads it back)."""
        if self == CONSTANT:
            return "constant"
        parts = [f"warmup={self.warmup_steps}"] if self.warmup_steps else []
        if self.decay is not Decay.NONE:
            parts.append(f"decay={self.decay.value}")
            if self.min_factor:
                parts.append(f"min={self.min_factor:g}")
        return ",".join(parts)

    @property
    def needs_total(self) -> bool:
        """Whether the factors depend on the run's total steps (a decay ends at the last one)."""
        return self.decay is not Decay.NONE

    def factor(self, step: int, total_steps: int | None = None) -> float:
        """The share of the base rate of the step after ``step`` steps (the first step is ``step = 0``).

        Args:
            step: Steps done before this one, over the whole job (a resumed run counts its checkpoint's).
            total_steps: The job's steps (needed by a decay; its last step is ``total_steps - 1``).

        Raises:
            PlannerError: A decay without ``total_steps``.
        """
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay is Decay.NONE:
            return 1.0
        if total_steps is None:
            raise PlannerError(
                f"--lr-schedule {self}: a decay needs the run's total steps, which are not known",
                fixes=("pass --steps", "drop the decay: --lr-schedule warmup=STEPS"),
            )
        done = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        left = 0.5 * (1.0 + math.cos(math.pi * done)) if self.decay is Decay.COSINE else 1.0 - done
        return self.min_factor + (1.0 - self.min_factor) * left


CONSTANT = LrSchedule()
"""No warmup and no decay: every rate stays its base rate (``--lr-schedule constant``, the default)."""


def _bad(text: str, problem: str) -> PlannerError:
    return PlannerError(
        f"--lr-schedule {text!r}: {problem}", fixes=tuple(f"--lr-schedule {example}" for example in _EXAMPLES[1:4])
    )


class ScheduledRates:
    """``schedule`` applied to ``optimizer``'s param groups with torch's ``LambdaLR``, from the job's step ``step``.

    Each group's rate is its base rate (``initial_lr``, which a resumed optimizer brings back; else its rate now)
    times :meth:`LrSchedule.factor`. Call :meth:`step` after each training step: it sets the next step's rates, and
    steps nothing else.

    Args:
        optimizer: A ``torch.optim.Optimizer`` (TorchRec's ``CombinedOptimizer`` of the dense optimizer and
            ``DistributedModelParallel.fused_optimizer``, as the trainers build it).
        schedule: The schedule.
        total_steps: The job's steps (None: not known; a decay then refuses).
        step: The job's steps already done (a resumed run's checkpoint step).
    """

    def __init__(self, optimizer: Any, schedule: LrSchedule, total_steps: int | None, step: int = 0) -> None:
        from torch.optim.lr_scheduler import LambdaLR

        self.schedule, self.total_steps, self.first_step = schedule, total_steps, int(step)
        schedule.factor(self.first_step, total_steps)  # a decay without a total refuses now, before any step
        self.scheduler = LambdaLR(optimizer, lambda k: schedule.factor(self.first_step + k, total_steps))

    @property
    def job_step(self) -> int:
        """The job's steps done, as the rates now in the groups count them."""
        return self.first_step + self.scheduler.last_epoch

    def step(self) -> None:
        """One training step is done: the next one's rates."""
        self.scheduler.step()

    def rates(self) -> list[float]:
        """Each param group's rate now."""
        return [float(group["lr"]) for group in self.scheduler.optimizer.param_groups]
