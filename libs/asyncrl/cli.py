"""`asyncrl`: submit, watch and inspect experiments on a scheduler.

Exit codes: 0 success; 1 a watched experiment ended other than COMPLETED; 2 a bad request
(bad spec file, or a gRPC error, printed as `CODE: details`).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Annotated

import nats.errors
import typer
import yaml
from google.protobuf import json_format
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from asyncrl import report
from asyncrl.client import (
    AsyncrlClient,
    AsyncrlError,
    default_address,
    group_record,
    read_groups,
    state_name,
)
from asyncrl.errors import BadRequest, Conflict, NotFound
from asyncrl.ledger import fetch_report
from asyncrl.logging import configure_cli_logging
from asyncrl.natsutil import nats_url
from asyncrl.overrides import apply_overrides
from asyncrl.runlog import run_log_hints
from asyncrl.security import AuthError
from asyncrl.security_cli import app as secrets_app
from asyncrl.settings import settings
from asyncrl.spec import ExperimentSpec, SpecError, json_schema, validate_spec
from asyncrl.spec_defaults import defaults_yaml
from asyncrl.v1 import common_pb2, scheduler_pb2
from asyncrl.watchview import ProgressView, follow

app = typer.Typer(
    help="asyncrl: asynchronous RL post-training (talks gRPC to the scheduler).",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(secrets_app, name="secrets")
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

# Spec fields that name local files: a relative path that exists here is sent as absolute, so
# the scheduler (whatever its working directory) reads the same file.
PLAIN_HELP = "One line per step, eval and state change (the default when stdout is no terminal)."
LOCAL_PATH_FIELDS = (
    ("model", "path"),
    ("model", "tokenizer_path"),
    ("dataset", "path"),
    ("eval", "dataset_path"),
)


# ---------------------------------------------------------------- spec loading (pure)


def load_spec_dict(path: str | Path, overrides: list[str] | None = None) -> dict:
    """Read a YAML spec, apply `a.b=value` overrides, absolutize local relative paths."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise SpecError("spec", f"cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise SpecError("spec", f"invalid YAML in {path}: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError("spec", f"{path} must hold a mapping, got {type(data).__name__}")
    apply_overrides(data, list(overrides or []))
    for section, key in LOCAL_PATH_FIELDS:
        value = (data.get(section) or {}).get(key) if isinstance(data.get(section), dict) else None
        if (
            isinstance(value, str)
            and value
            and not Path(value).is_absolute()
            and Path(value).exists()
        ):
            data[section][key] = str(Path(value).resolve())
    return data


def load_spec(path: str | Path, overrides: list[str] | None = None) -> ExperimentSpec:
    """A spec file plus overrides, validated here first (SpecError names the field) so a typo
    fails before anything is sent; the scheduler validates it again with its files."""
    return validate_spec(load_spec_dict(path, overrides))


# ---------------------------------------------------------------- helpers


def _address(ctx: typer.Context) -> str:
    return ctx.obj or default_address()


def _run(coro):
    """Run a coroutine; turn the errors a user can cause into a message and exit code 2."""
    try:
        return asyncio.run(coro)
    except AsyncrlError as e:
        err.print(f"[red]{e.code.name}[/red]: {e.details}", soft_wrap=True)
        raise typer.Exit(2) from None
    except SpecError as e:
        err.print(f"[red]bad spec[/red]: {e}", soft_wrap=True)
        raise typer.Exit(2) from None
    except AuthError as e:
        err.print(f"[red]credentials[/red]: {e}", soft_wrap=True)
        raise typer.Exit(2) from None
    except (OSError, nats.errors.Error) as e:
        err.print(f"[red]error[/red]: {type(e).__name__}: {e}", soft_wrap=True)
        raise typer.Exit(2) from None


def _to_dict(msg) -> dict:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def _print_json(msg) -> None:
    out.print_json(json.dumps(_to_dict(msg)))


def _ago(unix_s: float) -> str:
    if not unix_s:
        return "-"
    return f"{max(0.0, time.time() - unix_s):.1f}s ago"


async def _watch(address: str, experiment_id: str, as_json: bool, plain: bool = False) -> int:
    """Follow an experiment until it ends: JSON events, plain lines (`plain`, or stdout is not
    a terminal: a log file or CI) or a live view; exit code 0 if it COMPLETED, else 1."""
    view = ProgressView(experiment_id)
    async with AsyncrlClient(address) as client:
        if as_json:
            async for event in client.watch(experiment_id):
                view.update(event)
                out.print(json.dumps(_to_dict(event)), soft_wrap=True)
        else:
            plain = plain or not out.is_terminal
            await follow(client.watch(experiment_id), view, out, plain)
    if not as_json:
        out.print(f"{experiment_id}: {state_name(view.experiment.state)}")
    return 0 if view.experiment.state == scheduler_pb2.EXPERIMENT_STATE_COMPLETED else 1


# ---------------------------------------------------------------- commands


@app.callback()
def main(
    ctx: typer.Context,
    scheduler: Annotated[
        str,
        typer.Option(
            "--scheduler",
            envvar="ASYNCRL_SCHEDULER",
            help="Scheduler HOST:PORT (or HOST:PORT,HOST:PORT: a scheduler and its standby).",
        ),
    ] = "127.0.0.1:50051",
) -> None:
    configure_cli_logging()
    ctx.obj = scheduler


@app.command()
def submit(
    ctx: typer.Context,
    spec: Annotated[Path, typer.Argument(help="Experiment spec (YAML).")],
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a field: --set trainer.lr=1e-5 (repeatable)."),
    ] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Watch until it ends.")] = False,
    plain: Annotated[bool, typer.Option("--plain", help=PLAIN_HELP)] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    id_file: Annotated[
        Path | None, typer.Option("--id-file", help="Also write the experiment id to this file.")
    ] = None,
) -> None:
    """Submit an experiment; print its id."""

    async def go() -> tuple[str, int]:
        validated = load_spec(spec, set_)
        async with AsyncrlClient(_address(ctx)) as client:
            exp = await client.submit(validated)
        if id_file is not None:
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(exp.id + "\n")
        if as_json:
            _print_json(exp)
        else:
            out.print(exp.id)
            for hint in run_log_hints(exp.id, validated.trainer.loggers):
                err.print(hint, soft_wrap=True)  # stdout stays the id alone
        code = await _watch(_address(ctx), exp.id, as_json, plain) if watch else 0
        return exp.id, code

    _, code = _run(go())
    raise typer.Exit(code)


@app.command("spec")
def spec_(
    defaults: Annotated[
        bool, typer.Option("--defaults", help="Every field with its default, as commented YAML.")
    ] = False,
    schema: Annotated[bool, typer.Option("--schema", help="The spec's JSON Schema.")] = False,
) -> None:
    """Print the experiment spec: every field with its default and description (--defaults),
    or its JSON Schema (--schema). Needs no scheduler."""
    if defaults == schema:
        err.print("give one of --defaults, --schema")
        raise typer.Exit(2)
    if defaults:
        typer.echo(defaults_yaml(), nl=False)
    else:
        typer.echo(json.dumps(json_schema(), indent=2, sort_keys=True))


@app.command()
def watch(
    ctx: typer.Context,
    experiment_id: str,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON event per line.")] = False,
    plain: Annotated[bool, typer.Option("--plain", help=PLAIN_HELP)] = False,
) -> None:
    """Live progress until the experiment ends (exit 0 if COMPLETED, else 1): a view that stays
    in place on a terminal, one line per step, eval and state change otherwise."""
    raise typer.Exit(_run(_watch(_address(ctx), experiment_id, as_json, plain)))


@app.command()
def status(
    ctx: typer.Context,
    experiment_id: str,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """One experiment: state, progress, evals (with --json: everything, history included)."""

    async def go():
        async with AsyncrlClient(_address(ctx)) as client:
            return await client.get(experiment_id, with_history=True)

    exp = _run(go())
    if as_json:
        _print_json(exp)
        return
    view = ProgressView(experiment_id)
    view.update(scheduler_pb2.ProgressEvent(kind="snapshot", experiment=exp))
    evals = Table(title="evals")
    for col in ("version", "tokens from", "accuracy", "reward mean", "prompts", "failed"):
        evals.add_column(col, justify="right")
    for e in report.sorted_evals(exp):
        evals.add_row(
            str(e.version),
            report.token_versions(e),
            f"{e.accuracy:.3f}",
            f"{e.reward_mean:.3f}",
            str(e.n_prompts),
            str(e.failed),
        )
    out.print(Group(view.render(), evals))
    out.print(weights_line(exp), soft_wrap=True)


def weights_line(exp: scheduler_pb2.Experiment) -> str:
    """Where the newest committed version is, and how to take it out."""
    if not exp.weights_uri:
        return "weights: v0 (the base model; nothing trained yet)"
    return (
        f"weights: v{exp.weights_version} at {exp.weights_uri} (asyncrl export {exp.id} --out DIR)"
    )


@app.command("list")
def list_(
    ctx: typer.Context, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False
) -> None:
    """All experiments the scheduler knows (a tenant's token: its tenant's only)."""

    async def go():
        async with AsyncrlClient(_address(ctx)) as client:
            return await client.list()

    exps = _run(go())
    if as_json:
        out.print_json(json.dumps([_to_dict(e) for e in exps]))
        return
    table = Table(title="experiments")
    for col in ("id", "tenant", "name", "state", "version", "trained", "created"):
        table.add_column(col, overflow="fold")
    for e in exps:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.created_unix_ms / 1000))
        table.add_row(
            e.id,
            e.tenant or "-",
            escape(e.name),
            state_name(e.state),
            str(e.progress.version),
            str(e.progress.trained_groups),
            created,
        )
    out.print(table)


@app.command()
def cancel(ctx: typer.Context, experiment_id: str) -> None:
    """Cancel an experiment."""

    async def go():
        async with AsyncrlClient(_address(ctx)) as client:
            return await client.cancel(experiment_id)

    exp = _run(go())
    out.print(f"{exp.id}: {state_name(exp.state)}")


@app.command()
def resume(
    ctx: typer.Context,
    experiment_id: str,
    watch: Annotated[bool, typer.Option("--watch", help="Watch until it ends.")] = False,
    plain: Annotated[bool, typer.Option("--plain", help=PLAIN_HELP)] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Continue a CANCELLED or FAILED experiment from its trainer's last checkpoint, with the
    same ledger: the prompts it did not train are dispatched again (`asyncrl ledger ID`)."""

    async def go() -> int:
        async with AsyncrlClient(_address(ctx)) as client:
            exp = await client.resume(experiment_id)
        if as_json:
            _print_json(exp)
        else:
            out.print(f"{exp.id}: {state_name(exp.state)} ({exp.message})")
        return await _watch(_address(ctx), exp.id, as_json, plain) if watch else 0

    raise typer.Exit(_run(go()))


@app.command()
def checkpoint(
    ctx: typer.Context,
    experiment_id: str,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds to wait for the trainer to save.")
    ] = 300.0,
) -> None:
    """Have the experiment's trainer checkpoint now (at its next step boundary); print the
    checkpoint's path and step."""

    async def go():
        async with AsyncrlClient(_address(ctx)) as client:
            return await client.checkpoint(experiment_id, timeout_s=timeout)

    resp = _run(go())
    out.print(f"{experiment_id}: checkpoint at step {resp.step}: {resp.path}", soft_wrap=True)


@app.command()
def logs(
    service: Annotated[
        str | None,
        typer.Argument(
            help="nats, scheduler, reward, rollout, trainer, supervisor, or e.g. rollout-1"
            " (default: all)."
        ),
    ] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep following.")] = False,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Lines of each log.")] = 50,
    var: Annotated[
        Path | None,
        typer.Option("--var", help="State directory of `make up` (default: env ASYNCRL_VAR)."),
    ] = None,
) -> None:
    """The service logs of the local cluster `make up` started (as `make logs`)."""
    from asyncrl.supervisor.commands import logs as supervisor_logs  # tail(1) replaces us

    supervisor_logs(var or settings().var, service, follow, lines)


@app.command()
def workers(
    ctx: typer.Context, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False
) -> None:
    """Registered rollout, reward and trainer workers."""

    async def go():
        async with AsyncrlClient(_address(ctx)) as client:
            return await client.workers()

    ws = _run(go())
    if as_json:
        out.print_json(json.dumps([_to_dict(w) for w in ws]))
        return
    table = Table(title="workers")
    cols = ("id", "kind", "address", "device", "experiment", "running", "version", "last seen")
    for col in cols:
        table.add_column(col, overflow="fold")
    for w in sorted(ws, key=lambda w: (w.kind, w.worker_id)):
        kind = common_pb2.WorkerKind.Name(w.kind).removeprefix("WORKER_KIND_").lower()
        table.add_row(
            w.worker_id,
            kind,
            w.address,
            w.device or "-",
            w.experiment_id or "-",
            str(w.running),
            str(w.version) if w.version >= 0 else "-",
            _ago(w.last_seen_unix),
        )
    out.print(table)


@app.command()
def dump(
    experiment_id: str,
    out_file: Annotated[Path, typer.Option("--out", help="Output JSONL file.")],
    include_eval: Annotated[bool, typer.Option("--eval", help="Include eval groups.")] = False,
    limit: Annotated[int | None, typer.Option("--limit", help="At most N groups.")] = None,
    nats_server: Annotated[
        str | None, typer.Option("--nats", help="NATS URL (default: env NATS_URL).")
    ] = None,
) -> None:
    """Write the experiment's trajectory groups from JetStream to JSONL."""

    async def go() -> int:
        n = 0
        out_file.parent.mkdir(parents=True, exist_ok=True)
        with out_file.open("w") as f:
            async for group in read_groups(
                experiment_id, nats_server or nats_url(), include_eval, limit
            ):
                f.write(json.dumps(group_record(group)) + "\n")
                n += 1
        return n

    n = _run(go())
    out.print(f"wrote {n} groups to {out_file}")


async def _get_with_history(address: str, experiment_id: str) -> scheduler_pb2.Experiment:
    async with AsyncrlClient(address) as client:
        return await client.get(experiment_id, with_history=True)


@app.command()
def plot(
    ctx: typer.Context,
    experiment_id: str,
    out_file: Annotated[Path, typer.Option("--out", help="Output PNG.")],
) -> None:
    """Plot reward mean, eval accuracy and staleness against version."""
    exp = _run(_get_with_history(_address(ctx), experiment_id))
    report.plot_experiment(exp, out_file)
    out.print(f"wrote {out_file}")


@app.command("report")
def report_(
    ctx: typer.Context,
    experiment_id: str,
    out_dir: Annotated[Path, typer.Option("--out", help="Output directory.")],
    wall_seconds: Annotated[
        float | None,
        typer.Option("--wall-seconds", help="Wall time of the run (default: updated - created)."),
    ] = None,
) -> None:
    """Write summary.json and reward.png for an experiment and print the summary."""
    exp = _run(_get_with_history(_address(ctx), experiment_id))
    if wall_seconds is None:
        wall_seconds = report.wall_seconds(exp)
    report.write_summary(exp, wall_seconds, out_dir, console=out)
    out.print(f"wrote {out_dir / 'summary.json'} and {out_dir / 'reward.png'}")


def _weights(version: str, fingerprint: str) -> str:
    """A sample's version and its fingerprint, shortened as git shortens a hash (the JSON has
    it whole)."""
    return f"v{version} {fingerprint[:19] if fingerprint else 'unverified'}"


@app.command()
def ledger(
    experiment_id: str,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (totals and rows).")] = False,
    rows: Annotated[
        bool,
        typer.Option("--rows", help="Also print one row per prompt, and its samples' weights."),
    ] = False,
    nats_server: Annotated[
        str | None, typer.Option("--nats", help="NATS URL (default: env NATS_URL).")
    ] = None,
) -> None:
    """Every prompt's fate (trained once or twice, filtered, failed, left over, lost) from the
    experiment's ledger in JetStream."""
    got = _run(fetch_report(experiment_id, nats_server or nats_url()))
    if as_json:
        out.print_json(json.dumps(got.to_json()))
        return
    table = Table(title=f"ledger of {escape(experiment_id)}", show_header=False)
    for fate, n in got.totals.items():
        table.add_row(fate, str(n))
    table.add_row("steps / trained groups", f"{got.steps} / {got.trained_groups}")
    table.add_row("quarantined / duplicate publishes", f"{got.quarantined} / {got.duplicates}")
    out.print(table)
    if rows:
        for p in got.prompts:
            at = ", ".join(f"step {s} v{v}" for s, v in p.trained)
            out.print(f"e{p.epoch} p{p.index} {p.prompt!r}: {p.fate} {at or p.reason}")
            for i, weights in enumerate(p.samples):
                out.print(
                    f"  sample {i}: " + ", ".join(_weights(v, fp) for v, fp in weights.items())
                )


@app.command()
def export(
    ctx: typer.Context,
    experiment_id: str,
    out_dir: Annotated[Path, typer.Option("--out", help="Directory to write (new or empty).")],
    version: Annotated[
        int | None, typer.Option("--version", help="Version (default: the newest committed).")
    ] = None,
    adapter_only: Annotated[
        bool, typer.Option("--adapter-only", help="A LoRA run: the adapter alone, not merged.")
    ] = False,
    nats_server: Annotated[
        str | None, typer.Option("--nats", help="NATS URL (default: env NATS_URL).")
    ] = None,
) -> None:
    """Write a version as a HuggingFace model directory (config, safetensors in the base
    model's dtype, the tokenizer's files; a LoRA run merged into its base) that transformers'
    from_pretrained and SGLang load."""
    from asyncrl import export as exporter

    async def go():
        async with AsyncrlClient(_address(ctx)) as client:
            exp = await client.get(experiment_id)
        source = exporter.source_of(exp, version)
        cache = exporter.cache_dir()
        try:
            path = await exporter.fetch(source, nats_server or nats_url(), cache)
            written = await asyncio.to_thread(exporter.export, source, path, out_dir, adapter_only)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        return written, source

    try:
        written, source = _run(go())
    except (BadRequest, NotFound, Conflict) as e:
        err.print(f"[red]cannot export[/red]: {e}", soft_wrap=True)
        raise typer.Exit(2) from None
    what = "adapter" if adapter_only else "model"
    out.print(f"wrote v{source.version} of {experiment_id} ({what}) to {written}")


if __name__ == "__main__":
    sys.exit(app())
