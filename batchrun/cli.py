"""The `batchrun` command: parse, call, map outcomes to exit codes. The work is in batchrun.job (run,
validate) and batchrun.distributed (the Ray executor, merge).

Exit codes: 0 done; 1 a failure during the run, or damage found by `verify`; 2 a bad job, unreadable input or
a held output folder (one line, before any model loads); 130 / 143 after SIGINT / SIGTERM, rows committed first."""

from __future__ import annotations

import logging
import sys

import click

from batchrun import __version__
from batchrun.config import JobError, load_job

log = logging.getLogger("batchrun")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (so it survives stream swaps, e.g. in tests)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _setup_logging(quiet: bool) -> None:
    """batchrun's own INFO lines (or only warnings with --quiet), other libraries' warnings, on stderr."""
    root = logging.getLogger()
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s batchrun %(levelname)s: %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
    logging.getLogger("batchrun").setLevel(logging.WARNING if quiet else logging.INFO)


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"batchrun: error: {message}", err=True)
    sys.exit(code)


_set_option = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                           help="Override a job file key (the value is parsed as YAML); repeatable.")
_executor_option = click.option("--executor", type=click.Choice(["local", "ray"]),
                                help="Where the engines run (= --set executor.kind=...): this process, or "
                                     "replicas on a Ray cluster (pip install 'batchrun[ray]').")
_shard_option = click.option("--shard", metavar="I/N|auto",
                             help="Process the I-th of N slices of the input (0-based) into "
                                  "OUTPUT/shard-I-of-N/; 'auto' reads SLURM_ARRAY_TASK_ID/COUNT.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="batchrun")
def main() -> None:
    """Offline batch LLM inference: a table of prompts in, a table of completions out."""


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@_set_option
@click.option("--limit", type=click.IntRange(min=0), help="Process only the first N input rows (of the shard).")
@_shard_option
@_executor_option
@click.option("--no-resume", is_flag=True, help="Discard committed output in the output folder and start afresh.")
@click.option("--retry-errors", is_flag=True,
              help="Compute again only the rows of a complete output whose error is set (after a fix to the job), "
                   "in place; every other row stays as it is.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or progress lines, only warnings and errors.")
def run(job: str, overrides: tuple[str, ...], limit: int | None, shard: str | None, executor: str | None,
        no_resume: bool, retry_errors: bool, quiet: bool) -> None:
    """Run JOB (a YAML job file) and write its output folder."""
    from batchrun.job import ShardSpec, plan_job, run_job

    _setup_logging(quiet)
    try:
        cfg = load_job(job, _with_executor(overrides, executor))
        plan = plan_job(cfg, shard=ShardSpec.parse(shard), limit=limit, resume=not no_resume,
                        retry_errors=retry_errors)
    except JobError as e:
        _fail(str(e))
    try:
        result = run_job(plan, quiet=quiet)
    except JobError as e:
        _fail(str(e))
    if result.exit_code == 0:
        if not quiet:
            click.echo(f"batchrun: {result.message}")
        else:
            click.echo(str(result.out_dir))
    else:
        click.echo(f"batchrun: error: {result.message}", err=True)
    sys.exit(result.exit_code)


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@_set_option
@_shard_option
@_executor_option
def validate(job: str, overrides: tuple[str, ...], shard: str | None, executor: str | None) -> None:
    """Check JOB and its input's schema without loading the model."""
    from batchrun.job import ShardSpec, describe_plan, plan_job

    _setup_logging(quiet=True)
    try:
        cfg = load_job(job, _with_executor(overrides, executor))
        plan = plan_job(cfg, shard=ShardSpec.parse(shard))
    except JobError as e:
        _fail(str(e))
    click.echo(describe_plan(plan))


@main.command()
@click.argument("output", type=click.Path(file_okay=False))
@click.option("--to", "dest", type=click.Path(file_okay=False), metavar="DEST",
              help="Where to write the merged folder (default: OUTPUT-merged, next to OUTPUT).")
@click.option("--shards", "count", type=click.IntRange(min=1), metavar="N",
              help="Which array, when OUTPUT holds shards of arrays of different sizes.")
def merge(output: str, dest: str | None, count: int | None) -> None:
    """Merge the shard-I-of-N folders of a job array in OUTPUT into one output folder, in input order."""
    from batchrun.distributed.merge import merge as merge_shards

    _setup_logging(quiet=True)
    from batchrun.output.files import SinkError

    try:
        result = merge_shards(output, dest, count)
    except JobError as e:
        _fail(str(e))
    except SinkError as e:  # a write into DEST failed: the shards are untouched, a rerun merges again
        _fail(str(e), code=1)
    click.echo(f"batchrun: merged {result['shards']} shards ({result['output_rows']} rows, "
               f"{result['row_errors']} row errors) into {result['dest']}")


@main.command()
@click.argument("output", type=click.Path(file_okay=False))
def verify(output: str) -> None:
    """Check OUTPUT fully: every part's size, checksum, footer and rows, the ids once each and in input order,
    _metrics.json and _SUCCESS. Exit 1 with one line per problem when anything is wrong."""
    from batchrun.output.verify import verify as verify_output

    _setup_logging(quiet=True)
    try:
        report = verify_output(output)
    except JobError as e:
        _fail(str(e))
    for note in report.notes:
        click.echo(f"batchrun: note: {note}", err=True)
    for problem in report.problems:
        click.echo(f"batchrun: problem: {problem}", err=True)
    if report.problems:
        sys.exit(1)
    click.echo(f"batchrun: {output} is whole: {report.parts} parts, {report.rows} rows for {report.positions} "
               "input rows, checksums and ids as recorded")


def _with_executor(overrides: tuple[str, ...], executor: str | None) -> tuple[str, ...]:
    return overrides if executor is None else (*overrides, f"executor.kind={executor}")


@main.command()
@click.option("--model", metavar="MODEL", help="The model (= --set model.path=...): builtin:NAME, a checkpoint "
                                               "folder, a .gguf file, or a Hub id in the local HF cache.")
@click.option("--config", "config", type=click.Path(dir_okay=False), metavar="JOB.yaml",
              help="Take the model: and engine: sections of this job file (its other sections are not read).")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="A model.* or engine.* setting, as in a job file (the value is parsed as YAML); repeatable.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option("--state-dir", default="batchrun-serve", show_default=True, type=click.Path(file_okay=False),
              help="Where uploaded files, batches and their outputs live; a restart on it carries on.")
@click.option("--api-key", envvar="BATCHRUN_API_KEY", metavar="KEY",
              help="Requests must send 'Authorization: Bearer KEY' (also from $BATCHRUN_API_KEY); none: open.")
@click.option("--commit-interval", default=1.0, show_default=True, type=click.FloatRange(min=0.1),
              metavar="SECONDS", help="How often a running batch commits its finished requests (what a crash "
                                      "can lose).")
@click.option("--quiet", "-q", is_flag=True, help="Only warnings and errors in the log.")
def serve(model: str | None, config: str | None, overrides: tuple[str, ...], host: str, port: int, state_dir: str,
          api_key: str | None, commit_interval: float, quiet: bool) -> None:
    """Serve OpenAI's Files and Batches API (/v1/files, /v1/batches) on the local engine (docs/serve.md)."""
    from batchrun.config import load_engine_settings
    from batchrun.serve.options import ServeOptions
    from batchrun.serve.server import build

    _setup_logging(quiet)
    options = ServeOptions(host=host, port=port, api_key=api_key or None, commit_interval_s=commit_interval)
    try:
        settings = load_engine_settings(model, config, overrides)
        server = build(settings, options, state_dir)
    except JobError as e:
        _fail(str(e))
    sys.exit(server.run())


@main.command()
@click.argument("output", type=click.Path(file_okay=False))
@click.option("-n", "rows", type=click.IntRange(min=1), default=5, show_default=True, help="How many rows.")
@click.option("--columns", metavar="A,B,...", help="Columns to show, comma-separated (default: id, question, "
                                                  "completion, and error when a row has one).")
def show(output: str, rows: int, columns: str | None) -> None:
    """Print the first rows of OUTPUT (an output folder, or a folder of job-array shards) as a table."""
    from batchrun.show import show as show_rows

    try:
        table = show_rows(output, rows, [c.strip() for c in columns.split(",") if c.strip()] if columns else None)
    except JobError as e:
        _fail(str(e))
    click.echo(table)


@main.command()
def models() -> None:
    """List the model families batchrun runs, with what the test suite verifies for each."""
    from batchrun.model.arch.registry import models_table  # no torch

    click.echo(models_table())


@main.command()
@click.argument("output", type=click.Path(file_okay=False))
@click.option("--out", "dest", type=click.Path(dir_okay=False), metavar="PNG",
              help="Where to write the picture (default: OUTPUT/report.png).")
@click.option("--size", default="1200x900", show_default=True, metavar="WxH", help="Picture size in pixels.")
def report(output: str, dest: str | None, size: str) -> None:
    """Draw the run's throughput, concurrency and KV cache use over time (from _metrics.json) to a PNG."""
    from batchrun.report import draw

    try:
        width, height = (int(x) for x in size.lower().split("x"))
    except ValueError:
        _fail(f"--size: expected WIDTHxHEIGHT in pixels, e.g. 1200x900, got {size!r}")
    try:
        path = draw(output, dest, (width, height))
    except JobError as e:
        _fail(str(e))
    click.echo(f"batchrun: wrote {path} ({width}x{height})")


if __name__ == "__main__":
    main()
