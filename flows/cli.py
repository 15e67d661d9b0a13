"""`influence-pipeline`: run the flow from a YAML config, run the demo, or show a finished run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from influence_core import ConfigError
from influence_core.pipeline.publish import read_run
from influence_core.pipeline.store import RunStore
from influence_core.report import QueryRow
from influence_core.specs import StorageSpec

from .parameters import RunParameters

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Influence functions for PyTorch models at scale: which training examples made the model predict this?")
console = Console()


def apply_overrides(config: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted keys (`method.name=cg`); values are parsed as YAML, so numbers and lists keep their type."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r} is not key=value, e.g. aggregate.top_k=10", param_hint="--set")
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise typer.BadParameter(f"{key!r}: {part!r} is not a section", param_hint="--set")
        node[leaf] = yaml.safe_load(raw)
    return config


def parse_parameters(config: dict[str, Any]) -> RunParameters:
    """Validate, turning pydantic's report into one line per bad field with its dotted name."""
    try:
        return RunParameters.model_validate(config)
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in exc.errors()]
        console.print("[red]Invalid parameters:[/red]\n" + "\n".join(lines))
        raise typer.Exit(2) from None


def print_table(rows: list[QueryRow], title: str) -> None:
    table = Table(title=title, show_lines=True)
    table.add_column("query", justify="right")
    table.add_column("label", justify="right")
    table.add_column("most helpful: #id (label) score", style="green")
    table.add_column("most harmful: #id (label) score", style="red")
    for row in rows:
        cell = lambda ns: "\n".join(f"#{n.index} ({n.label}) {n.score:+.3g}" for n in ns)  # noqa: E731
        table.add_row(str(row.query), str(row.label), cell(row.helpful), cell(row.harmful))
    console.print(table)


def execute(params: RunParameters) -> None:
    """Run the flow, then print the top-k table and where the outputs are."""
    from .influence_run import influence_run  # imported late: importing prefect is slow, and --help should not be

    try:
        summary = influence_run(params)
    except ConfigError as exc:  # e.g. an output holding a run of other parameters: the message says what to do
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    _, rows = read_run(params.store(), params.aggregate.report_queries)
    print_table(rows, f"Top training examples for the first {len(rows)} queries (score > 0: helpful)")
    for name, stage in summary["stages"].items():
        console.print(f"  {name:<22} {stage['outcome']:<15} {stage['seconds']:8.2f} s")
    console.print(f"Scores and aggregates: {summary['influence']}")
    console.print(f"Report:                {summary['report']}")
    console.print(f"Summary:               {params.store().url('summary.json')}")


@app.command()
def run(
    config: Annotated[Path, typer.Option("--config", "-c", exists=True, dir_okay=False, help="YAML file of RunParameters (see configs/).")],
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field: --set method.name=cg --set aggregate.top_k=10.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a run of other parameters found at output_url (otherwise refused).")] = False,
) -> None:
    """Run the influence pipeline with parameters from a YAML file, plus --set overrides."""
    loaded = yaml.safe_load(config.read_text()) or {}
    if not isinstance(loaded, dict):
        raise typer.BadParameter(f"{config} must hold a mapping of RunParameters fields", param_hint="--config")
    if overwrite:
        loaded["overwrite"] = True
    execute(parse_parameters(apply_overrides(loaded, overrides or [])))


@app.command()
def demo(
    output_url: Annotated[str, typer.Option(help="Where the demo writes (local path or s3://bucket/prefix).")] = "runs/demo",
) -> None:
    """Digits, an MLP trained in the pipeline, exact influence; ephemeral Prefect API, local Dask cluster."""
    execute(parse_parameters({"output_url": output_url}))


@app.command()
def show(
    output_url: Annotated[str, typer.Argument(help="Output URL of a finished run: local path or s3://bucket/prefix.")],
    endpoint_url: Annotated[Optional[str], typer.Option(help="S3 endpoint for non-AWS stores; credentials come from the environment.")] = None,
    queries: Annotated[int, typer.Option(min=1, help="How many queries to show.")] = 10,
) -> None:
    """Print the top-k table of a finished run."""
    store = RunStore(output_url=output_url, storage=StorageSpec(endpoint_url=endpoint_url))
    try:
        attrs, rows = read_run(store, queries)
    except (FileNotFoundError, RuntimeError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    method = attrs.get("config", {}).get("method", {}).get("name", "?")
    print_table(rows, f"{store.output_url}: method={method}, top training examples per query")


if __name__ == "__main__":
    app()
