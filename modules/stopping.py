"""A stop the trainers agree on: asked for by a signal, taken at the same step by every trainer, so that the job can
save a final checkpoint before it ends.

The local launcher, on SIGINT or SIGTERM, sets :data:`REQUEST` in the job's store (:func:`request_stop`). (Under
torchrun the agent signals every worker, the parameter servers too: the job ends at once, and its last periodic
checkpoint is the one to resume; ``--max-restarts`` does that by itself.)

Agreement: at the end of step ``s``, trainer 0 that sees a request writes ``stop at s + 2`` to the store; every trainer
reads it at the end of each of its steps and stops after that step. No trainer can have finished step ``s + 1`` before
the write: its collectives of step ``s + 1`` (DDP's all-reduce, TorchRec's all-to-alls) need trainer 0, which writes
at the end of step ``s``, before it starts ``s + 1``. So each trainer still reads the step in time.
"""

from __future__ import annotations

import datetime
from typing import Any

__all__ = ["REQUEST", "STOP_AT", "GracefulStop", "request_stop"]

REQUEST = "persia-stop-request"
"""Store key: somebody asked the job to stop (its value: the signal's name)."""

STOP_AT = "persia-stop-at"
"""Store key: the step after which every trainer stops (written by trainer 0)."""


def request_stop(addr: str, port: int, prefix: str, why: str, timeout_s: float = 10.0) -> None:
    """Ask the trainers of the job whose store is at ``addr:port`` (their keys under ``prefix``) to stop."""
    import torch.distributed as dist

    store = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    dist.PrefixStore(prefix, store).set(REQUEST, why)


class GracefulStop:
    """Trainer ``rank``'s view of the agreed stop; call :meth:`after_step` at the end of every step.

    Args:
        store: The trainers' store (every trainer the same namespace).
        rank: This trainer's rank (0 decides the step).
    """

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.rank = store, rank
        self.stop_at: int | None = None

    @property
    def reason(self) -> str | None:
        """Why the job stops early (the signal's name), once it was asked to."""
        if self.store.check([REQUEST]):
            return self.store.get(REQUEST).decode()
        return None

    def after_step(self, step: int) -> bool:
        """Whether to stop now, after global step ``step``."""
        if self.stop_at is None:
            if self.rank == 0 and self.store.check([REQUEST]):
                self.stop_at = step + 2
                self.store.set(STOP_AT, str(self.stop_at))
            elif self.store.check([STOP_AT]):
                self.stop_at = int(self.store.get(STOP_AT))
        return self.stop_at is not None and step >= self.stop_at
