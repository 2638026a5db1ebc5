"""The ``persia`` command: a thin shell over the Python API (parse arguments, call, print).

Exit codes: 0 success; 1 ``persia validate`` found an invalid plan; 2 bad input (a missing or malformed file, an
unknown key or unit, a model that cannot fit, a bad argument): one line ``error: <message>`` on stderr, never a
traceback; 3 an internal error (a bug: please report it; ``PERSIA_DEBUG=1`` shows the traceback); 130 / 143
interrupted by SIGINT (Ctrl-C) / SIGTERM (``128 + signum``, as a shell reports a signal; ``persia train`` stops its
workers first and says so in its ``error:`` line).

Nothing here imports torch, and matplotlib is imported only by ``persia topology --png``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from persia_planner.errors import ErrorKind, Interrupted, PlannerError, one_line
from persia_planner.limits import MAX_BATCH_SIZE, MAX_STALENESS

try:  # typer >= 0.22 vendors click; older typer depends on it.
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - depends on the installed typer
    from click.exceptions import ClickException  # type: ignore[no-redef]

__all__ = ["app", "main"]

EXIT_INVALID_PLAN = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3


class _Exit(Exception):
    """Leave with ``code`` after the message has been printed."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class _OneLineErrors(TyperGroup):
    """Turns usage errors (missing argument, unknown option, bad integer) into one ``error:`` line, exit 2."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None, **extra: Any):
        standalone = extra.pop("standalone_mode", True)
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = result if isinstance(result, int) else 0
        except _Exit as done:
            code = done.code
        except ClickException as err:
            if type(err).__name__ == "NoArgsIsHelpError":  # bare `persia`: show the help, as click would
                typer.echo(err.format_message())
                code = 0
            else:
                ctx = getattr(err, "ctx", None)
                hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
                code = _error(f"{err.format_message()}{hint}", err.exit_code)
        except typer.Abort:
            code = _error("aborted", 130)
        if standalone:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=_OneLineErrors,
    help="Plan where embedding tables go (GPU HBM, host DDR, parameter servers), check plans, and train with them.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def main() -> None:
    """Entry point of the ``persia`` script."""
    app(prog_name="persia")


# ---- the error edge -----------------------------------------------------------------------------------------------
def _error(message: str, code: int) -> int:
    """Print ``error: <message>`` as one line of readable length (:func:`~persia_planner.errors.one_line`) on
    stderr; return ``code``."""
    line = one_line(message)
    sys.stderr.write(f"error: {line}\n")
    sys.stderr.flush()
    return code


@contextlib.contextmanager
def _edge() -> Iterator[None]:
    """Where PlannerError becomes a one-line message and an exit code (1 for an invalid plan, else 2), and an
    :class:`~persia_planner.errors.Interrupted` run one with ``128 + signum``."""
    try:
        yield
    except Interrupted as err:
        raise _Exit(_error(str(err), 128 + err.signum)) from None
    except PlannerError as err:
        code = EXIT_INVALID_PLAN if err.kind is ErrorKind.INVALID_PLAN else EXIT_BAD_INPUT
        if getattr(err, "internal", False):  # a trainer process hit a bug, not bad input
            code = EXIT_INTERNAL
            err = PlannerError(f"internal error ({err}); please report it, PERSIA_DEBUG=1 shows the traceback")
        raise _Exit(_error(str(err), code)) from None
    except (_Exit, typer.Exit, ClickException, typer.Abort):
        raise
    except Exception as err:
        if os.environ.get("PERSIA_DEBUG"):
            raise
        message = f"internal error ({type(err).__name__}: {err}); please report it, PERSIA_DEBUG=1 shows the traceback"
        raise _Exit(_error(message, EXIT_INTERNAL)) from None


def _console(stderr: bool = False):
    from rich.console import Console

    width = None if (sys.stderr if stderr else sys.stdout).isatty() else 140
    return Console(stderr=stderr, width=width, highlight=False)


def _note(message: str, *, to_stderr: bool) -> None:
    typer.echo(message, err=to_stderr)


def _write(path: Path, what: str, write: Any) -> None:
    try:
        write(path)
    except OSError as err:
        reason = err.strerror or str(err)
        raise _Exit(
            _error(f"cannot write {what} to '{path}' ({reason}); fix: choose a writable path", EXIT_BAD_INPUT)
        ) from None


# ---- commands -----------------------------------------------------------------------------------------------------
@app.command("plan")
def plan_command(
    model: Annotated[
        Path | None, typer.Argument(metavar="MODEL", help="model.yaml (default: the bundled DLRM example)")
    ] = None,
    topology: Annotated[
        Path | None, typer.Argument(metavar="TOPOLOGY", help="topology.yaml (default: the bundled 2x4 cluster)")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="write plan.json here (atomically)")] = None,
    explain: Annotated[bool, typer.Option("--explain", help="say why the largest tables went where they did")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print only the plan.json content on stdout")] = False,
    seed: Annotated[int, typer.Option("--seed", min=0, help="seed of the search's tie-breaking")] = 0,
) -> None:
    """Place every table of MODEL on TOPOLOGY; print the per-device and per-table reports and the estimate."""
    from persia_planner import load_model, load_topology
    from persia_planner import plan as make_plan
    from persia_planner.paths import EXAMPLE_MODEL, EXAMPLE_TOPOLOGY
    from persia_planner.plan_checks import require_valid

    with _edge():
        if (model is None) != (topology is None):
            raise _Exit(
                _error(
                    "give both MODEL and TOPOLOGY, or neither to plan the bundled example; "
                    "fix: persia plan model.yaml topology.yaml",
                    EXIT_BAD_INPUT,
                )
            )
        if model is None or topology is None:
            model, topology = EXAMPLE_MODEL, EXAMPLE_TOPOLOGY
            _note(
                f"no files given: planning the bundled example {EXAMPLE_MODEL.name} on {EXAMPLE_TOPOLOGY.name}",
                to_stderr=as_json,
            )
        model_spec = load_model(model)
        topo = load_topology(topology)
        # Only --explain prints the alternatives: without it, the search need not score them.
        result = make_plan(model_spec, topo, seed=seed, **({} if explain else {"explain_top": 0}))
        require_valid(result, model_spec, topo)
        if out is not None:
            _write(out, "the plan", result.save)
        if as_json:
            typer.echo(result.to_json())
            if out is not None:
                _note(f"wrote {out}", to_stderr=True)
            return
        from persia_planner import report

        console = _console()
        report.print_plan(result, model_spec, topo, console, explain=explain)
        if out is not None:
            _note(f"wrote {out}", to_stderr=False)


@app.command("validate")
def validate_command(
    model: Annotated[Path, typer.Argument(metavar="MODEL", help="model.yaml")],
    topology: Annotated[Path, typer.Argument(metavar="TOPOLOGY", help="topology.yaml")],
    plan_file: Annotated[Path, typer.Argument(metavar="PLAN", help="plan.json")],
) -> None:
    """Re-check PLAN against MODEL and TOPOLOGY: every table placed exactly once, nothing over capacity.

    Exits 0 when valid, 1 when the plan breaks a rule (each problem is printed), 2 on bad input.
    """
    from persia_planner import CostModel, load_model, load_plan, load_topology, validate
    from persia_planner.report import summary

    with _edge():
        model_spec = load_model(model)
        topo = load_topology(topology)
        loaded = load_plan(plan_file)
        problems = validate(loaded, model_spec, topo)
        if problems:
            typer.echo(f"{plan_file} is INVALID for {model_spec.name} on {topo.name}: {len(problems)} problem(s)")
            for problem in problems:
                typer.echo(f"  - {problem}")
            raise _Exit(
                _error(
                    f"invalid plan: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                    EXIT_INVALID_PLAN,
                )
            )
        for field, ours in (("model", model_spec.name), ("topology", topo.name)):
            theirs = getattr(loaded, field)
            if theirs and theirs != ours:
                _note(f"note: {plan_file} was made for {field} {theirs!r}, checked against {ours!r}", to_stderr=True)
        estimate, _ = CostModel(model_spec, topo).evaluate(loaded.tables)
        typer.echo(
            f"OK: {plan_file} places all {len(model_spec.tables)} tables of {model_spec.name} on {topo.name} "
            f"within capacity; re-estimated step {estimate.step_ms:.2f} ms"
        )
        typer.echo(summary(loaded))


@app.command("topology")
def topology_command(
    topology: Annotated[Path, typer.Argument(metavar="TOPOLOGY", help="topology.yaml")],
    png: Annotated[Path | None, typer.Option("--png", help="draw the cluster into this PNG file")] = None,
) -> None:
    """Summarise TOPOLOGY: hosts, GPUs, parameter servers, memory totals, links, switch bandwidth, latency."""
    from persia_planner import load_topology
    from persia_planner.report import topology_lines

    with _edge():
        topo = load_topology(topology)
        for line in topology_lines(topo):
            typer.echo(line)
        if png is not None:
            import matplotlib

            matplotlib.use("Agg")
            from persia_planner.report import draw_topology

            figure = draw_topology(topo)
            try:
                _write(
                    png, "the picture", lambda path: figure.savefig(path, dpi=120, bbox_inches="tight", format="png")
                )
            finally:
                figure.clear()
            typer.echo(f"wrote {png}")


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

    with _edge():
        if rank >= world_size:
            raise PlannerError(f"--rank {rank} must be below --world-size {world_size}")
        from persia_planner.modules.rpcenv import master_address, rpc_transports

        # The environment is checked before torch is imported (and before the network is touched): a mistake
        # is answered at once.
        master_address("the parameter-server RPC group")
        rpc_transports()
        from persia_planner.modules.ps.server import serve

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        serve(rank, world_size, name=name, rpc_timeout_s=rpc_timeout, peer_timeout_s=peer_timeout)


@app.command("train")
def train_command(
    model: Annotated[
        Path | None, typer.Option("--model", help="model.yaml (default: the bundled small DLRM, dlrm_small.yaml)")
    ] = None,
    topology: Annotated[
        Path | None, typer.Option("--topology", help="topology.yaml (default: this machine, local_2x1.yaml)")
    ] = None,
    plan_path: Annotated[
        Path | None, typer.Option("--plan", help="plan.json to execute (default: plan MODEL on TOPOLOGY now)")
    ] = None,
    data: Annotated[str, typer.Option("--data", help="'synthetic' or 'criteo:PATH' (a file or a directory)")] = (
        "synthetic"
    ),
    staleness: Annotated[
        int | None,
        typer.Option(
            "--staleness",
            min=0,
            max=MAX_STALENESS,
            help="bounded staleness K of the PS tables (default: model's)",
        ),
    ] = None,
    mode: Annotated[str, typer.Option("--mode", help="hybrid (PS tables async, staleness K) or sync (K = 0)")] = (
        "hybrid"
    ),
    steps: Annotated[int, typer.Option("--steps", min=1, help="training steps per trainer")] = 400,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--batch-size",
            min=1,
            max=MAX_BATCH_SIZE,
            help="samples per trainer and step (default: model's / trainers)",
        ),
    ] = None,
    trainers: Annotated[int, typer.Option("--trainers", min=1, help="trainer processes on this machine")] = 2,
    eval_batches: Annotated[int, typer.Option("--eval-batches", min=1, help="held-out batches per trainer")] = 8,
    checkpoint: Annotated[
        Path | None,
        typer.Option("--checkpoint", help="save the job's checkpoints here (at the end, every N steps, on a signal)"),
    ] = None,
    checkpoint_every: Annotated[
        int, typer.Option("--checkpoint-every", min=0, help="also checkpoint every N global steps (0: at the end)")
    ] = 0,
    keep: Annotated[int, typer.Option("--keep", min=1, help="keep the newest N checkpoints of this run")] = 2,
    resume: Annotated[
        bool, typer.Option("--resume", help="continue from the newest whole checkpoint in --checkpoint")
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="train from scratch into a --checkpoint directory that is not empty")
    ] = False,
    ps_delay_ms: Annotated[
        float, typer.Option("--ps-delay-ms", min=0.0, help="add this many ms to every PS call (a slow network)")
    ] = 0.0,
    ps_wire: Annotated[
        str,
        typer.Option(
            "--ps-wire",
            help="dtype of PS rows and gradients on the wire: float32 (exact), float16 (|values| <= 65504) or bfloat16",
        ),
    ] = "float32",
    id_space: Annotated[
        float,
        typer.Option(
            "--id-space",
            help="synthetic data: draw each table's ids from this many times its rows (0.02: its hot ids; above "
            "1 they can bring more distinct ids than the servers hold, so these evict while training)",
        ),
    ] = 0.02,
    ps_capacity: Annotated[
        str,
        typer.Option(
            "--ps-capacity",
            help="rows each server's store holds: planned (what the plan charged) or unbounded (every id the "
            "synthetic data can draw, nothing evicted)",
        ),
    ] = "planned",
    seed: Annotated[int, typer.Option("--seed", min=0, help="seed of the model, data and PS initialisers")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print only one JSON object with the results")] = False,
) -> None:
    """Train a DLRM with the plan: local tables sync (fbgemm), PS tables async (bounded staleness), dense DDP.

    With no options: the bundled small DLRM on synthetic click data with a known best AUC, 2 parameter servers and
    2 trainers on this machine. Under torchrun, some processes of every node serve the parameter-server tables and
    the others train.
    """
    import json
    import logging

    from persia_planner import load_model, load_topology
    from persia_planner import plan as make_plan
    from persia_planner.modules.config import TrainConfig, check_before_start, elastic_resume
    from persia_planner.paths import DEFAULT_MODEL, DEFAULT_TOPOLOGY
    from persia_planner.plan_checks import require_valid
    from persia_planner.plans import load_plan

    with _edge():
        model_path = model or DEFAULT_MODEL
        topology_path = topology or DEFAULT_TOPOLOGY
        model_spec = load_model(model_path)
        topo = load_topology(topology_path)
        # Options, plan and inputs are all checked before torch is imported (~7 s with torchrec): a mistake is
        # answered at once, as `persia plan` answers.
        cfg = TrainConfig(
            steps=steps,
            batch_size=batch_size,
            staleness=model_spec.staleness if staleness is None else staleness,
            mode=mode,
            trainers=trainers,
            data=data,
            eval_batches=eval_batches,
            ps_delay_ms=ps_delay_ms,
            ps_wire=ps_wire,
            checkpoint=str(checkpoint) if checkpoint is not None else None,
            checkpoint_every=checkpoint_every,
            keep=keep,
            resume=resume,
            overwrite=overwrite,
            seed=seed,
            progress=not as_json,
            teacher_rows_scale=id_space,
            ps_capacity=ps_capacity,
        )
        if plan_path is not None:
            the_plan = load_plan(plan_path)
        else:
            the_plan = make_plan(model_spec, topo, seed=seed)
        require_valid(the_plan, model_spec, topo)
        remote = the_plan.remote_tables()
        if "TORCHELASTIC_RUN_ID" in os.environ:
            cfg = elastic_resume(cfg)  # a restarted attempt resumes the run's own newest checkpoint
        check_before_start(cfg, model_spec, with_ps=bool(remote))
        servers = max(1, len(topo.servers))
        under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        if under_torchrun:
            missing = [v for v in ("RANK", "WORLD_SIZE") if v not in os.environ]
            if missing:
                raise PlannerError(
                    f"TORCHELASTIC_RUN_ID is set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                    "not: not a complete torchrun environment",
                    fixes=("launch with torchrun", "unset TORCHELASTIC_RUN_ID to train locally"),
                )

        from persia_planner.modules.train import summary_rows, train_local, train_torchrun, usage_table

        logging.basicConfig(level=logging.WARNING)
        if under_torchrun:
            result = train_torchrun(cfg, model_spec, dict(the_plan.tables), servers=servers, topology=topo)
            if result is None:
                return
        else:
            if not as_json:
                _note(
                    f"training {model_spec.name} ({len(model_spec.tables)} tables, {len(remote)} on the parameter "
                    f"servers: {', '.join(remote) or 'none'}) with {trainers} trainers and "
                    f"{servers if remote else 0} servers, {cfg.mode} mode, staleness {cfg.effective_staleness}",
                    to_stderr=False,
                )
            result = train_local(cfg, model_spec, dict(the_plan.tables), servers=servers, topology=topo)
        result.pop("history", None)
        if as_json:
            typer.echo(json.dumps(result))
            return
        from rich.table import Table

        table = Table(title="persia train")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for name, value in summary_rows(result):
            table.add_row(name, value)
        _console().print(table)
        if result.get("ps_servers"):
            header, server_rows = usage_table(result["ps_servers"])
            servers_table = Table(title="parameter servers")
            for i, column in enumerate(header):
                servers_table.add_column(column, justify="left" if i == 0 else "right")
            for row in server_rows:
                servers_table.add_row(*row)
            _console().print(servers_table)
        if result.get("checkpoint"):
            _note(f"checkpoint of step {result['last_step']} in {result['checkpoint']}", to_stderr=False)


@app.command("calibrate")
def calibrate_command(
    quick: Annotated[bool, typer.Option("--quick", help="fewer, smaller measurements (about a minute)")] = False,
    out: Annotated[Path, typer.Option("--out", help="the profile to write (topology.yaml names it as profile:)")] = (
        Path("profile.yaml")
    ),
) -> None:
    """Measure this machine as the runtime uses it (memory, fbgemm TBE, gloo collectives, PS rpc and store, dense
    MLP) and write a hardware profile; prints the figures fitted from it."""
    import yaml

    from persia_planner.profile import HardwareProfile

    with _edge():
        if out.exists() and not out.is_file():
            raise PlannerError(f"--out {out} is not a regular file", fixes=("give a file path, e.g. profile.yaml",))
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        from persia_planner.modules.calibrate import PHASES, calibrate

        with Progress(
            TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=_console(stderr=True)
        ) as progress:
            task = progress.add_task("calibrating", total=len(PHASES))

            def done(name: str, seconds: float) -> None:
                progress.update(task, advance=1, description=f"{name} done ({seconds:.1f} s)")

            raw = calibrate(quick=quick, on_done=done)
        fitted = HardwareProfile.from_dict(raw, str(out))
        text = "# persia calibrate: raw measurements; the planner fits its figures from them (persia_planner.profile)\n"
        text += yaml.safe_dump(raw, sort_keys=False)
        _write(out, "the profile", lambda path: path.write_text(text, encoding="utf-8"))
        from rich.table import Table

        table = Table(title=f"persia calibrate ({'quick' if quick else 'full'}): fitted figures")
        for column in ("figure", "fitted", "worst fit error"):
            table.add_column(column, justify="left" if column == "figure" else "right")
        for row in fitted.summary():
            table.add_row(*row)
        _console().print(table)
        _note(f"wrote {out}", to_stderr=False)


if __name__ == "__main__":  # pragma: no cover
    main()
