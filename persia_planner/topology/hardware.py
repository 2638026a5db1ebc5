"""The cluster's parts: hosts (trainers, parameter servers) and their devices (GPUs, or CPU trainer processes)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from persia_planner.topology.profile import HardwareProfile

__all__ = ["DeviceKind", "Gpu", "Host", "NodeKind", "Role"]


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
class Host:
    """A trainer host or a parameter server. Its DDR is one pool shared by its devices (``gpus``: GPU or CPU
    trainer devices). ``profile``: the figures ``persia calibrate`` measured on a machine of this kind."""

    name: str
    role: Role
    ddr_bytes: int
    ddr_bandwidth: float
    nic_bandwidth: float
    gpus: tuple[str, ...] = ()
    profile: HardwareProfile | None = None
