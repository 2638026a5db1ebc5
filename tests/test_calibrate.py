"""persia calibrate: every microbenchmark runs and gives a profile the planner fits; bad --out is one line."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from persia_planner.cli import app
from persia_planner.topology.profile import HardwareProfile

TINY = dict(
    memory_bytes=4 * 1024**2,
    row_bytes=(64, 256),
    dims=(16, 32),
    poolings=(1, 4),
    optimizers=("sgd", "rowwise_adagrad"),
    message_bytes=(1024, 65536),
    rpc_rows=(1, 256),
    repeats=2,
    batch=256,
    dlrm_shapes=((4, 16), (8, 16)),
    dlrm_batches=(64, 256),
    step_steps=8,
)


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_every_benchmark_gives_figures_the_planner_fits():
    from persia_planner.modules.tools.calibrate import PHASES, Sizes, calibrate

    done = []
    raw = calibrate(sizes=Sizes(**TINY), on_done=lambda name, s: done.append(name))
    assert done == list(PHASES)
    assert raw["machine"]["cpus"] >= 1 and raw["machine"]["torch"]
    # optimizers x dims x (a table out of the caches, one in them) x poolings
    assert len(raw["embedding"]) == 2 * 2 * 2 * 2 and len(raw["collectives"]["all_to_all"]) == 2
    hot = [p for p in raw["embedding"] if p["rows"] == 1024]
    assert len(hot) == 8 and all(0 < p["unique_share"] < 1 for p in hot)  # ids repeat in the small table
    assert len(raw["dense"]["dlrm"]) == 2 * 2
    assert raw["memory"]["codec_values_per_s"] > 1e6  # float32 <-> float16, measured (a few 1e8 a second here)
    profile = HardwareProfile.from_dict(raw)
    figures = [
        profile.stream_bytes_per_s,
        profile.dense_flops_per_s,
        profile.store_update_rows_per_s,
        profile.unique_ids_per_s,
        profile.all_to_all.seconds(1e6),
        profile.ps_lookup.seconds(1000),
        profile.embedding_seconds("rowwise_adagrad", 256, 1024, 64),
        profile.embedding_seconds("rowwise_adagrad", 256, 1024, 64, 100),
        profile.dense_seconds(30_000, 512),
    ]
    assert all(math.isfinite(f) and f > 0 for f in figures), figures
    assert set(profile.embedding_forward) == {"sgd", "rowwise_adagrad"}
    # the small training jobs: their steps against the model's predictions, and what the fit takes from them
    from persia_planner.modules.tools.step_calibration import SHARDING_JOBS, STEP_JOBS

    step = raw["step"]
    assert set(step["jobs"]) == set(STEP_JOBS) == {"large", "ps", "table_wise", *SHARDING_JOBS}
    assert all(j["measured_ms"] > 0 and j["predicted_ms"] > 0 for j in step["jobs"].values())
    assert step["overhead_ms"] >= 0 and step["ps_client_ms"] >= 0 and step["check_error"] > -1
    fitted = profile.fitted_constants()
    assert fitted["step_overhead_ms"] == step["overhead_ms"] and fitted["ps_client_ms"] == step["ps_client_ms"]
    # a factor per TorchRec sharding type but the reference's, each within the range a fit may reach
    assert set(step["sharding_scale"]) == set(SHARDING_JOBS)
    assert all(0.05 <= f <= 100.0 for f in step["sharding_scale"].values())
    assert profile.sharding_scale == step["sharding_scale"]


def test_out_must_be_a_file(tmp_path):
    result = CliRunner().invoke(app, ["calibrate", "--quick", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert (
        result.output
        == f"error: --out {tmp_path} is a folder; fix: name a file in it, e.g. {tmp_path / 'profile.yaml'}\n"
    )
