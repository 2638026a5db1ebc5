"""``persia size``: the cheapest cluster of a catalog that trains a model at a target speed (see
:mod:`persia_planner.sizing`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from persia_planner.cli.app import EXIT_BAD_INPUT, Exit, edge, make_console, note, print_error
from persia_planner.cli.run_options import StalenessOption
from persia_planner.outputs import (
    PICTURE_METADATA,
    Output,
    OutputKind,
    check_outputs,
    output_folder,
    remove_made_folder,
    write_output,
)

if TYPE_CHECKING:
    from persia_planner.model.specs import ModelSpec
    from persia_planner.sizing import Catalog, Sizing

__all__ = ["size_command"]

SIZING_FORMAT = "persia-sizing/1"


def size_command(
    model: Annotated[Path, typer.Argument(metavar="MODEL", help="model.yaml")],
    catalog: Annotated[Path, typer.Argument(metavar="CATALOG", help="catalog.yaml: the classes a cluster is made of")],
    target: Annotated[
        float,
        typer.Option("--target-samples-per-s", min=0.0, help="the training speed to reach (global samples per second)"),
    ],
    staleness: StalenessOption = None,
    max_hosts: Annotated[
        int, typer.Option("--max-hosts", min=1, max=100_000, help="at most this many hosts, trainers and servers")
    ] = 64,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="write topology.yaml, plan.json, frontier.png and sizing.json into this folder"
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="seed of each plan's search")] = 0,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="replace output files of the same kinds that persia wrote before")
    ] = False,
) -> None:
    """Find the cheapest cluster of CATALOG's classes whose best plan of MODEL reaches the target speed; print the
    cost / throughput frontier and why cheaper shapes fail."""
    with edge():
        if not target > 0:
            raise Exit(print_error("--target-samples-per-s must be above 0; fix: give the speed to reach", 2))
        made = out is not None and output_folder("--out", out)
        try:
            _size(model, catalog, target, staleness, max_hosts, out, seed, overwrite)
        finally:
            if made:
                remove_made_folder(out)  # type: ignore[arg-type]  # only where nothing was written into it


def _size(
    model: Path,
    catalog: Path,
    target: float,
    staleness: int | None,
    max_hosts: int,
    out: Path | None,
    seed: int,
    overwrite: bool,
) -> None:
    from persia_planner import load_model
    from persia_planner.model.specs import with_run_options
    from persia_planner.sizing import load_catalog, size

    outputs: list[Output] = []
    if out is not None:
        outputs = [
            Output("--out", out / "topology.yaml", OutputKind.TOPOLOGY),
            Output("--out", out / "plan.json", OutputKind.PLAN),
            Output("--out", out / "frontier.png", OutputKind.PICTURE),
            Output("--out", out / "sizing.json", OutputKind.SIZING),
        ]
        check_outputs(outputs, {"MODEL": model, "CATALOG": catalog}, overwrite=overwrite)
    spec = with_run_options(load_model(model), staleness=staleness)
    hardware = load_catalog(catalog)
    console = make_console()
    with console.status("sizing") as status:

        def progress(verdict) -> None:
            status.update(f"sizing: {verdict.shape.describe()} ({verdict.shape.price_per_hour:,.2f}/h)")

        sizing = size(spec, hardware, target, max_hosts=max_hosts, seed=seed, on_shape=progress)
    _print(sizing, spec, hardware, console)
    if sizing.chosen is None:
        raise Exit(print_error(_nothing_meets(sizing, hardware, max_hosts), EXIT_BAD_INPUT))
    if out is not None:
        _write(sizing, spec, hardware, out, outputs, overwrite)
        for written in outputs:
            note(f"wrote {written.path}", to_stderr=False)


def _print(sizing: Sizing, model: ModelSpec, catalog: Catalog, console) -> None:
    from rich.table import Table

    from persia_planner.sizing import dearest_short, frontier_rows

    table = Table(title=f"cost / throughput frontier ({sizing.target_samples_per_s:,.0f} samples/s wanted)")
    for column in ("shape", "price", "samples/s", "verdict"):
        table.add_column(column, justify="right" if column in ("price", "samples/s") else "left")
    for row in frontier_rows(sizing, catalog.currency):
        table.add_row(*(str(row[c]) for c in ("shape", "price", "samples/s", "verdict")))
    console.print(table)
    failures = sizing.failures()
    if failures:
        cheaper = "cheaper shapes" if sizing.chosen is not None else "shapes"
        console.print(
            f"{sum(failures.values())} {cheaper} fail: "
            + ", ".join(f"{resource.value} {n}" for resource, n in sorted(failures.items(), key=lambda kv: -kv[1]))
        )
        for verdict in _examples(sizing):
            console.print(f"  {verdict.shape.describe()} ({verdict.shape.price_per_hour:,.2f}/h): {verdict.why}")
        short = dearest_short(sizing)
        if short is not None:
            shape, why = short
            console.print(f"  {shape.describe()} ({shape.price_per_hour:,.2f}/h): {why}")
    console.print(
        f"looked at {len(sizing.verdicts)} of {sizing.shapes} shapes ({sizing.bounds} bounds, {sizing.plans} plans) "
        f"in {sizing.seconds:.1f} s"
    )
    if sizing.chosen is not None:
        chosen = sizing.chosen
        console.print(
            f"cheapest: {chosen.shape.describe()}, {chosen.shape.price_per_hour:,.2f} {catalog.currency}/h: "
            f"{chosen.why}"
        )


def _examples(sizing: Sizing, per_resource: int = 2):
    """The dearest failing shapes below the chosen one, a few per resource: the ones closest to being enough."""
    limit = sizing.chosen.shape.price_per_hour if sizing.chosen is not None else float("inf")
    failing = [v for v in sizing.verdicts if not v.meets and v.shape.price_per_hour < limit]
    shown: dict[Any, int] = {}
    for verdict in sorted(failing, key=lambda v: -v.shape.price_per_hour):
        if shown.get(verdict.resource, 0) < per_resource:
            shown[verdict.resource] = shown.get(verdict.resource, 0) + 1
            yield verdict


def _nothing_meets(sizing: Sizing, catalog: Catalog, max_hosts: int) -> str:
    """The one line of a sizing that found nothing: the fastest shape seen and what binds it."""
    from persia_planner.sizing import Resource

    target = f"{sizing.target_samples_per_s:,.0f} samples/s"
    fixes = "fix: raise --max-hosts, add faster classes to the catalog, or lower --target-samples-per-s"
    rated = [v for v in sizing.verdicts if v.best_known is not None]
    if not rated:
        failures = sizing.failures()
        if set(failures) == {Resource.CONSTRAINTS}:
            return f"no shape of {catalog.source} keeps the tables' constraints: {sizing.verdicts[0].why}"
        if set(failures) <= {Resource.MEMORY}:
            return (
                f"no shape of {catalog.source} with at most {max_hosts} hosts holds the model (memory binds: it needs "
                f"more trainer or server memory than {max_hosts} hosts of these classes have); "
                "fix: raise --max-hosts or add classes with more memory"
            )
        return f"no shape of {catalog.source} with at most {max_hosts} hosts reaches {target}; {fixes}"
    best = max(rated, key=lambda v: v.best_known or 0.0)
    reach = (
        f"reaches {best.samples_per_s:,.0f}"
        if best.samples_per_s is not None
        else (f"reaches at most {best.ceiling_samples_per_s:,.0f}")
    )
    return (
        f"no shape of {catalog.source} with at most {max_hosts} hosts reaches {target}: the fastest, "
        f"{best.shape.describe()}, {reach} ({best.resource.value if best.resource else 'plan'} binds: {best.why}); "
        f"{fixes}"
    )


def _write(
    sizing: Sizing, model: ModelSpec, catalog: Catalog, out: Path, outputs: list[Output], overwrite: bool
) -> None:
    import yaml

    from persia_planner.sizing import as_dict, draw_frontier

    chosen, plan = sizing.chosen, sizing.plan
    assert chosen is not None and plan is not None
    by_kind = {o.kind: o for o in outputs}
    topology = chosen.shape.topology_dict(catalog, out_dir=out.resolve())
    header = OutputKind.TOPOLOGY.header(
        f"the cheapest cluster of {catalog.source} for {model.name} at {sizing.target_samples_per_s:,.0f} samples/s"
    )
    text = header + f"# {chosen.shape.price_per_hour:,.2f} {catalog.currency}/h; {chosen.why}\n"
    text += yaml.safe_dump(topology, sort_keys=False)
    write_output(by_kind[OutputKind.TOPOLOGY], lambda p: p.write_text(text, encoding="utf-8"), overwrite=overwrite)
    plan_text = plan.to_json() + "\n"
    write_output(by_kind[OutputKind.PLAN], lambda p: p.write_text(plan_text, encoding="utf-8"), overwrite=overwrite)
    import matplotlib

    matplotlib.use("Agg")
    figure = draw_frontier(sizing, catalog.currency, f"{model.name}: cheapest shapes of {catalog.name}")

    def save(path: Path) -> None:
        figure.savefig(path, dpi=110, bbox_inches="tight", format="png", metadata=PICTURE_METADATA)

    write_output(by_kind[OutputKind.PICTURE], save, overwrite=overwrite)
    record = {
        "format": SIZING_FORMAT,
        "model": model.name,
        "catalog": catalog.name,
        "currency": catalog.currency,
        "target_samples_per_s": sizing.target_samples_per_s,
        "chosen": as_dict(chosen),
        "failures": {r.value: n for r, n in sizing.failures().items()},
        "shapes": sizing.shapes,
        "bounds": sizing.bounds,
        "plans": sizing.plans,
        "seconds": round(sizing.seconds, 3),
        "verdicts": [as_dict(v) for v in sizing.verdicts],
    }
    body = json.dumps(record, indent=1) + "\n"
    write_output(by_kind[OutputKind.SIZING], lambda p: p.write_text(body, encoding="utf-8"), overwrite=overwrite)
