"""The profile's fits: a fixed cost plus a rate, recovered from points; bad profiles refused with one line; where it
was measured and how quietly, and a topology refusing a profile of another host or device in one line."""

from __future__ import annotations

import pytest

from persia_planner.errors import SpecError
from persia_planner.topology.profile import PROFILE_FORMAT, HardwareProfile, load_profile


def raw_profile() -> dict:
    """A profile as persia calibrate writes it, with known figures."""
    return {
        "format": PROFILE_FORMAT,
        "machine": {"cpus": 2},
        "memory": {
            "stream_bytes_per_s": 8e9,
            "gather": [{"row_bytes": b, "bytes_per_s": b / (20e-9 + b / 4e9)} for b in (64, 256, 1024)],
        },
        "embedding": [
            {
                "optimizer": opt,
                "dim": d,
                "pooling": p,
                "unique_share": u,
                "forward_rows_per_s": 1 / (200e-9 / p + 30e-9 + u * (10e-9 + 4 * d / 2e9)),
                "backward_rows_per_s": 1 / (k * 20e-9 + u * (k * 40e-9 + 4 * d / 1e9)),
            }
            for opt, k in (("sgd", 1), ("rowwise_adagrad", 2))
            for d in (16, 64)
            for p in (1, 8)
            for u in (1.0, 0.1)
        ],
        "dense": {
            "flops_per_s": 3e10,
            "width": 512,
            "batch": 2048,
            "dlrm": [
                {
                    "features": f,
                    "dim": 16,
                    "batch": b,
                    "flops_per_sample": 1e4 * f,
                    "seconds": 1e-3 + b * (2e-6 + f / 1e5),
                }
                for f in (8, 26)
                for b in (256, 2048)
            ],
        },
        "collectives": {
            "backend": "gloo",
            "processes": 2,
            "all_to_all": [{"bytes": b, "seconds": 100e-6 + b / 1e9} for b in (1024, 65536, 1 << 20)],
            "all_reduce": [{"bytes": b, "seconds": 80e-6 + b / 2e9} for b in (1024, 65536, 1 << 20)],
        },
        "rpc": {
            "dim": 16,
            "requests": [
                {"rows": r, "dim": 16, "lookup_seconds": 300e-6 + r / 5e6, "push_seconds": 250e-6 + r / 4e6}
                for r in (1, 1024, 16384)
            ],
        },
        "ps_store": {
            "dim": 16,
            "lookup_rows_per_s": 2e7,
            "admit_rows_per_s": 1e6,
            "update_rows_per_s": 1e7,
            "unique_ids_per_s": 5e7,
        },
    }


def test_profile_fits_every_engine():
    profile = HardwareProfile.from_dict(raw_profile())
    assert profile.all_to_all.fixed_s == pytest.approx(100e-6, rel=1e-6)
    assert profile.all_to_all.units_per_s == pytest.approx(1e9, rel=1e-6)
    assert profile.ps_lookup.fixed_s == pytest.approx(300e-6, rel=1e-6)
    assert profile.ps_lookup.units_per_s == pytest.approx(5e6, rel=1e-6)
    assert profile.gather.fixed_s == pytest.approx(20e-9, rel=1e-6)
    forward = profile.embedding_forward["sgd"]
    assert forward.per_bag_s == pytest.approx(200e-9, rel=1e-6) and forward.per_id_s == pytest.approx(30e-9, rel=1e-6)
    assert forward.per_row_s == pytest.approx(10e-9, rel=1e-6)
    assert forward.bytes_per_s == pytest.approx(2e9, rel=1e-6) and forward.worst_error < 1e-9
    backward = profile.embedding_backward["rowwise_adagrad"]
    assert backward.per_bag_s < 1e-15 and backward.per_id_s == pytest.approx(40e-9, rel=1e-6)
    assert backward.per_row_s == pytest.approx(80e-9, rel=1e-6)
    # forward + backward of 100 bags of 10 ids of 64 B under SGD, 300 distinct rows among the 1000 ids
    expected = 100 * 200e-9 + 1000 * (30e-9 + 20e-9) + 300 * (10e-9 + 64 / 2e9 + 40e-9 + 64 / 1e9)
    assert profile.embedding_seconds("sgd", 100, 1000, 64, 300) == pytest.approx(expected, rel=1e-6)
    # the DLRM dense step: 1 ms per step + 2 us per sample + forward FLOPs at 1 GFLOP/s
    assert profile.dense_seconds(1e5, 1000) == pytest.approx(1e-3 + 1000 * (2e-6 + 1e5 / 1e9), rel=1e-6)
    # an optimizer not measured takes the heaviest one measured
    heaviest = profile.embedding_seconds("rowwise_adagrad", 100, 1000, 64)
    assert profile.embedding_seconds("adam", 100, 1000, 64) == heaviest
    assert ("dense MLP", "30.0 GFLOP/s", "") in profile.summary()


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: d.update(format=9), "format"),
        (lambda d: d.pop("collectives"), "collectives"),
        (lambda d: d["memory"].update(stream_bytes_per_s=-1), "stream_bytes_per_s"),
        (lambda d: d["rpc"].update(requests=[]), "requests"),
        (lambda d: d["dense"].update(flop=1), "flop"),
    ],
)
def test_a_bad_profile_is_one_line_naming_the_key(edit, words):
    data = raw_profile()
    edit(data)
    with pytest.raises(SpecError) as err:
        HardwareProfile.from_dict(data, "mine.yaml")
    assert "mine.yaml" in str(err.value) and words in str(err.value) and "\n" not in str(err.value)


def test_a_measured_training_step_fits_the_step_overhead():
    raw = raw_profile()
    assert "step_overhead_ms" not in HardwareProfile.from_dict(raw).fitted_constants()
    raw["step"] = {"overhead_ms": 4.5, "ps_client_ms": 0.5, "check_error": 0.1, "jobs": {"small": {}}}
    profile = HardwareProfile.from_dict(raw)
    assert profile.fitted_constants()["step_overhead_ms"] == 4.5
    assert profile.fitted_constants()["ps_client_ms"] == 0.5  # the trainer's, in place of the RPC's round trip
    assert profile.fitted_constants()["ps_request_ms"] == pytest.approx((300e-6 + 250e-6) / 2 * 1e3)  # the server's
    assert ("training step beyond the model", "4.50 ms", "") in profile.summary()
    for key, bad in (("overhead_ms", -1.0), ("ps_client_ms", -0.1)):
        with pytest.raises(SpecError, match=f"step.{key}"):
            HardwareProfile.from_dict({**raw, "step": {**raw["step"], key: bad}})


def test_a_sharding_type_s_measured_factor_is_read_and_a_bad_one_named():
    raw = raw_profile()
    assert HardwareProfile.from_dict(raw).sharding_scale == {}
    raw["step"] = {"overhead_ms": 4.5, "sharding_scale": {"row_wise": 2.5, "data_parallel": 0.5}}
    profile = HardwareProfile.from_dict(raw)
    assert profile.sharding_scale == {"row_wise": 2.5, "data_parallel": 0.5}
    assert ("row_wise in DMP (x its modelled exchange)", "2.50", "") in profile.summary()
    for scales, words in (
        ({"row_wise": 0.0}, "step.sharding_scale.row_wise: must be > 0"),
        ({"ps_hash": 2.0}, "step.sharding_scale.ps_hash: is no sharding type of a DMP job"),
        ([2.0], "step.sharding_scale: expected a mapping"),
    ):
        with pytest.raises(SpecError) as err:
            HardwareProfile.from_dict({**raw, "step": {**raw["step"], "sharding_scale": scales}})
        assert words in str(err.value), str(err.value)


def test_the_codec_rate_is_measured_or_read_from_the_stream_rate():
    """A quantized collective's conversions: the rate persia calibrate measured, else the stream rate over the 6 bytes
    a float32 <-> float16 conversion moves (profiles written before it was measured)."""
    assert HardwareProfile.from_dict(raw_profile()).codec_values_per_s == pytest.approx(8e9 / 6)
    raw = raw_profile()
    raw["memory"]["codec_values_per_s"] = 5e8
    assert HardwareProfile.from_dict(raw).codec_values_per_s == 5e8
    raw["memory"]["codec_values_per_s"] = 0
    with pytest.raises(SpecError, match=r"memory\.codec_values_per_s"):
        HardwareProfile.from_dict(raw)


def noise_section(spread: float = 0.34) -> dict:
    """A ``noise:`` section as persia calibrate writes it: one quiet benchmark and one with a noisy point."""
    return {
        "target_spread": 0.1,
        "benchmarks": {
            "memory": {"worst_spread": 0.04, "measurements": 5, "noisy": []},
            "collectives": {
                "worst_spread": spread,
                "measurements": 8,
                "noisy": [{"point": "all_reduce 1024 B", "spread": spread, "repeats": 20}],
            },
        },
    }


def test_the_noise_section_is_read_and_a_disturbed_profile_is_marked():
    from persia_planner.topology.provenance import NoisyPoint, noisy_points

    quiet = HardwareProfile.from_dict(raw_profile())
    assert quiet.noise == {} and not quiet.noisy  # profiles written before it: no section, nothing known
    profile = HardwareProfile.from_dict({**raw_profile(), "noise": noise_section()})
    assert profile.noisy and profile.noise["benchmarks"]["memory"]["noisy"] == []
    assert noisy_points(profile.noise) == [NoisyPoint("collectives", "all_reduce 1024 B", 0.34, 20)]
    assert noisy_points(profile.noise)[0].line() == "collectives spread 34% over 20 repeats (all_reduce 1024 B)"
    rows = profile.summary()
    assert ("spread of memory (target 10%)", "4% worst", "") in rows
    assert ("spread of collectives (target 10%)", "34% worst; 1 of 8 noisy: disturbed", "") in rows
    calm = {**noise_section(), "benchmarks": {"memory": noise_section()["benchmarks"]["memory"]}}
    assert not HardwareProfile.from_dict({**raw_profile(), "noise": calm}).noisy


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda n: n["benchmarks"]["memory"].update(worst_spread=-0.1), "noise.benchmarks.memory.worst_spread"),
        (lambda n: n["benchmarks"]["collectives"]["noisy"][0].pop("repeats"), "noisy[0].repeats"),
        (lambda n: n.update(target=0.1), "noise.target"),
        (lambda n: n.pop("target_spread"), "noise.target_spread"),
    ],
)
def test_a_bad_noise_section_is_one_line_naming_the_key(edit, words):
    noise = noise_section()
    edit(noise)
    with pytest.raises(SpecError) as err:
        HardwareProfile.from_dict({**raw_profile(), "noise": noise}, "mine.yaml")
    assert str(err.value).startswith("mine.yaml: ") and words in str(err.value) and "\n" not in str(err.value)


def test_a_step_phase_that_stayed_noisy_is_read():
    raw = raw_profile()
    raw["step"] = {"overhead_ms": 4.5, "noisy": True, "reference_ms": [20.0, 26.0], "tries": 3}
    assert HardwareProfile.from_dict(raw).step_overhead_ms == 4.5


def test_the_profile_says_where_and_when_it_was_measured():
    from persia_planner.topology.provenance import Provenance

    assert HardwareProfile.from_dict(raw_profile()).provenance == Provenance()
    machine = {"cpus": 2, "hostname": "box-1", "device": "cpu", "topology_host": "trainer", "measured": "2026-01-02"}
    profile = HardwareProfile.from_dict({**raw_profile(), "machine": machine})
    assert profile.provenance == Provenance("box-1", "cpu", "trainer", "2026-01-02")
    assert ("measured on", "box-1, cpu, 2026-01-02", "") in profile.summary()
    assert ("for topology host", "trainer", "") in profile.summary()
    with pytest.raises(SpecError, match=r"^mine.yaml: machine.hostname: expected a string, got 7"):
        HardwareProfile.from_dict({**raw_profile(), "machine": {"hostname": 7}}, "mine.yaml")


GPUS = {"count": 2, "hbm": "16GiB", "hbm_bandwidth": "900GB/s", "tflops": 100, "pcie_bandwidth": "32GB/s"}


def topology_with(tmp_path, machine: dict | None, host: dict) -> str:
    """topology.yaml of ``host`` (and a server) naming a profile whose ``machine:`` section is ``machine``."""
    import yaml

    raw = raw_profile()
    if machine is not None:
        raw["machine"] = machine
    (tmp_path / "measured.yaml").write_text(yaml.safe_dump(raw))
    hosts = [
        {"name": "trainer", "count": 2, "ddr": "8GiB", "profile": "measured.yaml", **host},
        {"name": "ps", "role": "parameter_server", "ddr": "2GiB", "ddr_bandwidth": 1e10, "nic_bandwidth": 1e9},
    ]
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "hosts": hosts}))
    return str(path)


CPUS = {"cpus": {"count": 2, "memory": "4MiB"}}
FIX = "fix: run persia calibrate --host trainer on that host or pass the profile measured there"


@pytest.mark.parametrize(
    ("machine", "host", "problem"),
    [
        ({"hostname": "box-1", "topology_host": "gpu"}, CPUS, "measured on box-1 for host 'gpu', not 'trainer'"),
        ({"topology_host": "trainer2"}, CPUS, "measured for host 'trainer2', not 'trainer'"),  # trainer0, 1 only
        ({"topology_host": "trainer01"}, CPUS, "measured for host 'trainer01', not 'trainer'"),
        ({"hostname": "box-1", "device": "cpu"}, {"gpus": GPUS}, "measured on box-1 with device cpu, but host "),
        (
            {"device": "NVIDIA A100-SXM4-80GB"},
            {"gpus": {**GPUS, "device": "NVIDIA H100 80GB HBM3"}},
            "measured with device 'NVIDIA A100-SXM4-80GB', but host 'trainer' has 'NVIDIA H100 80GB HBM3'",
        ),
    ],
)
def test_a_profile_of_another_host_or_device_is_refused_in_one_line(tmp_path, machine, host, problem):
    from persia_planner import load_topology

    with pytest.raises(SpecError) as err:
        load_topology(topology_with(tmp_path, machine, host))
    line = str(err.value)
    assert "hosts[0].profile: profile measured.yaml " in line and problem in line and line.endswith(FIX), line
    assert "\n" not in line


@pytest.mark.parametrize(
    ("machine", "host"),
    [
        (None, {"gpus": GPUS}),  # an older profile: says nothing, taken
        ({"hostname": "box-1", "device": "cpu", "topology_host": "trainer"}, CPUS),
        ({"device": "cpu", "topology_host": "trainer1"}, CPUS),  # one of the hosts the entry stands for
        ({"device": "NVIDIA H100 80GB HBM3"}, {"gpus": {**GPUS, "device": "NVIDIA H100 80GB HBM3"}}),
        ({"device": "NVIDIA H100 80GB HBM3"}, {"gpus": GPUS}),  # the topology does not name its GPUs
        ({"device": "NVIDIA H100 80GB HBM3"}, CPUS),  # CPU trainers of a GPU machine: measured on its CPU
    ],
)
def test_a_profile_of_this_host_or_one_that_does_not_say_is_taken(tmp_path, machine, host):
    from persia_planner import load_topology

    topology = load_topology(topology_with(tmp_path, machine, host))
    assert topology.host("trainer0").profile is not None


def test_the_bundled_profiles_and_topologies_stay_accepted():
    from persia_planner import load_topology
    from persia_planner.paths import EXAMPLES

    for path in sorted(EXAMPLES.glob("*.yaml")):
        if "hosts:" in path.read_text():
            load_topology(path)
    for path in sorted((EXAMPLES / "profiles").glob("*.yaml")):
        assert not load_profile(path).noisy


def test_a_disturbed_profile_gives_one_warning_per_noisy_benchmark():
    from persia_planner.topology.provenance import disturbed_warnings

    noise = noise_section()
    noise["benchmarks"]["collectives"]["noisy"].append({"point": "all_to_all 1024 B", "spread": 0.2, "repeats": 20})
    noise["benchmarks"]["step"] = {
        "worst_spread": 0.3,
        "measurements": 10,
        "noisy": [{"point": "table_wise before / after", "spread": 0.3, "repeats": 3}],
    }
    fix = "re-run persia calibrate on a quiet machine"
    assert disturbed_warnings(HardwareProfile.from_dict({**raw_profile(), "noise": noise}).noise) == [
        "warning: calibration was disturbed: collectives spread 34% over 20 repeats (all_reduce 1024 B); "
        f"{fix} or pass --repeat-until-quiet",
        "warning: calibration was disturbed: step spread 30% over 3 repeats (table_wise before / after); "
        f"{fix} or pass --repeat-until-quiet",
    ]
    assert disturbed_warnings(noise, repeated_longer=True)[0].endswith(f"(all_reduce 1024 B); {fix}")
    assert disturbed_warnings({}) == []
