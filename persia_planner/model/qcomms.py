"""Quantized communication: the precisions the trainers' collectives carry (ZionEX's FP16 / BF16 all-to-alls).

The pooled embeddings' all-to-all (``forward``), their gradients' all-to-all (``backward``) and the dense gradients'
all-reduce (``backward`` too) may travel in fp16 or bf16 instead of float32: half the bytes on every link, for a
conversion at each end and a rounding of what travels. The runtime executes it with TorchRec's ``QCommsConfig``
codecs for the local tables and a DDP communication hook for the dense part; the planner prices both
(``persia_planner.cost``) and, where the model leaves ``qcomms`` to it, keeps what pays (``persia_planner.planner``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from persia_planner.errors import ErrorKind, PlannerError, abbreviate
from persia_planner.model.dtypes import DType

__all__ = ["AUTO", "FP32_COMMS", "QComms", "qcomms_candidates"]

AUTO = "auto"
"""model.yaml's and ``persia plan --qcomms``'s word for: the planner chooses."""


@dataclass(frozen=True)
class QComms:
    """The precisions of a plan's collectives between trainers.

    Attributes:
        forward: The pooled embeddings' all-to-all.
        backward: Their gradients' all-to-all and the dense gradients' all-reduce.
    """

    forward: DType = DType.FP32
    backward: DType = DType.FP32

    @property
    def quantized(self) -> bool:
        """Whether any collective is narrowed."""
        return self != FP32_COMMS

    def to_dict(self) -> dict[str, str]:
        """As plan.json and model.yaml write it."""
        return {"forward": self.forward.value, "backward": self.backward.value}

    def __str__(self) -> str:
        return "fp32" if not self.quantized else f"{self.forward.value} forward, {self.backward.value} backward"

    @classmethod
    def parse(cls, text: str, option: str) -> QComms:
        """``fp16`` (both directions) or ``fp16,bf16`` (forward, backward), in our names or torch's.

        Raises:
            PlannerError: Another form; the message names ``option``.
        """
        parts = [p.strip() for p in text.split(",")]
        if len(parts) not in (1, 2) or not all(parts):
            raise PlannerError(
                f"{option} must be auto, one dtype (fp16) or forward,backward (fp16,bf16), got {abbreviate(text, 30)}",
                kind=ErrorKind.INPUT,
            )
        forward = DType.parse(parts[0], option)
        return cls(forward, DType.parse(parts[-1], option))

    @classmethod
    def from_value(cls, value: Any, where: str) -> QComms | None:
        """model.yaml's or plan.json's ``qcomms``: ``auto`` (None: the planner chooses), a dtype for both
        directions, or ``{forward, backward}``.

        Raises:
            PlannerError: Anything else; the message names ``where``.
        """
        if value == AUTO:
            return None
        if isinstance(value, str):
            return cls.parse(value, where)
        if isinstance(value, dict) and set(value) <= {"forward", "backward"}:
            return cls(*(DType.parse(str(value.get(k, "fp32")), f"{where}.{k}") for k in ("forward", "backward")))
        raise PlannerError(
            f"{where} must be auto, a dtype (fp16) or {{forward: fp16, backward: bf16}}, got "
            f"{abbreviate(str(value), 40)}",
            kind=ErrorKind.INPUT,
        )


FP32_COMMS = QComms()


def qcomms_candidates(cuda: bool) -> tuple[QComms, ...]:
    """What the planner weighs where the model leaves ``qcomms`` to it, float32 first.

    fp16 forward (pooled embeddings keep fp16's 11-bit mantissa), and bf16 backward where the trainers have GPUs
    (gradients keep float32's range, as ZionEX and TorchRec's own default pair). gloo has no bf16 all-reduce hook
    (torch's ``bf16_compress_hook`` needs NCCL), so CPU trainers narrow their gradients to fp16.
    """
    return (FP32_COMMS, QComms(DType.FP16, DType.BF16 if cuda else DType.FP16))
