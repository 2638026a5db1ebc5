"""What a cluster calibration (``persia calibrate --topology``, :mod:`.cluster_calibration`) measures and writes:
which host each torchrun process measures and its class, how much it measures, the folder of profiles, and each
class's profile made from its hosts' measurements and the cluster's.

A host class is a ``hosts:`` entry of the topology (``trainer`` for ``trainer0`` and ``trainer1`` of
``{name: trainer, count: 2}``), which a topology refuses a profile for on another entry
(:mod:`persia_planner.topology.reader`). Its profile holds the median of its hosts' own measurements, leaf by leaf,
the collectives and PS requests measured over the cluster's links, and where it was measured: ``machine:`` (the
class as ``topology_host``, the host names, when) and ``where:`` (the topology, the hosts, the links and their rates).
Nothing here imports torch: the CLI checks a world before torch is imported.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from persia_planner.errors import PlannerError
from persia_planner.fields import load_document
from persia_planner.outputs import Output, OutputKind, check_outputs, refuse_run_folder, write_output
from persia_planner.topology.graph import Topology
from persia_planner.topology.torchrun_nodes import NODE_HOST_ENV, TorchrunProcess, job_hosts, parse_host_names

if TYPE_CHECKING:
    from persia_planner.modules.tools.calibrate import Sizes

__all__ = [
    "SIZES",
    "STEP_SKIPPED",
    "CalibrationHost",
    "calibration_host",
    "class_profile",
    "host_classes",
    "host_phase_s",
    "median_of",
    "profile_outputs",
    "sizes_of",
    "write_profile",
]

STEP_SKIPPED = "run persia train jobs on the cluster with --log-dir, then persia calibrate --from-runs"
"""Why a cluster profile has no step figures (its ``step.skipped``)."""
SIZES = ("full", "quick", "tiny")
"""What ``--sizes`` may name; ``tiny`` is for tests: its figures are too rough to plan with."""
# How long one host's own benchmarks may take, by sizes: the others wait that long for each turn
_HOST_PHASE_S = {"full": 3600.0, "quick": 900.0, "tiny": 300.0}


def sizes_of(name: str, longer: float = 1.0) -> Sizes:
    """The measurements ``--sizes NAME`` makes (:data:`SIZES`), each repeated up to ``longer`` times as long."""
    from persia_planner.modules.tools.calibrate import Sizes

    if name not in SIZES:
        raise PlannerError(
            f"--sizes {name!r} is not one of {', '.join(SIZES)}", fixes=("use --quick for a first look",)
        )
    if name != "tiny":
        return Sizes.of(name == "quick").longer(longer)
    return Sizes.tiny().longer(longer)


def host_classes(topology_file: str | Path) -> dict[str, str]:
    """Each host of a topology file and its class: the ``hosts:`` entry it comes from (``trainer`` for ``trainer0``
    and ``trainer1`` of ``{name: trainer, count: 2}``); in the ``nodes:`` form every host is a class of its own.
    The file must have loaded as a topology already."""
    data, _ = load_document(topology_file, "see formats.md for the topology.yaml keys")
    classes: dict[str, str] = {}
    for entry in data.get("hosts") or []:
        name, count = str(entry["name"]), int(entry.get("count", 1))
        classes |= {f"{name}{i}": name for i in range(count)}
    for entry in data.get("nodes") or []:
        if str(entry.get("kind", "")).lower() == "host":
            classes[str(entry["name"])] = str(entry["name"])
    return classes


@dataclass(frozen=True)
class CalibrationHost:
    """This process's place in the calibration.

    Attributes:
        host: The topology host it measures.
        host_class: The host's class (its ``hosts:`` entry).
        rank: Its rank in torchrun's world (one process per host).
        world_size: The hosts measured.
    """

    host: str
    host_class: str
    rank: int
    world_size: int


def calibration_host(
    topology: Topology, classes: Mapping[str, str], process: TorchrunProcess, named: str | None = None
) -> CalibrationHost:
    """The host this torchrun process measures: the one its node names (``--node-host`` / ``PERSIA_HOST``, by local
    rank), else by rank (the job's hosts in file order, one rank each).

    Raises:
        PlannerError: The world is not one process per host, or the node's process count is not its hosts'.
    """
    hosts = job_hosts(topology)
    names = ", ".join(h.name for h in hosts)
    if process.world_size != len(hosts):
        raise PlannerError(
            f"the torchrun world has {process.world_size} processes but persia calibrate runs one per host of "
            f"topology {topology.name!r}: {len(hosts)} ({names})",
            fixes=(f"launch one torchrun per host, each with --nproc-per-node 1 and --nnodes {len(hosts)}",),
        )
    if named:
        mine = parse_host_names(named, topology)
    else:
        first = process.rank - process.local_rank
        mine = hosts[first : first + process.local_world_size]
    if process.local_world_size != len(mine) or not 0 <= process.local_rank < len(mine):
        raise PlannerError(
            f"torchrun node {process.node_rank} runs {process.local_world_size} processes (--nproc-per-node) but "
            f"names {len(mine)} hosts ({', '.join(h.name for h in mine) or 'none'}): persia calibrate runs one "
            "per host",
            fixes=("--nproc-per-node 1 per host", f"name the node's host with --node-host or {NODE_HOST_ENV}"),
        )
    host = mine[process.local_rank].name
    return CalibrationHost(host, classes.get(host, host), process.rank, process.world_size)


def profile_outputs(out_dir: Path, classes: Sequence[str], *, overwrite: bool) -> list[Output]:
    """The profiles ``--out-dir`` will hold, one per host class, checked by the output rule; the folder is made
    when missing (its parent must exist). A folder that holds anything but profiles persia wrote is refused unless
    ``overwrite`` (they are left as they are).

    Raises:
        PlannerError: One line naming the folder or file and the fix.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise PlannerError(f"--out-dir {out_dir} is not a folder", fixes=("name a folder (made if missing)",))
    bad = next((c for c in classes if Path(c).name != c or c in (".", "..") or not c.isprintable()), None)
    if bad is not None:
        raise PlannerError(f"host class {bad!r} cannot name a file in --out-dir", fixes=("rename the hosts: entry",))
    refuse_run_folder("--out-dir", out_dir)
    if out_dir.is_dir() and not overwrite:
        foreign = sorted(p.name for p in out_dir.iterdir() if not OutputKind.PROFILE.written_by_persia(p))
        if foreign:
            raise PlannerError(
                f"--out-dir {out_dir} holds {len(foreign)} file{'s' if len(foreign) > 1 else ''} that persia did not "
                f"write as a profile ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})",
                fixes=("name a new or empty folder", "pass --overwrite to write the profiles beside them"),
            )
    if not out_dir.is_dir():
        try:
            out_dir.mkdir()
        except OSError as err:
            raise PlannerError(
                f"--out-dir {out_dir} cannot be made ({err.strerror or err})",
                fixes=("name a folder in an existing, writable folder",),
            ) from None
    outputs = [Output("--out-dir", out_dir / f"{c}.yaml", OutputKind.PROFILE) for c in classes]
    check_outputs(outputs, {}, overwrite=overwrite)
    return outputs


def median_of(values: Sequence[Any]) -> Any:
    """The median of several hosts' results of one benchmark, leaf by leaf (mappings by key, lists of equal length
    item by item, numbers: their median, anything else: the first host's)."""
    first = values[0]
    if isinstance(first, Mapping):
        return {k: median_of([v[k] for v in values if isinstance(v, Mapping) and k in v]) for k in first}
    if isinstance(first, list):
        if all(isinstance(v, list) and len(v) == len(first) for v in values):
            return [median_of([v[i] for v in values]) for i in range(len(first))]
        return first
    numbers = isinstance(first, int | float) and not isinstance(first, bool)
    if numbers and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        middle = statistics.median(values)
        return first if all(v == first for v in values) else float(middle)
    return first


def class_profile(
    host_class: str, results: Sequence[Mapping[str, Any]], cluster: Mapping[str, Any], topology: str
) -> dict[str, Any]:
    """The profile of ``host_class`` (its YAML's content) from its hosts' ``results`` and the ``cluster``'s
    measurements (collectives, rpc, links, noise).

    Args:
        host_class: The class (a ``hosts:`` entry's name).
        results: Each of its hosts' own measurements: ``host``, ``machine``, ``benchmarks``, ``noise``.
        cluster: ``collectives``, ``rpc``, ``links`` (by ``"a-b"``, each ``between`` its two hosts), ``noise`` (by
            benchmark), ``collectives_hosts``, ``rpc_hosts`` and ``finished`` (when).
        topology: The topology's name.
    """
    from persia_planner.modules.tools.noise import NoiseLog, Quiet
    from persia_planner.topology.profile import PROFILE_FORMAT

    hosts = [r["host"] for r in results]
    machine = dict(results[0]["machine"])
    machine["topology_host"] = host_class
    machine["hostnames"] = sorted({str(r["machine"]["hostname"]) for r in results})
    machine["measured"] = min(str(r["machine"]["measured"]) for r in results)
    machine["measured_until"] = cluster["finished"]
    profile: dict[str, Any] = {"format": PROFILE_FORMAT, "machine": machine}
    for name in results[0]["benchmarks"]:
        profile[name] = median_of([r["benchmarks"][name] for r in results])
    profile["collectives"] = cluster["collectives"]
    profile["rpc"] = cluster["rpc"]
    profile["step"] = {"skipped": STEP_SKIPPED}
    noise = NoiseLog(Quiet(**cluster["quiet"]))
    for r in results:
        for bench, records in r["noise"].items():
            noise.extend(bench, [{**rec, "point": f"{r['host']}: {rec['point']}"} for rec in records])
    for bench, records in cluster["noise"].items():
        noise.extend(bench, records)
    profile["noise"] = noise.section()
    links = {k: v for k, v in cluster["links"].items() if set(v["between"]) & set(hosts)}
    profile["where"] = {
        "topology": topology,
        "hosts": hosts,
        "links": links,
        "collectives": cluster["collectives_hosts"],
        "rpc": cluster["rpc_hosts"],
    }
    return profile


def write_profile(out: Output, profile: Mapping[str, Any], overwrite: bool) -> None:
    """Write a class's profile (:func:`class_profile`) through the output rule, marked as persia's."""
    import yaml

    text = OutputKind.PROFILE.header("raw measurements of a host class on its cluster (persia calibrate --topology)")
    text += yaml.safe_dump(dict(profile), sort_keys=False)
    write_output(out, lambda path: path.write_text(text, encoding="utf-8"), overwrite=overwrite)


def host_phase_s(sizes_name: str, longer: float = 1.0) -> float:
    """How long one host's own benchmarks of ``--sizes NAME`` may take before the others give up on it."""
    return _HOST_PHASE_S[sizes_name] * longer
