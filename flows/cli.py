"""`influence-pipeline`: run the flow from a YAML config, run the demo, or show a finished run.

Only typer, rich and the standard library are imported here, so `--help` answers at once; torch, Prefect, zarr,
Dask and the parameter models are imported inside the commands that use them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from influence_core.pipeline.store.run_store import RunStore
    from influence_core.pipeline.report.report import QueryRow
    from influence_core.pipeline.specs import SearchSpec

    from .parameters import RunParameters

app = typer.Typer(add_completion=False, no_args_is_help=True)
CacheUrl = Annotated[Optional[str], typer.Option(help="The run's stage store, where it is now (when it moved); default: the one the run recorded.")]
console = Console()


def print_version(requested: bool) -> None:
    """`--version`: the package version and the git commit of its source, then exit."""
    if requested:
        from influence_core.version import __version__, source_commit

        console.print(f"influence-pipeline {__version__} (commit {source_commit()})", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=print_version, is_eager=True, help="Print the version and the commit, then exit.")] = False,
) -> None:
    """Influence functions for PyTorch models at scale: which training examples made the model predict this?"""


def apply_overrides(config: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted keys (`method.name=cg`); values are parsed as YAML, so numbers and lists keep their type."""
    import yaml

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


def fail(lines: list[str], code: int) -> typer.Exit:
    """Print each problem on one line, unwrapped and without markup, and return the exit to raise."""
    for line in lines:
        console.print(line, style="red", markup=False, soft_wrap=True)
    return typer.Exit(code)


def parse_parameters(config: dict[str, Any]) -> RunParameters:
    """Validate, turning pydantic's report into one line per bad field with its dotted name."""
    from pydantic import ValidationError

    from .messages import validation_lines
    from .parameters import RunParameters

    try:
        return RunParameters.model_validate(config)
    except ValidationError as exc:
        raise fail(["Invalid parameters:", *validation_lines(exc, RunParameters)], 2) from None


def load_config(path: Path) -> dict[str, Any]:
    """The YAML mapping at `path`; a missing, binary or empty file, invalid YAML, a key given twice or anything but
    a mapping is an invalid parameter (exit 2)."""
    import yaml

    if not path.is_file():
        raise fail([f"--config: {str(path)!r} is not a file. Fix: give the path of a YAML file of RunParameters (see configs/)"], 2)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise fail([f"--config: {str(path)!r} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start:exc.start + 1]!r}: a binary file?). Fix: give the path of a YAML file of RunParameters (see configs/)"], 2) from None
    try:
        loaded = parse_yaml(text)
    except DuplicateKey as exc:
        raise fail([f"--config: {str(path)!r} gives {exc.key!r} twice in one mapping (lines {exc.first} and {exc.second}); YAML would silently keep the last. Fix: keep one {exc.key!r} there, with everything it should hold"], 2) from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise fail([f"--config: {str(path)!r} is not valid YAML{at} ({getattr(exc, 'problem', None) or exc}). Fix: correct the YAML syntax there"], 2) from None
    if not isinstance(loaded, dict):
        held = "nothing (it is empty or only comments)" if loaded is None else f"a {type(loaded).__name__}"
        raise fail([f"--config: {str(path)!r} holds {held}, not a mapping. Fix: write RunParameters fields as `key: value` lines (see configs/)"], 2)
    return loaded


class DuplicateKey(ValueError):
    """A key given twice in one YAML mapping: where both are (1-based lines)."""

    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(f"{key!r} is given twice (lines {first} and {second})")
        self.key, self.first, self.second = key, first, second


def parse_yaml(text: str) -> Any:
    """YAML as `yaml.safe_load` reads it, except that a key given twice in one mapping (a field or a whole section)
    raises DuplicateKey instead of the last one silently winning."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1  # type: ignore[no-untyped-call]
                try:
                    if key in seen:
                        raise DuplicateKey(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: SafeLoader's own error names it
                    continue
            return super().construct_mapping(node, deep)

    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


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


def print_tokens(rows: list[QueryRow]) -> None:
    """Each query, then each of its helpful and harmful passages with every token on a background shaded by its
    score (green helpful, red harmful; each passage's strongest token fully), as report.png draws them."""
    from influence_core.pipeline.report.report import passage_scale, shade

    for row in rows:
        console.print(Text(f"query {row.query}: {row.label}", style="bold"))
        for kind, neighbours in (("helpful", row.helpful), ("harmful", row.harmful)):
            for n in neighbours:
                line = Text(f"  {kind:<7} #{n.index:<6} {n.score:+.3g}  ", style="green" if kind == "helpful" else "red")
                scale = passage_scale(n.tokens)
                for piece, score in n.tokens:
                    r, g, b = (round(255 * c) for c in shade(score, scale))
                    line.append(piece, style=f"black on rgb({r},{g},{b})")
                console.print(line)


@contextmanager
def temporary_server() -> Iterator[None]:
    """Without PREFECT_API_URL, start Prefect's temporary server now (the one its client would start) with a watchdog
    that ends it when this process dies, even by SIGKILL, which runs no `atexit`. Flow runs against it send no
    heartbeats: the server ends with this process, so nothing is left to notice a silent run, and the engine's join
    of the heartbeat thread (it sleeps in 1 s steps) added up to 1 s to every run's end (0.73 s on a cached rerun)."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from .watchdog import watch

    if PREFECT_API_URL.value():
        yield
        return
    server = SubprocessASGIServer()
    server.start()
    assert server.server_process is not None
    watch(server.server_process.pid)
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def execute(params: RunParameters) -> None:
    """Run the flow, then print the top-k table and where the outputs are."""
    from prefect.logging.handlers import APILogWorker

    from influence_core.errors import ConfigError
    from influence_core.pipeline.store.publish import read_run
    from influence_core.pipeline.report.report import stage_note

    from .influence_run import influence_run
    from .interrupts import Interrupted, interruptible
    from .refusals import printed_by_caller

    try:
        with interruptible(before_stop=lambda: APILogWorker.drain_all(timeout=5)), printed_by_caller():  # the run's last logs reach the API before its server stops
            with temporary_server():
                summary = influence_run(**params.sections())
    except ConfigError as exc:  # bad input found by the preflight or a stage: one line, no traceback
        raise fail([str(exc)], 1) from None
    except Interrupted as exc:  # stopped by a signal: every process the run started is gone; the stages done are kept
        raise fail([f"run: {exc}; the processes it started are stopped and completed stages are kept. Fix: run the same command again to resume"], exc.exit_code) from None
    _, rows = read_run(params.store(), params.aggregate.report_queries)
    print_table(rows, f"Top training examples for the first {len(rows)} queries (score > 0: helpful)")
    for name, stage in summary["stages"].items():  # what each stage cost this run; a cached one notes its first cost
        console.print(f"  {name:<24} {stage['outcome']:<15} {stage['wall_seconds']:8.2f} s   {stage_note(stage)}".rstrip(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"  {'whole run':<24} {'wall time':<15} {summary['wall_seconds']:8.2f} s", markup=False, highlight=False, soft_wrap=True)
    if summary["exactness"]["from_compressed_index"]:
        console.print(f"From the compressed index: {', '.join(summary['exactness']['from_compressed_index'])}; exact: {', '.join(summary['exactness']['exact'])}", markup=False, highlight=False, soft_wrap=True)
    if "validation" in summary:
        from influence_core.pipeline.report.report import lds_line

        console.print(lds_line(summary["validation"]))
    console.print(f"Task:                  {summary['task']}")
    console.print(f"Scores and aggregates: {summary['influence']}")
    console.print(f"Report:                {summary['report']}")
    console.print(f"Summary:               {params.store().url('summary.json')}")


@app.command()
def run(
    config: Annotated[Path, typer.Option("--config", "-c", help="YAML file of RunParameters (see configs/).")],
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field: --set method.name=cg --set aggregate.top_k=10.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a run of other parameters found at output_url (otherwise refused).")] = False,
) -> None:
    """Run the influence pipeline with parameters from a YAML file, plus --set overrides."""
    loaded = load_config(config)
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
    top: Annotated[Optional[int], typer.Option(min=1, show_default="all stored", help="Most helpful and most harmful examples per query, up to the run's top_k.")] = None,
    tokens: Annotated[bool, typer.Option("--tokens", help="Print each passage with its tokens highlighted by their scores (a run with aggregate.token_scores).")] = False,
    cache_url: CacheUrl = None,
) -> None:
    """Print the top-k table of a finished run (with --tokens, its passages highlighted token by token)."""
    from influence_core.errors import ConfigError
    from influence_core.pipeline.score.query import read_answer
    from influence_core.pipeline.store.publish import is_answer, read_run

    store = open_store(output_url, endpoint_url, cache_url=cache_url)
    answered = is_answer(store)
    try:
        attrs, rows = read_answer(store, queries, top) if answered else read_run(store, queries, top)
    except ConfigError as exc:
        raise fail([str(exc)], 1) from None
    method = attrs.get("method") if answered else attrs.get("config", {}).get("method", {}).get("name", "?")
    if tokens and not any(n.tokens for row in rows for n in row.helpful + row.harmful):
        again = f"show the run it asked, {attrs.get('run')} (a run stores them with aggregate.token_scores: true)" if answered else "run it again with aggregate.token_scores: true"
        raise fail([f"--tokens: the {'answer' if answered else 'run'} stored no per-token scores. Fix: {again}"], 1)
    if tokens:
        print_tokens(rows)
    elif answered:
        print_table(rows, f"{store.output_url}: answer from {attrs.get('run')}'s index (method={method}), top training examples per query")
    else:
        print_table(rows, f"{store.output_url}: method={method}, top training examples per query")
    validation = attrs.get("refs", {}).get("validate")
    if validation:
        from influence_core.pipeline.report.report import lds_line

        console.print(lds_line(validation))


@app.command()
def query(
    run: Annotated[str, typer.Argument(metavar="RUN", help="Output URL of a finished run whose training index answers the question.")],
    queries: Annotated[str, typer.Option(help="An .npz file of the queries: x_test and y_test (or x and y).")],
    top: Annotated[int, typer.Option(min=1, help="Most helpful and most harmful training examples per query.")] = 5,
    output_url: Annotated[Optional[str], typer.Option(help="Where to write the answer (a Zarr group of the top-k arrays, kind: answer): a new location or an earlier answer, never a run; nothing is written when empty.")] = None,
    endpoint_url: Annotated[Optional[str], typer.Option(help="S3 endpoint for non-AWS stores; credentials come from the environment.")] = None,
    search: Annotated[str, typer.Option(help="scan: score every index row (exact); faiss: candidates from a FAISS inner-product index over the rows, built once and kept beside the index.")] = "scan",
    faiss_index: Annotated[str, typer.Option(help="With --search faiss: flat (exact), ivf or hnsw (approximate); auto: flat up to 100,000 rows, ivf above.")] = "auto",
    nprobe: Annotated[Optional[int], typer.Option(show_default="1/16 of the lists", help="With an ivf index: lists searched per query (more: slower, higher recall).")] = None,
    rerank: Annotated[Optional[int], typer.Option(min=0, show_default="8 × --top", help="Over a compressed index: each query's this many most helpful and most harmful candidates are scored again exactly from their training rows' gradients, so the top-k carry exact scores; 0: off.")] = None,
    cache_url: CacheUrl = None,
) -> None:
    """Score new queries against a finished run's training index, in this process: its model, curvature and index
    come from the run's store, and no training gradient is evaluated but, over a compressed index, those of each
    query's re-ranked candidates."""
    import time

    from influence_core.errors import ConfigError
    from influence_core.pipeline.score.query import ask

    how = search_spec(search, faiss_index, nprobe)
    store = open_store(run, endpoint_url, "run", cache_url)
    output = open_store(output_url, endpoint_url, "--output-url") if output_url else None
    start = time.perf_counter()
    try:
        found, rows, method = ask(store, queries, top, output, how, rerank=rerank)
    except ConfigError as exc:
        raise fail([str(exc)], 1) from None
    print_table(rows, f"{store.output_url}: method={method}, new queries against its training index")
    work, reranked = found.work, found.search.get("rerank")
    whose = f"the queries' and {reranked['rows']} candidates'" if reranked else "the queries'"
    console.print(f"{len(rows)} queries in {time.perf_counter() - start:.2f} s: {work.gradient_rows} gradient rows ({whose}), {work.index_rows} index rows read ({work.index_bytes / 1e6:.1f} MB)")
    console.print(search_line(found.search), markup=False, soft_wrap=True)


SEARCH_FLAGS = {"kind": "--search", "index": "--faiss-index", "nprobe": "--nprobe"}  # `query`'s flags for SearchSpec's fields


def search_spec(kind: str, index: str, nprobe: int | None) -> SearchSpec:
    """`query`'s search flags as a SearchSpec; a bad value is one line naming its flag (exit 2)."""
    from pydantic import ValidationError

    from influence_core.pipeline.specs import SearchSpec

    from .messages import validation_lines

    try:
        return SearchSpec.model_validate({"kind": kind, "index": index, "nprobe": nprobe})
    except ValidationError as exc:
        names = {**SEARCH_FLAGS, **{f"search.{field}": flag for field, flag in SEARCH_FLAGS.items()}}
        raise fail(validation_lines(exc, SearchSpec, names), 2) from None


def search_line(search: dict[str, Any]) -> str:
    """How the answer's top-k was found, as `query` prints it."""
    reranked = search.get("rerank")
    then = f"; each query's {reranked['per_side']} most helpful and most harmful re-ranked exactly, so the top-k scores are exact" if reranked else ""
    if search["kind"] != "faiss":
        return f"search: scan of the index{then}" if reranked else "search: exact scan of the index"
    settings = ", ".join(f"{name} {search[name]}" for name in ("nlist", "nprobe", "neighbours", "ef_search") if name in search)
    kept = f"built in {search['build_seconds']:.1f} s and kept" if search["built"] else f"loaded in {search['seconds']:.1f} s (built once in {search['build_seconds']:.1f} s)"
    return f"search: FAISS {search['index']} inner-product index{f' ({settings})' if settings else ''}, {search['candidates_per_query']} candidates a side per query scored against the index; {kept}: {search['url']}{then}"


@app.command()
def repair(
    output_url: Annotated[str, typer.Argument(help="Output URL of a run whose stages are damaged or incomplete: local path or s3://bucket/prefix.")],
    endpoint_url: Annotated[Optional[str], typer.Option(help="S3 endpoint for non-AWS stores; credentials come from the environment.")] = None,
    cache_url: CacheUrl = None,
) -> None:
    """Run the pipeline again with a run's own recorded parameters: damaged or missing stage outputs are computed
    again, intact ones are kept, and the run is published anew."""
    from influence_core.errors import ConfigError
    from influence_core.pipeline.store.publish import recorded_parameters

    try:
        config = recorded_parameters(open_store(output_url, endpoint_url, cache_url=cache_url))
    except ConfigError as exc:
        raise fail([str(exc)], 1) from None
    execute(parse_parameters(config))


@app.command()
def verify(
    output_url: Annotated[str, typer.Argument(help="Output URL of a run: local path or s3://bucket/prefix.")],
    endpoint_url: Annotated[Optional[str], typer.Option(help="S3 endpoint for non-AWS stores; credentials come from the environment.")] = None,
    cache_url: CacheUrl = None,
) -> None:
    """Check a run: complete, every array of the output layout with its shape, aggregates equal to the scores', every
    stage's stored bytes as recorded (an answer of `query`: its own layout and the run it names). Exit 1 on any failure."""
    from influence_core.pipeline.report.verify import verify_answer, verify_run
    from influence_core.pipeline.store.publish import is_answer

    store = open_store(output_url, endpoint_url, cache_url=cache_url)
    answered = is_answer(store)
    checks = verify_answer(store) if answered else verify_run(store)
    table = Table(title=f"verify {store.output_url}")
    for column in ("check", "result", "detail"):
        table.add_column(column)
    for check in checks:
        table.add_row(check.name, "[green]ok[/green]" if check.ok else "[red]FAIL[/red]", Text(check.detail))  # details hold brackets: no markup
    console.print(table)
    failed = [check.name for check in checks if not check.ok]
    again = "ask the question again with --output-url there (influence-pipeline query RUN --queries FILE)" if answered else "run the pipeline there again with the same parameters"
    if failed:
        raise fail([f"output_url: {len(failed)} of {len(checks)} checks failed: {', '.join(failed)}. Fix: {again}"], 1)
    console.print(f"All {len(checks)} checks passed.")


def open_store(output_url: str, endpoint_url: str | None, name: str = "output_url", cache_url: str | None = None) -> RunStore:
    """The location a command was given (a run, or `query`'s answer), its refusals naming it `name` as the command
    line does (`query`: run, --output-url); a run's stage store `cache_url` when given (one that moved). A bad URL
    is an invalid parameter (exit 2)."""
    from pydantic import ValidationError

    from influence_core.pipeline.store.run_store import RunStore
    from influence_core.pipeline.specs import StorageSpec

    from .messages import validation_lines

    try:
        return RunStore(output_url=output_url, storage=StorageSpec(endpoint_url=endpoint_url, cache_url=cache_url))
    except ValidationError as exc:
        raise fail(validation_lines(exc, RunStore, {"output_url": name, "endpoint_url": "--endpoint-url", "storage.endpoint_url": "--endpoint-url"}), 2) from None


if __name__ == "__main__":
    app()
