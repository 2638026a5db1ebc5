"""The ``persia`` command: a thin shell over the Python API (parse arguments, call, print).

Exit codes: 0 success; 1 ``persia validate`` found an invalid plan; 2 bad input (a missing or malformed file, an
unknown key or unit, a model that cannot fit, a bad argument): one line ``error: <message>`` on stderr, never a
traceback; 3 an internal error (a bug: please report it; ``PERSIA_DEBUG=1`` shows the traceback); 130 / 143
interrupted by SIGINT (Ctrl-C) / SIGTERM (``128 + signum``, as a shell reports a signal; ``persia train`` stops its
workers first and says so in its ``error:`` line).

Nothing here imports torch, and matplotlib is imported only by ``--png`` (``persia plan``, ``persia topology``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from persia_planner.cli.app import (
    EXIT_BAD_INPUT,
    EXIT_INVALID_PLAN,
    Exit,
    app,
    edge,
    main,
    make_console,
    note,
    print_error,
)
from persia_planner.cli.data import data_app
from persia_planner.cli.predict import predict_command
from persia_planner.cli.run_options import ModelOption, PsWireOption, QCommsOption, StalenessOption, TopologyOption
from persia_planner.cli.size import size_command
from persia_planner.cli.train import train_command
from persia_planner.errors import PlannerError
from persia_planner.outputs import PICTURE_METADATA, Output, OutputKind, check_outputs, write_output

if TYPE_CHECKING:
    from persia_planner.model.specs import ModelSpec
    from persia_planner.plan.plan import Plan
    from persia_planner.topology.graph import Topology

__all__ = ["app", "main"]

OverwriteOption = Annotated[
    bool, typer.Option("--overwrite", help="replace an output file of the same kind that persia wrote before")
]


def _given_once(argument: str, positional: Path | None, option: str, named: Path | None) -> Path | None:
    """The file given as ``argument`` or as ``option`` (None: neither); both is a mistake, said in one line."""
    if positional is not None and named is not None:
        raise Exit(print_error(f"{argument} and {option} both given; fix: give the file once", EXIT_BAD_INPUT))
    return positional if positional is not None else named


@app.command("plan")
def plan_command(
    model: Annotated[
        Path | None, typer.Argument(metavar="MODEL", help="model.yaml (default: the bundled DLRM example)")
    ] = None,
    topology: Annotated[
        Path | None, typer.Argument(metavar="TOPOLOGY", help="topology.yaml (default: the bundled 2x4 cluster)")
    ] = None,
    model_file: ModelOption = None,
    topology_file: TopologyOption = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="write plan.json here (atomically)")] = None,
    explain: Annotated[bool, typer.Option("--explain", help="say why the largest tables went where they did")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print only the plan.json content on stdout")] = False,
    seed: Annotated[int, typer.Option("--seed", min=0, help="seed of the search's tie-breaking")] = 0,
    png: Annotated[
        Path | None, typer.Option("--png", help="draw the placement into this PNG file (each table on its devices)")
    ] = None,
    staleness: StalenessOption = None,
    ps_wire: PsWireOption = None,
    qcomms: QCommsOption = None,
    tune: Annotated[
        bool,
        typer.Option(
            "--tune",
            help="run the plan, its best alternatives and TorchRec's planner's plan on this machine (synthetic "
            "data, the topology's trainers and servers), and keep the fastest measured",
        ),
    ] = False,
    tune_budget: Annotated[
        float, typer.Option("--tune-budget", min=1.0, help="seconds --tune may run candidates for (at least a round)")
    ] = 120.0,
    tune_steps: Annotated[int, typer.Option("--tune-steps", min=5, help="training steps of each timed run")] = 40,
    tune_candidates: Annotated[
        int, typer.Option("--tune-candidates", min=1, help="plans of our search --tune runs (TorchRec's on top)")
    ] = 3,
    overwrite: OverwriteOption = False,
) -> None:
    """Place every table of MODEL on TOPOLOGY; print the per-device and per-table reports and the estimate."""
    from persia_planner import load_model, load_topology
    from persia_planner import plan as make_plan
    from persia_planner.model.specs import with_run_options
    from persia_planner.paths import EXAMPLE_MODEL, EXAMPLE_TOPOLOGY
    from persia_planner.plan.validation import require_valid

    with edge():
        # The arguments, or --model / --topology as persia train takes them: each file once.
        model = _given_once("MODEL", model, "--model", model_file)
        topology = _given_once("TOPOLOGY", topology, "--topology", topology_file)
        if (model is None) != (topology is None):
            raise Exit(
                print_error(
                    "give both MODEL and TOPOLOGY (or --model and --topology), or neither to plan the bundled "
                    "example; fix: persia plan model.yaml topology.yaml",
                    EXIT_BAD_INPUT,
                )
            )
        if model is None or topology is None:
            model, topology = EXAMPLE_MODEL, EXAMPLE_TOPOLOGY
            note(
                f"no files given: planning the bundled example {EXAMPLE_MODEL.name} on {EXAMPLE_TOPOLOGY.name}",
                to_stderr=as_json,
            )
        plan_out = Output("--out", out, OutputKind.PLAN) if out is not None else None
        picture = Output("--png", png, OutputKind.PICTURE) if png is not None else None
        check_outputs([plan_out, picture], {"MODEL": model, "TOPOLOGY": topology}, overwrite=overwrite)
        model_spec = with_run_options(load_model(model), staleness=staleness, ps_wire=ps_wire, qcomms=qcomms)
        topo = load_topology(topology)
        # Only --explain prints the alternatives: without it, the search need not score them.
        result = make_plan(model_spec, topo, seed=seed, **({} if explain else {"explain_top": 0}))
        # The model as planned (its qcomms decided): the checks and reports below price with it, as the search did.
        model_spec = result.priced_model(model_spec)
        require_valid(result, model_spec, topo)
        if tune:
            result = _tuned(result, model_spec, topo, seed, tune_budget, tune_steps, tune_candidates)
            require_valid(result, model_spec, topo)
        if plan_out is not None:
            text = result.to_json() + "\n"
            write_output(plan_out, lambda path: path.write_text(text, encoding="utf-8"), overwrite=overwrite)
        if picture is not None:
            _write_picture(picture, topo, result, overwrite=overwrite)
        if as_json:
            typer.echo(result.to_json())
            for written in (out, png):
                if written is not None:
                    note(f"wrote {written}", to_stderr=True)
            return
        from persia_planner import report

        console = make_console()
        report.print_plan(result, model_spec, topo, console, explain=explain)
        for written in (out, png):
            if written is not None:
                note(f"wrote {written}", to_stderr=False)


def _tuned(
    searched: Plan, model: ModelSpec, topo: Topology, seed: int, budget_s: float, steps: int, candidates: int
) -> Plan:
    """``persia plan --tune``: the candidates run here under a progress bar on stderr; the fastest measured."""
    import time

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from persia_planner.modules.train_extra import require_training_stack

    require_training_stack("persia plan --tune")
    from persia_planner.modules.tools.tune import require_this_machine, tune

    require_this_machine(topo)

    with Progress(
        TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=make_console(stderr=True)
    ) as progress:
        task = progress.add_task("tuning: planning the candidates", total=budget_s)
        started = [0.0]

        def runs(found) -> None:
            started[0] = time.monotonic()
            names = ", ".join(r.name for r in found)
            progress.update(task, description=f"tuning {len(found)} candidates ({names})")

        def ran(name: str, rate: float | None) -> None:
            done = f"{rate:,.0f} samples/s" if rate is not None else "failed"
            progress.update(task, completed=time.monotonic() - started[0], description=f"tuning: {name} {done}")

        tuned = tune(searched, model, topo, budget_s=budget_s, steps=steps, limit=candidates, seed=seed,
                     on_runs=runs, on_run=ran)  # fmt: skip
        progress.update(task, completed=budget_s)
    return tuned


def _write_picture(png: Output, topo: Topology, placed: Plan | None = None, *, overwrite: bool) -> None:
    """Draw ``topo`` (with ``placed``'s tables on their devices) into the PNG file ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    from persia_planner.report import draw_topology

    figure = draw_topology(topo, placed)

    def save(path: Path) -> None:
        figure.savefig(path, dpi=120, bbox_inches="tight", format="png", metadata=PICTURE_METADATA)

    try:
        write_output(png, save, overwrite=overwrite)
    finally:
        figure.clear()


@app.command("validate")
def validate_command(
    model: Annotated[Path, typer.Argument(metavar="MODEL", help="model.yaml")],
    topology: Annotated[Path, typer.Argument(metavar="TOPOLOGY", help="topology.yaml")],
    plan_file: Annotated[Path, typer.Argument(metavar="PLAN", help="plan.json")],
) -> None:
    """Re-check PLAN against MODEL and TOPOLOGY: every table placed exactly once, each table's constraints kept,
    nothing over capacity.

    Exits 0 when valid, 1 when the plan breaks a rule (each problem is printed), 2 on bad input (also constraints
    that no plan on TOPOLOGY can keep, as ``persia plan`` refuses them).
    """
    from persia_planner import CostModel, load_model, load_plan, load_topology, validate
    from persia_planner.placement.feasibility import check_constraints
    from persia_planner.report import summary

    with edge():
        model_spec = load_model(model)
        topo = load_topology(topology)
        check_constraints(model_spec, topo)
        loaded = load_plan(plan_file)
        problems = validate(loaded, model_spec, topo)
        if problems:
            typer.echo(f"{plan_file} is INVALID for {model_spec.name} on {topo.name}: {len(problems)} problem(s)")
            for problem in problems:
                typer.echo(f"  - {problem}")
            raise Exit(
                print_error(
                    f"invalid plan: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                    EXIT_INVALID_PLAN,
                )
            )
        for field, ours in (("model", model_spec.name), ("topology", topo.name)):
            theirs = getattr(loaded, field)
            if theirs and theirs != ours:
                note(f"note: {plan_file} was made for {field} {theirs!r}, checked against {ours!r}", to_stderr=True)
        estimate, _ = CostModel(loaded.priced_model(model_spec), topo).evaluate(loaded.tables)
        typer.echo(
            f"OK: {plan_file} places all {len(model_spec.tables)} tables of {model_spec.name} on {topo.name} "
            f"within capacity; re-estimated step {estimate.step_ms:.2f} ms"
        )
        typer.echo(summary(loaded))


@app.command("topology")
def topology_command(
    topology: Annotated[Path, typer.Argument(metavar="TOPOLOGY", help="topology.yaml")],
    png: Annotated[Path | None, typer.Option("--png", help="draw the cluster into this PNG file")] = None,
    overwrite: OverwriteOption = False,
) -> None:
    """Summarise TOPOLOGY: hosts, GPUs, parameter servers, memory totals, links, switch bandwidth, latency."""
    from persia_planner import load_topology
    from persia_planner.report import topology_lines

    with edge():
        picture = Output("--png", png, OutputKind.PICTURE) if png is not None else None
        check_outputs([picture], {"TOPOLOGY": topology}, overwrite=overwrite)
        topo = load_topology(topology)
        for line in topology_lines(topo):
            typer.echo(line)
        if picture is not None:
            _write_picture(picture, topo, overwrite=overwrite)
            typer.echo(f"wrote {png}")


@app.command("nodes")
def nodes_command(
    topology: Annotated[Path, typer.Argument(metavar="TOPOLOGY", help="topology.yaml")],
    node: Annotated[
        int | None, typer.Option("--node", min=0, help="print only node N's line: its host and --nproc-per-node")
    ] = None,
) -> None:
    """The torchrun layout of TOPOLOGY, one node per host in topology order: node, host, --nproc-per-node.

    A parameter_server host runs one server, a trainer host one trainer per device; launch node N with
    ``PERSIA_HOST=HOST torchrun --nproc-per-node NPROC ...`` (scripts/slurm_train.sbatch does).
    """
    from persia_planner import load_topology
    from persia_planner.topology.torchrun_nodes import node_layout

    with edge():
        layout = node_layout(load_topology(topology))
        if node is not None and node >= len(layout):
            raise PlannerError(
                f"--node {node} is past the {len(layout)} nodes of {topology}",
                fixes=(f"give --node 0 to {len(layout) - 1}", "launch one node per host of the topology"),
            )
        for i, (host, procs) in enumerate(layout):
            if node is None or node == i:
                typer.echo(f"{i} {host} {procs}")


@app.command("ps")
def ps_command(
    rank: Annotated[int, typer.Option("--rank", min=0, help="this server's rank; servers take 0..n-1")],
    world_size: Annotated[int, typer.Option("--world-size", min=1, help="parameter servers + trainers")],
    name: Annotated[str | None, typer.Option("--name", help="RPC worker name (default ps{rank})")] = None,
    rpc_timeout: Annotated[float, typer.Option("--rpc-timeout", min=1.0, help="seconds, for rendezvous")] = 60.0,
    peer_timeout: Annotated[
        float,
        typer.Option("--peer-timeout", min=0.0, help="give up on a worker that stopped answering after N s (0: never)"),
    ] = 60.0,
) -> None:
    """Run one embedding parameter server until the job ends (torch.distributed.rpc; MASTER_ADDR/MASTER_PORT from
    the environment, as torchrun sets them)."""
    import logging

    with edge():
        if rank >= world_size:
            raise PlannerError(f"--rank {rank} must be below --world-size {world_size}")
        from persia_planner.modules.rpc_environment import check_rpc_environment, check_timeouts
        from persia_planner.modules.train_extra import PS_STACK, require_training_stack

        # The environment is checked before torch is imported (and before any connection): a mistake is answered
        # at once.
        check_timeouts(rpc_timeout=rpc_timeout, peer_timeout=peer_timeout)
        check_rpc_environment("the parameter-server RPC group")
        require_training_stack("persia ps", PS_STACK)
        from persia_planner.modules.ps.server import serve

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        serve(rank, world_size, name=name, rpc_timeout_s=rpc_timeout, peer_timeout_s=peer_timeout)


app.command("train")(train_command)
app.command("size")(size_command)
app.command("predict")(predict_command)
app.add_typer(data_app, name="data")


QUIET_FACTOR = 5  # --repeat-until-quiet: how much longer a measurement may repeat


@app.command("calibrate")
def calibrate_command(
    quick: Annotated[bool, typer.Option("--quick", help="fewer, smaller measurements (about a minute)")] = False,
    out: Annotated[Path, typer.Option("--out", help="the profile to write (topology.yaml names it as profile:)")] = (
        Path("profile.yaml")
    ),
    overwrite: OverwriteOption = False,
    host: Annotated[
        str | None,
        typer.Option("--host", metavar="NAME", help="the topology host (class) this profile is for: recorded in it"),
    ] = None,
    repeat_until_quiet: Annotated[
        bool,
        typer.Option(
            "--repeat-until-quiet",
            help=f"repeat a disturbed measurement up to {QUIET_FACTOR}x longer (calls, seconds, step job runs) "
            "before keeping it as noisy",
        ),
    ] = False,
    from_runs: Annotated[
        bool,
        typer.Option(
            "--from-runs",
            help="measure nothing: refit the profile from the persia train runs whose --log-dir folders follow "
            "(DIR...)",
        ),
    ] = False,
    runs: Annotated[list[Path] | None, typer.Argument(metavar="[DIR]...", help="with --from-runs: run folders")] = None,
    base_profile: Annotated[
        Path | None,
        typer.Option("--profile", help="with --from-runs: the profile to refit (default: the runs' profile_source)"),
    ] = None,
    topology: Annotated[
        Path | None,
        typer.Option("--topology", help="under torchrun, a process per host: measure the cluster (docs/multinode.md)"),
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out-dir", help="with --topology: the folder of the profiles, one per host class")
    ] = None,
    node_host: Annotated[
        str | None, typer.Option("--node-host", metavar="NAME", help="with --topology: this node's host (PERSIA_HOST)")
    ] = None,
    sizes_name: Annotated[
        str | None,
        typer.Option("--sizes", help="with --topology: full, quick (--quick), tiny (tests only: too rough to plan)"),
    ] = None,
) -> None:
    """Measure this machine as the runtime uses it (memory, fbgemm TBE, gloo collectives, PS rpc and store, dense
    MLP) and write a hardware profile; prints the figures fitted from it. Each measurement repeats until its calls
    agree; one that stays spread is kept, marked noisy in the profile and warned about. With --topology, under
    torchrun: every host of the topology measured where it runs, one profile per host class."""
    import yaml

    from persia_planner.topology.profile import HardwareProfile

    with edge():
        if from_runs or runs:
            from persia_planner.cli.from_runs import calibrate_from_runs

            if not from_runs:
                raise PlannerError("run folders are given only with --from-runs", fixes=("add --from-runs",))
            return calibrate_from_runs(runs or [], out, base_profile, overwrite=overwrite)
        if topology is not None or out_dir is not None or sizes_name is not None:
            from persia_planner.modules.tools.cluster_calibration import cluster_command

            longer, sizes_name = QUIET_FACTOR if repeat_until_quiet else 1, sizes_name or ("quick" if quick else "full")
            cluster_command(topology, out_dir, sizes_name=sizes_name, longer=longer, overwrite=overwrite,
                            node_host=node_host)  # fmt: skip
            from persia_planner.modules.launcher.lifecycle import end_torchrun_worker

            return end_torchrun_worker()
        if host is not None and (not host.strip() or not host.isprintable()):
            raise PlannerError(f"--host {host!r} is no host name", fixes=("name the topology's host, e.g. trainer",))
        profile_out = Output("--out", out, OutputKind.PROFILE)
        check_outputs([profile_out], {}, overwrite=overwrite)
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        from persia_planner.modules.train_extra import require_training_stack

        require_training_stack("persia calibrate")
        from persia_planner.modules.tools.calibrate import PHASES, Sizes, calibrate

        with Progress(
            TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=make_console(stderr=True)
        ) as progress:
            task = progress.add_task("calibrating", total=len(PHASES))

            def done(name: str, seconds: float) -> None:
                progress.update(task, advance=1, description=f"{name} done ({seconds:.1f} s)")

            sizes = Sizes.of(quick).longer(QUIET_FACTOR if repeat_until_quiet else 1)
            raw = calibrate(quick=quick, on_done=done, sizes=sizes, topology_host=host)
        fitted = HardwareProfile.from_dict(raw, str(out))
        text = OutputKind.PROFILE.header(
            "raw measurements; the planner fits its figures from them (persia_planner.cost)"
        )
        text += yaml.safe_dump(raw, sort_keys=False)
        write_output(profile_out, lambda path: path.write_text(text, encoding="utf-8"), overwrite=overwrite)
        from rich.table import Table

        table = Table(title=f"persia calibrate ({'quick' if quick else 'full'}): fitted figures")
        for column in ("figure", "fitted", "worst fit error"):
            table.add_column(column, justify="left" if column == "figure" else "right")
        for row in fitted.summary():
            table.add_row(*row)
        make_console().print(table)
        note(f"wrote {out}", to_stderr=False)
        from persia_planner.topology.provenance import disturbed_warnings

        for line in disturbed_warnings(fitted.noise, repeated_longer=repeat_until_quiet):
            note(line, to_stderr=True)
