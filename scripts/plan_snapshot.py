"""The search's behaviour as files: the plan.json of a fixed set of inputs, for a byte comparison of two trees.

A refactoring that must not change what the planner does runs this on the tree before and after it and compares
the folders (``diff -r``): 13 inputs (the bundled examples, the 100T model, random, heterogeneous and nearly full
clusters) planned with 2 seeds each.

Usage: ``python scripts/plan_snapshot.py OUT_DIR`` (the planner of the ``persia_planner`` on ``sys.path``: run it with
``PYTHONPATH=<other checkout>`` for another tree).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import persia_planner
from persia_planner import load_model, load_topology, plan, synthetic

SEEDS = (0, 1)


def cases() -> dict[str, tuple[object, object]]:
    """The inputs by name: (model, topology)."""
    examples = Path(persia_planner.__file__).parent / "examples"
    found: dict[str, tuple[object, object]] = {
        "small_local": (load_model(examples / "dlrm_small.yaml"), load_topology(examples / "local_2x1.yaml")),
        "small_cluster": (load_model(examples / "dlrm_small.yaml"), load_topology(examples / "cluster_2x4_2ps.yaml")),
        "criteo_cluster": (load_model(examples / "dlrm_criteo.yaml"), load_topology(examples / "cluster_2x4_2ps.yaml")),
        "100t": (load_model(examples / "persia_100t.yaml"), load_topology(examples / "persia_100t_cluster.yaml")),
    }
    for seed in range(4):
        topology = synthetic.random_topology(trainers=2 + seed, servers=2 * seed)
        found[f"random{seed}"] = (synthetic.random_model(60, seed=seed), topology)
    for seed in range(3):
        found[f"hetero{seed}"] = (synthetic.random_model(30, seed=100 + seed), synthetic.heterogeneous_topology(seed))
    for fill in (1.5, 3.0):
        model = synthetic.random_model(25, seed=7)
        found[f"full{fill}"] = (model, synthetic.nearly_full_topology(model, fill))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="a new folder for the plans (never one that exists)")
    out = parser.parse_args(argv).out_dir
    try:
        out.mkdir(parents=True)  # a new folder: the plans never replace files of another run or of the user
    except FileExistsError:
        print(f"error: {out} exists; fix: name a new folder", file=sys.stderr)
        return 2
    inputs = cases()
    for name, (model, topology) in inputs.items():
        for seed in SEEDS:
            (out / f"{name}-{seed}.json").write_text(plan(model, topology, seed=seed).to_json())  # type: ignore[arg-type]
    print(f"{len(inputs) * len(SEEDS)} plans in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
