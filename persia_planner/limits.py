"""Ceilings on what input files and options may ask for: the one home of every maximum a count or size in model.yaml,
topology.yaml and plan.json is checked against (formats.md lists them), of those of ``persia train``'s options, and
of the floors of the disk rates.

A value over its ceiling is refused when the file is read, with the ceiling and the fix in the message: no such value
is a plausible cluster or model, and letting it through gives a 300-digit step time, an int64 overflow inside the
cost model's numpy arrays, or a training run with an absurd setting. Each ceiling is far above any real use, so that
it catches mistakes (a unit typo, ``1e300``) and hostile files, never a large honest model.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from persia_planner.units import Quantity

__all__ = [
    "MAX_ADAPT_REPLANS",
    "MAX_ADAPT_THRESHOLD",
    "MAX_BANDWIDTH",
    "MAX_BATCH_SIZE",
    "MAX_DENSE_FEATURES",
    "MAX_DENSE_FLOPS_PER_SAMPLE",
    "MAX_DENSE_PARAMETERS",
    "MAX_DIM",
    "MAX_DISK_IOPS",
    "MAX_EVAL_BATCHES",
    "MAX_GPUS_PER_HOST",
    "MAX_HOST_COUNT",
    "MAX_INPUT_BYTES",
    "MAX_KEEP",
    "MAX_LATENCY_S",
    "MAX_LAYERS",
    "MAX_LAYER_WIDTH",
    "MAX_LOCAL_TRAINERS",
    "MAX_MEMORY_BYTES",
    "MAX_OF_KIND",
    "MAX_POOLING_FACTOR",
    "MAX_PS_DELAY_MS",
    "MAX_ROWS",
    "MAX_SEED",
    "MAX_SHARDS_PER_TABLE",
    "MAX_STALENESS",
    "MAX_STEPS",
    "MAX_TABLES",
    "MAX_TABLE_COUNT",
    "MAX_TFLOPS",
    "MAX_TOPOLOGY_LINKS",
    "MAX_TOPOLOGY_NODES",
    "MAX_TUNING_CANDIDATES",
    "MAX_TUNING_ROUNDS",
    "MAX_ZIPF_ALPHA",
    "MIN_DISK_BYTES",
    "MIN_DISK_BYTES_PER_S",
    "MIN_DISK_IOPS",
]

# ---- every input file ---------------------------------------------------------------------------------------------
MAX_INPUT_BYTES = 64 * 2**20
"""The largest input file read (64 MiB): the largest real model.yaml (a million tables) is a few tens of MiB, and a
bound keeps ``/dev/zero`` or a runaway generator from filling memory."""

MAX_OF_KIND: Mapping[Quantity, int | float] = MappingProxyType(
    {
        Quantity.COUNT: 2**63 - 1,
        Quantity.SIZE: 2**63 - 1,
        Quantity.BANDWIDTH: 1e18,
        Quantity.DURATION: 1e6,
        Quantity.NUMBER: 1e18,
    }
)
"""The backstop of every field of a kind, where the field has no tighter ceiling of its own: counts and sizes fit an
int64 (numpy's and torch's integer), rates and numbers stay far from float overflow once multiplied together."""

# ---- model.yaml ---------------------------------------------------------------------------------------------------
MAX_BATCH_SIZE = 2**31 - 1
"""Samples per step: fbgemm and TorchRec index a batch's samples and offsets with int32."""

MAX_STALENESS = 1000
"""Steps of lag of the parameter-server tables: every step in flight holds a batch of ids and gradients, and a lag of
more than a few tens of steps no longer trains."""

MAX_ROWS = 2**44
"""Rows of one table (17.6 trillion, 30x the largest bundled example): with :data:`MAX_DIM` columns and Adam's state,
a table's bytes still fit an int64."""

MAX_DIM = 16_384
"""Columns of one table (fbgemm's kernels go to a few thousand)."""

MAX_POOLING_FACTOR = 100_000
"""Mean ids per sample looked up in one table."""

MAX_ZIPF_ALPHA = 10.0
"""Access skew of a table's ids: past a few, every lookup hits the first rows, so larger values say nothing more."""

MAX_TABLE_COUNT = 1_000_000
"""Copies of one ``tables:`` entry (``count:``): each copy is a table of its own, held in memory while planning."""

MAX_TABLES = 1_000_000
"""Tables of one model, all entries together."""

MAX_DENSE_PARAMETERS = 2**44
"""Dense (MLP) parameters, all-reduced every step."""

MAX_DENSE_FLOPS_PER_SAMPLE = 1e15
"""Forward FLOPs per sample of the dense network."""

MAX_DENSE_FEATURES = 1_000_000
"""Dense input features of the dense arch (``dense.num_dense``)."""

MAX_LAYER_WIDTH = 1_048_576
"""Width of one layer of the dense arch (``dense.bottom``, ``dense.over``, ``dense.dcn_low_rank``)."""

MAX_LAYERS = 100
"""Layers of one MLP of the dense arch, and DCN-v2 cross layers (``dense.dcn_layers``)."""

# ---- plan.json ----------------------------------------------------------------------------------------------------
MAX_TUNING_CANDIDATES = 64
"""Candidate plans a plan.json ``tuning`` record may list."""

MAX_TUNING_ROUNDS = 1000
"""Timed runs of one candidate a plan.json ``tuning`` record may list."""

MAX_SHARDS_PER_TABLE = 100_000
"""Shards of one table in plan.json: a shard per GPU or per hash bucket of a parameter server, far fewer than this in
any cluster the planner is given; a list of 200,000 copied shards is refused before each is read."""

# ---- topology.yaml ------------------------------------------------------------------------------------------------
MAX_HOST_COUNT = 100_000
"""Hosts of one ``hosts:`` entry: every host is a graph node, so a wrong count would hang rather than fail."""

MAX_GPUS_PER_HOST = 1024
"""Trainer devices of one host: they are linked pairwise (NVLink edges), n^2 of them."""

MAX_TOPOLOGY_NODES = 200_000
"""Hosts and trainer devices of a ``hosts:`` topology, all entries together: each is a graph node, and a count that
multiplies to millions would take minutes and gigabytes to build before anything else is checked."""

MAX_TOPOLOGY_LINKS = 2_000_000
"""Links of a ``hosts:`` topology (NIC, PCIe and every pair of a host's devices), all entries together."""

MAX_MEMORY_BYTES = 2**60
"""HBM, DDR or a CPU trainer's memory of one device or host (1 EiB)."""

MAX_BANDWIDTH = 1e15
"""Any bandwidth of the topology, in bytes/s (1 PB/s, a hundred times a large switch)."""

MAX_TFLOPS = 1e6
"""Dense rate of one device, in TFLOPS (an exaflop)."""

MAX_LATENCY_S = 10.0
"""One-way latency of a link or of the network, in seconds."""

MIN_DISK_BYTES = 2**20
"""Size of a parameter server's ``ssd:`` disk, at least (1 MiB): a few blocks of rows; a smaller number is a unit
mistake (``ssd: 2`` for 2 TiB)."""

MIN_DISK_IOPS = 1.0
"""4 KiB blocks a disk reads or writes a second, at least: a ``read_iops`` near zero would price a miss at eons."""

MAX_DISK_IOPS = 1e9
"""4 KiB blocks a disk reads or writes a second, at most (4 TB/s, far past any device)."""

MIN_DISK_BYTES_PER_S = 4096.0
"""A disk's sequential rate in a hardware profile, at least (one block a second)."""

# persia train's options (checked before torch is imported).
MAX_ADAPT_THRESHOLD = 10.0
"""The largest ``--adapt-threshold``: a step ten times off its prediction is off whatever the threshold says."""
MAX_ADAPT_REPLANS = 100
"""The most re-plans of one run (``--adapt-max``): each is a checkpoint and a rebuild."""
MAX_KEEP = 1000
"""The most checkpoints a run keeps (each is a full copy of the model)."""
MAX_STEPS = 10**9
"""The most steps a run asks for (``--steps``, ``--eval-every``, ``--checkpoint-every``): a billion steps is years."""
MAX_SEED = 2**32 - 1
"""The largest ``--seed``: numpy's and the data loaders' seeds are 32-bit."""
MAX_PS_DELAY_MS = 60_000.0
"""The largest ``--ps-delay-ms`` (a minute per call): beyond, the delay stands for no network, and the delay thread's
timestamps overflow."""
MAX_LOCAL_TRAINERS = 1024
"""The most trainer processes on one machine (``--trainers``)."""
MAX_EVAL_BATCHES = 10**6
"""The most held-out batches per trainer (``--eval-batches``)."""
