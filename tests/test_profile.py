"""The profile's fits: a fixed cost plus a rate, recovered from points; bad profiles refused with one line."""

from __future__ import annotations

import pytest

from persia_planner.errors import SpecError
from persia_planner.topology.profile import PROFILE_FORMAT, HardwareProfile


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
