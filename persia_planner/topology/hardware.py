"""The cluster's parts: hosts (trainers, parameter servers) and their devices (GPUs, or CPU trainer processes)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from persia_planner.topology.profile import HardwareProfile

__all__ = ["DEFAULT_SSD_READ_IOPS", "DEFAULT_SSD_WRITE_IOPS", "DeviceKind", "Disk", "Gpu", "Host", "NodeKind", "Role"]

DEFAULT_SSD_READ_IOPS = 400_000.0
"""4 KiB random reads a second of a data-centre NVMe drive at the queue depth a server reaches, where neither the
host nor its profile says."""
DEFAULT_SSD_WRITE_IOPS = 150_000.0
"""4 KiB random writes a second of the same drive."""


class NodeKind(enum.StrEnum):
    """Kinds of graph node."""

    GPU = "gpu"
    HOST = "host"
    SWITCH = "switch"


class DeviceKind(enum.StrEnum):
    """What a trainer device is: a GPU (HBM, PCIe to its host, NVLink to its peers) or a CPU trainer process (its
    share of the host's DDR as its memory, shared-memory links to the host's other processes)."""

    GPU = "gpu"
    CPU = "cpu"


class Role(enum.StrEnum):
    """What a host does."""

    TRAINER = "trainer"
    PARAMETER_SERVER = "parameter_server"


@dataclass(frozen=True)
class Gpu:
    """One trainer device: a GPU, or a CPU trainer process (``kind``). Bandwidths in bytes/s, capacities in bytes.

    For a CPU device, ``hbm_bytes`` is its memory budget for embedding tables (carved from the host's DDR),
    ``hbm_bandwidth`` the rate its embedding kernels reach in host memory, ``pcie_bandwidth`` the host's memory
    bandwidth and ``nvlink_bandwidth`` the collectives' rate between the host's processes.
    """

    name: str
    host: str
    hbm_bytes: int
    hbm_bandwidth: float
    tflops: float
    pcie_bandwidth: float
    nvlink_bandwidth: float
    kind: DeviceKind = DeviceKind.GPU


@dataclass(frozen=True)
class Disk:
    """A parameter server's local disk for the ``ssd`` tier.

    Attributes:
        capacity_bytes: What the tier may fill.
        read_iops: 4 KiB blocks read a second at random (what ``persia calibrate`` measures through the store's own
            reads, ``O_DIRECT``).
        write_iops: 4 KiB blocks written a second at random.
    """

    capacity_bytes: int
    read_iops: float = DEFAULT_SSD_READ_IOPS
    write_iops: float = DEFAULT_SSD_WRITE_IOPS

    def ms_per_miss(self, rows_per_block: float, log_slack: int) -> float:
        """Disk time of a row the DDR cache misses: its block read, and the row it evicts appended to the log
        (``1 / rows_per_block`` of a block written), with the log's compaction, which reads and writes every live
        row once per ``log_slack - 1`` times the rows appended."""
        blocks = 1 / rows_per_block
        compaction = blocks / (log_slack - 1) * (1 / self.read_iops + 1 / self.write_iops)
        return 1e3 * (1 / self.read_iops + blocks / self.write_iops + compaction)


@dataclass(frozen=True)
class Host:
    """A trainer host or a parameter server. Its DDR is one pool shared by its devices (``gpus``: GPU or CPU
    trainer devices). ``profile``: the figures ``persia calibrate`` measured on a machine of this kind. ``ssd``: a
    parameter server's local disk for the ``ssd`` tier (None: none). ``memories``: bytes of each memory a tier module
    registered that no other field describes (topology.yaml's ``memories:``): (name, bytes) pairs."""

    name: str
    role: Role
    ddr_bytes: int
    ddr_bandwidth: float
    nic_bandwidth: float
    gpus: tuple[str, ...] = ()
    profile: HardwareProfile | None = None
    ssd: Disk | None = None
    memories: tuple[tuple[str, int], ...] = ()
