"""A machine's measured figures (``persia calibrate``'s profile), and the cost-model figures fitted from them.

The profile file keeps raw measurements (seconds or rates per benchmark point); this module fits the few numbers the
cost model needs (with :mod:`.fits`): a fixed time plus a rate for each engine (memory gathers, fbgemm's TBE forward
and fused backward per optimizer, gloo collectives, parameter-server requests). Fitting here, not in the benchmark,
keeps the planner torch-free and lets a profile be re-fitted without measuring again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from persia_planner.fields import Fields, load_document
from persia_planner.kinds import Sharding
from persia_planner.limits import MAX_BANDWIDTH, MAX_DISK_IOPS, MIN_DISK_BYTES_PER_S, MIN_DISK_IOPS
from persia_planner.topology.cost_constants import CostConstants, scale_name
from persia_planner.topology.fits import (
    BYTES_PER_FLOAT,
    DenseFit,
    EmbeddingFit,
    LinearFit,
    fit_dense,
    fit_embedding,
    fit_linear,
)
from persia_planner.topology.provenance import Provenance, noisy_points, provenance_rows, read_machine, read_noise
from persia_planner.topology.refit_section import read_refit
from persia_planner.units import Quantity

__all__ = [
    "PROFILE_FORMAT",
    "SCALED_SHARDINGS",
    "HardwareProfile",
    "load_profile",
]

PROFILE_FORMAT = 1


@dataclass(frozen=True)
class HardwareProfile:
    """The fitted figures of one machine (one trainer process, one CPU thread, as the runtime runs).

    Attributes:
        source: The profile file.
        machine: What was measured (platform, CPUs, library versions, date) and where (``hostname``, ``device``,
            ``topology_host``: :mod:`.provenance`).
        stream_bytes_per_s: Streaming copy bandwidth (read + write).
        gather: Random row gathers: seconds per row vs row bytes.
        embedding_forward: Per optimizer, fbgemm TBE forward (:class:`EmbeddingFit`).
        embedding_backward: Per optimizer, the fused backward (gradient + optimizer update), the same way.
        dense_flops_per_s: Dense MLP forward + backward FLOPs per second (wide layers: the peak the MLP reaches).
        dense_step: The DLRM dense network as ``persia train`` runs it (bottom MLP, pairwise interaction, top MLP,
            loss, dense optimizer), fitted over batches and sizes (narrow layers and the interaction's small
            batched products run far below the wide MLP's rate).
        all_to_all: gloo all-to-all between local processes: seconds per call vs bytes per process.
        all_reduce: gloo all-reduce, the same way.
        ps_lookup: A lookup request to a parameter server: seconds vs rows (fixed part = round trip).
        ps_push: A gradient push, the same way.
        ps_row_bytes: Bytes per row of the PS requests measured (ids + fp32 rows).
        store_lookup_rows_per_s: The server's store alone: rows found per second.
        store_update_rows_per_s: The store's optimizer updates per second.
        unique_ids_per_s: De-duplication (``torch.unique``) of request ids per second.
        step_overhead_ms: What a training step costs beyond the terms the other figures price (fitted from small
            ``persia train`` jobs, ``modules/tools/step_calibration.py``; None in a profile without the ``step``
            section).
        step_ps_client_ms: What one PS request costs a trainer inside a step (None without ``step``: the RPC's
            round trip stands for it).
        sharding_scale: Per TorchRec sharding type (its value), the factor on a placement's modelled exchange (a
            replica's whole work for ``data_parallel``) that makes TorchRec's DMP jobs of that type run as measured
            (its input and output distribution, row-wise bucketize and reduce-scatter, column-wise concat, the
            replica's all-reduce). Fitted by ``modules/tools/step_calibration.py`` against table-wise, the reference; a
            missing type is 1.0.
        measured_codec_values_per_s: float32 values converted to float16 and back per second, by one thread (a
            quantized collective's encode and decode; None in a profile that did not measure it).
        disk: The local disk the ``ssd`` tier writes to, as the store reads and writes it (``O_DIRECT``, 4 KiB
            blocks at random): ``read_iops``, ``write_iops``, and the sequential ``read_bytes_per_s`` and
            ``write_bytes_per_s`` a checkpoint streams at; empty in a profile that did not measure it.
        refit_factors: Per step term (``embedding``, ``all_to_all``, ``dense``, ``all_reduce``, ``ps``), the factor
            refitted from training runs (the ``refit:`` section, :mod:`persia_planner.cost.refit`); empty without it.
        refit_sharding_factors: Per sharding type, the factor refitted on its exchange (``refit.sharding_factors``,
            on top of ``sharding_scale``); empty without it.
        path: The file it was loaded from (None: built from data).
        noise: How quietly it was measured (the ``noise:`` section, :mod:`.provenance`): the target spread and per
            benchmark its worst spread and its noisy measurements; empty in a profile without it.
    """

    source: str
    machine: Mapping[str, Any]
    stream_bytes_per_s: float
    gather: LinearFit
    embedding_forward: Mapping[str, EmbeddingFit]
    embedding_backward: Mapping[str, EmbeddingFit]
    dense_flops_per_s: float
    dense_step: DenseFit
    all_to_all: LinearFit
    all_reduce: LinearFit
    ps_lookup: LinearFit
    ps_push: LinearFit
    ps_row_bytes: int
    store_lookup_rows_per_s: float
    store_update_rows_per_s: float
    unique_ids_per_s: float
    step_overhead_ms: float | None = None
    step_ps_client_ms: float | None = None
    sharding_scale: Mapping[str, float] = field(default_factory=dict)
    measured_codec_values_per_s: float | None = None
    disk: Mapping[str, float] = field(default_factory=dict)
    refit_factors: Mapping[str, float] = field(default_factory=dict)
    refit_sharding_factors: Mapping[str, float] = field(default_factory=dict)
    path: str | None = None
    noise: Mapping[str, Any] = field(default_factory=dict)

    @property
    def noisy(self) -> bool:
        """Whether a measurement stayed spread after its repeats (the ``noise:`` section names it): disturbed."""
        return bool(noisy_points(self.noise))

    @property
    def provenance(self) -> Provenance:
        """Where and when it was measured, and the topology host it is for (from ``machine:``)."""
        return Provenance.of(self.machine)

    @property
    def codec_values_per_s(self) -> float:
        """Values a quantized collective converts per second (one way): measured, else the stream rate over the
        6 bytes a conversion reads and writes."""
        if self.measured_codec_values_per_s is not None:
            return self.measured_codec_values_per_s
        return self.stream_bytes_per_s / (BYTES_PER_FLOAT + 2)

    def embedding_seconds(
        self, optimizer: str, bags: float, ids: float, row_bytes: float, unique: float | None = None
    ) -> float:
        """Seconds of fbgemm's forward + fused backward for ``bags`` bags of ``ids`` looked-up ids in all, of
        ``row_bytes`` each, ``unique`` of them distinct (all if None)."""
        name = optimizer if optimizer in self.embedding_forward else _nearest_optimizer(optimizer, self)
        forward, backward = self.embedding_forward[name], self.embedding_backward[name]
        return forward.seconds(bags, ids, row_bytes, unique) + backward.seconds(bags, ids, row_bytes, unique)

    def dense_seconds(self, flops_per_sample: float, samples: float) -> float:
        """Seconds of the dense network's forward, backward and optimizer step for ``samples`` samples of
        ``flops_per_sample`` forward FLOPs each."""
        return self.dense_step.seconds(flops_per_sample, samples)

    def device_figures(self, constants: CostConstants) -> dict[str, float]:
        """Defaults of a CPU trainer device on this machine, in topology.yaml's terms (``bandwidth``, ``tflops``,
        ``link_bandwidth``), declared so that the cost model's figure (declared x its efficiency constant) is
        what was measured.

        ``bandwidth`` is fitted to fbgemm's forward + fused backward of one id of a 16-wide fp32 row under row-wise
        Adagrad, divided into the bytes the cost model charges for it
        (:meth:`persia_planner.cost.analytic.CostModel.moved_bytes`).
        """
        row = max(16 * BYTES_PER_FLOAT, constants.min_access_bytes)
        moved = row * (1 + constants.update_passes) + 2 * BYTES_PER_FLOAT
        seconds = self.embedding_seconds("rowwise_adagrad", 1, 1, 16 * BYTES_PER_FLOAT)
        return {
            "bandwidth": moved / seconds / constants.hbm_efficiency,
            "tflops": self.dense_flops_per_s / 1e12 / constants.tflops_efficiency,
            "link_bandwidth": self.collective_bytes_per_s / constants.nvlink_efficiency,
        }

    def fitted_constants(self) -> dict[str, float]:
        """The cost model's constants this profile measures (see
        :class:`~persia_planner.topology.cost_constants.CostConstants`): ``collective_latency_ms`` (the all-to-all's
        fixed cost), ``ps_request_ms`` (a PS request's fixed cost to the server: the RPC's, lookup and push averaged),
        ``ps_client_ms`` (its cost to the trainer: from the training steps where measured, else the RPC's) and
        ``step_overhead_ms`` (from the training steps, where
        measured: a step beyond the model's prediction of it). The efficiencies stay assumptions: the profile's
        rates are declared through them (:meth:`device_figures`, :meth:`host_figures`)."""
        fitted = {
            "collective_latency_ms": self.all_to_all.fixed_s * 1e3,
            "ps_request_ms": (self.ps_lookup.fixed_s + self.ps_push.fixed_s) / 2 * 1e3,
        }
        rpc_ms = fitted["ps_request_ms"]
        fitted["ps_client_ms"] = rpc_ms if self.step_ps_client_ms is None else self.step_ps_client_ms
        if self.step_overhead_ms is not None:
            fitted["step_overhead_ms"] = self.step_overhead_ms
        # Refitted from runs: the factor on each step term and each sharding type's exchange (CostConstants'
        # <term>_scale, <type>_scale).
        fitted |= {scale_name(term): factor for term, factor in self.refit_factors.items()}
        fitted |= {scale_name(sharding): factor for sharding, factor in self.refit_sharding_factors.items()}
        return fitted

    @property
    def collective_bytes_per_s(self) -> float:
        """The all-to-all's byte rate (the memory stream where the size did not matter)."""
        link = self.all_to_all.units_per_s
        return link if math.isfinite(link) else self.stream_bytes_per_s

    def host_figures(self, parameter_server: bool, constants: CostConstants) -> dict[str, float]:
        """Defaults of a host of this machine in topology.yaml's terms (``ddr_bandwidth``, ``nic_bandwidth``),
        declared so that declared x efficiency is what was measured.

        A trainer: stream bandwidth, and the collectives' rate. A parameter server: its store's update rate times
        the bytes the cost model charges per row (its DDR), and the RPC rate of a row's lookup and push (its NIC).
        """
        if not parameter_server:
            return {
                "ddr_bandwidth": self.stream_bytes_per_s / constants.ddr_efficiency,
                "nic_bandwidth": self.collective_bytes_per_s / constants.nic_efficiency,
            }
        row = max(self.ps_row_bytes - 8, constants.min_access_bytes)
        moved = row * (1 + constants.update_passes) + 2 * BYTES_PER_FLOAT
        rpc_rows = self.ps_lookup.units_per_s if math.isfinite(self.ps_lookup.units_per_s) else 1e9
        # Measured on one host, a server's "NIC" is its RPC threads, which serve a row's lookup and its push one
        # after the other, not a full-duplex wire: the rate is declared per row's bytes on the busier direction
        # (CostModel.ps_bytes_per_gpu: the row and its id twice), for both requests.
        busier_row_bytes = self.ps_row_bytes + constants.id_bytes
        return {
            "ddr_bandwidth": self.store_update_rows_per_s * moved / constants.ps_efficiency,
            "nic_bandwidth": rpc_rows * busier_row_bytes / 2 / constants.nic_efficiency,
        }

    def summary(self) -> list[tuple[str, str, str]]:
        """(figure, fitted value, worst fit error) rows for people."""

        def rate(fit: LinearFit, unit: str, scale: float = 1.0) -> str:
            r = "size-independent" if math.isinf(fit.units_per_s) else f"{fit.units_per_s * scale:,.3g} {unit}"
            return f"{fit.fixed_s * 1e6:,.1f} us + {r}"

        def dense_rate(fit: DenseFit) -> str:
            flops = "" if math.isinf(fit.flops_per_s) else f" + {fit.flops_per_s / 1e9:,.3g} GFLOP/s"
            return f"{fit.per_call_s * 1e6:,.0f} us + {fit.per_sample_s * 1e9:,.0f} ns/sample{flops}"

        rows = [
            ("memory stream", f"{self.stream_bytes_per_s / 1e9:.2f} GB/s", ""),
            ("random row gather", rate(self.gather, "GB/s", 1e-9) + " per row", f"{self.gather.worst_error:.0%}"),
            ("dense MLP", f"{self.dense_flops_per_s / 1e9:.1f} GFLOP/s", ""),
            ("DLRM dense step", dense_rate(self.dense_step), f"{self.dense_step.worst_error:.0%}"),
        ]

        def tbe(fit: EmbeddingFit) -> str:
            per_byte = "" if math.isinf(fit.bytes_per_s) else f" + bytes / {fit.bytes_per_s / 1e9:,.3g} GB/s"
            return (
                f"{fit.per_bag_s * 1e9:,.0f} ns/bag + {fit.per_id_s * 1e9:,.0f} ns/id"
                f" + {fit.per_row_s * 1e9:,.0f} ns/row{per_byte}"
            )

        for name, fwd in self.embedding_forward.items():
            bwd = self.embedding_backward[name]
            rows.append((f"TBE forward, {name}", tbe(fwd), f"{fwd.worst_error:.0%}"))
            rows.append((f"TBE backward, {name}", tbe(bwd), f"{bwd.worst_error:.0%}"))
        rows += [
            ("all-to-all (gloo)", rate(self.all_to_all, "GB/s", 1e-9), f"{self.all_to_all.worst_error:.0%}"),
            ("all-reduce (gloo)", rate(self.all_reduce, "GB/s", 1e-9), f"{self.all_reduce.worst_error:.0%}"),
            ("PS lookup (rpc)", rate(self.ps_lookup, "rows/s"), f"{self.ps_lookup.worst_error:.0%}"),
            ("PS push (rpc)", rate(self.ps_push, "rows/s"), f"{self.ps_push.worst_error:.0%}"),
            ("PS store lookup", f"{self.store_lookup_rows_per_s:,.3g} rows/s", ""),
            ("PS store update", f"{self.store_update_rows_per_s:,.3g} rows/s", ""),
            ("id de-duplication", f"{self.unique_ids_per_s:,.3g} ids/s", ""),
            ("fp32 <-> fp16 conversion", f"{self.codec_values_per_s:,.3g} values/s", ""),
        ]
        if self.step_overhead_ms is not None:
            rows.append(("training step beyond the model", f"{self.step_overhead_ms:.2f} ms", ""))
        if self.step_ps_client_ms is not None:
            rows.append(("PS request in a step (trainer)", f"{self.step_ps_client_ms:.2f} ms", ""))
        for name, scale in self.sharding_scale.items():
            rows.append((f"{name} in DMP (x its modelled exchange)", f"{scale:.2f}", ""))
        if d := self.disk:  # the ssd tier's: 4 KiB blocks read / written at random, then sequential
            mb = f"{d['read_bytes_per_s'] / 1e6:,.0f} / {d['write_bytes_per_s'] / 1e6:,.0f} MB/s"
            rows.append(("disk (O_DIRECT)", f"{d['read_iops']:,.0f} / {d['write_iops']:,.0f} IOPS; {mb}", ""))
        return rows + provenance_rows(self.machine, self.noise)

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile.yaml") -> HardwareProfile:
        """Fit a profile's raw measurements (the YAML ``persia calibrate`` writes).

        Raises:
            SpecError: A missing section or field, a wrong format version, a non-positive measurement.
        """
        top = Fields(data, source, "")
        version = top.take("format", Quantity.COUNT)
        if version != PROFILE_FORMAT:
            raise top.error(
                "format", f"profile format {version} is not {PROFILE_FORMAT}", fixes=("run persia calibrate again",)
            )
        machine = read_machine(top)
        mem = top.sub("memory")
        stream = mem.take_positive("stream_bytes_per_s", Quantity.NUMBER)
        codec = mem.take_positive("codec_values_per_s", Quantity.NUMBER) if mem.has("codec_values_per_s") else None
        gather = _fit_points(mem, "gather", "row_bytes", lambda p: p["row_bytes"] / p["bytes_per_s"])
        mem.finish()
        forward, backward = _embedding_fits(top)
        flops, dense_step = _dense_fits(top)
        coll = top.sub("collectives")
        for key in ("backend", "processes"):
            coll.take(key, default=None)
        a2a = _fit_points(coll, "all_to_all", "bytes", lambda p: p["seconds"])
        allreduce = _fit_points(coll, "all_reduce", "bytes", lambda p: p["seconds"])
        coll.finish()
        rpc = top.sub("rpc")
        dim = rpc.take_positive("dim", Quantity.COUNT)
        requests = _points(rpc, "requests", ("rows", "dim", "lookup_seconds", "push_seconds"))
        rows = [p["rows"] for p in requests]
        lookup = _fitted(rpc, "requests", lambda: fit_linear(rows, [p["lookup_seconds"] for p in requests]))
        push = _fitted(rpc, "requests", lambda: fit_linear(rows, [p["push_seconds"] for p in requests]))
        rpc.finish()
        store = top.sub("ps_store")
        store.take("dim", default=None)
        figures = {
            k: store.take_positive(k, Quantity.NUMBER)
            for k in ("lookup_rows_per_s", "admit_rows_per_s", "update_rows_per_s", "unique_ids_per_s")
        }
        store.finish()
        overhead, request, scales = _step_figures(top) if top.has("step") else (None, None, {})
        disk = {}
        if (section := top.sub("disk", default=None)) is not None:
            again = ("run persia calibrate again",)
            disk = {k: section.take_in_range(k, Quantity.NUMBER, *in_range, fixes=again) for k, in_range in DISKS}
            section.take("path", default=None)
            section.finish()
        refit, refit_shardings = read_refit(top) if top.has("refit") else ({}, {})
        noise = read_noise(top)
        top.take("where", default=None)  # the cluster and links a cluster calibration measured: kept in the file
        top.finish()
        return cls(
            source=source,
            machine=machine,
            stream_bytes_per_s=stream,
            gather=gather,
            embedding_forward=forward,
            embedding_backward=backward,
            dense_flops_per_s=flops,
            dense_step=dense_step,
            all_to_all=a2a,
            all_reduce=allreduce,
            ps_lookup=lookup,
            ps_push=push,
            ps_row_bytes=8 + dim * BYTES_PER_FLOAT,
            store_lookup_rows_per_s=figures["lookup_rows_per_s"],
            store_update_rows_per_s=figures["update_rows_per_s"],
            unique_ids_per_s=figures["unique_ids_per_s"],
            step_overhead_ms=overhead,
            step_ps_client_ms=request,
            sharding_scale=scales,
            measured_codec_values_per_s=codec,
            disk=disk,
            refit_factors=refit,
            refit_sharding_factors=refit_shardings,
            noise=noise,
        )


DISK_FIGURES = {  # HardwareProfile.disk: each figure and its range
    "read_iops": (MIN_DISK_IOPS, MAX_DISK_IOPS),
    "write_iops": (MIN_DISK_IOPS, MAX_DISK_IOPS),
    "read_bytes_per_s": (MIN_DISK_BYTES_PER_S, MAX_BANDWIDTH),
    "write_bytes_per_s": (MIN_DISK_BYTES_PER_S, MAX_BANDWIDTH),
}
DISKS = tuple(DISK_FIGURES.items())


def _embedding_fits(top: Fields) -> tuple[dict[str, EmbeddingFit], dict[str, EmbeddingFit]]:
    """The ``embedding`` section: the forward and backward fits of each optimizer's fbgemm kernels."""
    forward: dict[str, EmbeddingFit] = {}
    backward: dict[str, EmbeddingFit] = {}
    points = _points(
        top,
        "embedding",
        ("optimizer", "dim", "pooling", "forward_rows_per_s", "backward_rows_per_s"),
        optional=("unique_share", "rows"),
    )
    for name in dict.fromkeys(p["optimizer"] for p in points):
        mine = [p for p in points if p["optimizer"] == name]
        forward[name] = _fitted(top, "embedding", lambda mine=mine: fit_embedding(mine, "forward_rows_per_s"))
        backward[name] = _fitted(top, "embedding", lambda mine=mine: fit_embedding(mine, "backward_rows_per_s"))
    return forward, backward


def _dense_fits(top: Fields) -> tuple[float, DenseFit]:
    """The ``dense`` section: the wide MLP's flop rate and the DLRM dense step's fit."""
    dense = top.sub("dense")
    flops = dense.take_positive("flops_per_s", Quantity.NUMBER)
    dlrm = dense.take("dlrm", default=None)
    if dlrm is None:  # profiles of the first format revision: the wide MLP's rate for the whole network
        dense_step = DenseFit(0.0, 0.0, flops / 3)
    else:
        measured = _points(dense, "dlrm", ("features", "dim", "batch", "flops_per_sample", "seconds"))
        dense_step = _fitted(dense, "dlrm", lambda: fit_dense(measured))
    for key in ("width", "batch"):  # what was measured: kept in the file, not needed by the fit
        dense.take(key, default=None)
    dense.finish()
    return flops, dense_step


def _step_figures(top: Fields) -> tuple[float | None, float | None, dict[str, float]]:
    """The ``step`` section: the step overhead, a PS request's cost to the trainer and the sharding scales (none
    where the phase was not run: ``skipped:`` says why)."""
    step = top.sub("step")
    if step.has("skipped"):
        step.take_str("skipped")
        step.finish()
        return None, None, {}
    overhead = step.take("overhead_ms", Quantity.NUMBER)
    request = step.take("ps_client_ms", Quantity.NUMBER, default=None)
    for key, value in (("overhead_ms", overhead), ("ps_client_ms", request)):
        if value is not None and value < 0:
            raise step.error(key, f"must be >= 0, got {value}", fixes=("run persia calibrate again",))
    scales = _sharding_scales(step)
    for key in ("check_error", "jobs", "noisy", "reference_ms", "tries"):  # measured: kept, not needed by the fit
        step.take(key, default=None)
    step.finish()
    return overhead, request, scales


# The sharding types a DMP job can be calibrated for: TorchRec's (the servers' hash sharding is priced by its requests).
SCALED_SHARDINGS = tuple(s.value for s in Sharding if s is not Sharding.PS_HASH)


def _sharding_scales(step: Fields) -> dict[str, float]:
    """``step.sharding_scale``: a positive factor per TorchRec sharding type (absent: none measured)."""
    section = step.sub("sharding_scale", default=None)
    if section is None:
        return {}
    names = section.names()
    for name in names:
        if name not in SCALED_SHARDINGS:
            known = ", ".join(SCALED_SHARDINGS)
            raise section.error(name, "is no sharding type of a DMP job", fixes=(f"use one of {known}",))
    scales = {str(name): float(section.take_positive(name, Quantity.NUMBER)) for name in names}
    section.finish()
    return scales


def _nearest_optimizer(optimizer: str, profile: HardwareProfile) -> str:
    # Adagrad-like optimizers move the most state: use the heaviest measured one rather than the lightest.
    for name in ("adagrad", "rowwise_adagrad", "sgd"):
        if name in profile.embedding_forward:
            return name
    return next(iter(profile.embedding_forward))


def _points(section: Fields, key: str, names: tuple[str, ...], optional: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """A non-empty list of points, each with ``names`` (and those of ``optional`` it has); numbers > 0 (except the
    ``optimizer`` name)."""
    out = []
    for _, item in section.take_list(key):
        point = {n: item.take_str(n) if n == "optimizer" else item.take_positive(n, Quantity.NUMBER) for n in names}
        for n in optional:
            value = item.take(n, Quantity.NUMBER, default=None)
            if value is not None:
                point[n] = value
        item.finish()
        out.append(point)
    if not out:
        raise section.error(key, "has no measurements", fixes=("run persia calibrate again",))
    return out


def _fit_points(section: Fields, key: str, x: str, seconds: Any) -> LinearFit:
    names = ("row_bytes", "bytes_per_s") if x == "row_bytes" else ("bytes", "seconds")
    points = _points(section, key, names)
    return _fitted(section, key, lambda: fit_linear([p[x] for p in points], [seconds(p) for p in points]))


def _fitted(section: Fields, key: str, fit: Any) -> Any:
    """``fit()``, or the one-line error at ``key`` where its measurements fit no positive rate (values at the edge of
    what a float holds, such as 1e-320 bytes/s, overflow the fit)."""
    with np.errstate(all="ignore"):
        try:
            found = fit()
        except (ValueError, ZeroDivisionError, OverflowError, np.linalg.LinAlgError):
            found = None
    values = [v for v in vars(found).values() if isinstance(v, float)] if found is not None else []
    if found is None or any(math.isnan(v) for v in values):
        raise section.error(
            key,
            "the measurements fit no positive rate (are they zero, or beyond what a float holds?)",
            fixes=("run persia calibrate again",),
        )
    return found


def load_profile(path: str | Path) -> HardwareProfile:
    """Load and fit a profile file.

    Raises:
        SpecError: The file is missing, malformed or not a profile (the message names the file and key).
    """
    data, source = load_document(path, f"run persia calibrate --out {path}")
    profile = HardwareProfile.from_dict(data, Path(source).name)
    return dataclasses.replace(profile, path=str(Path(source).absolute()))
