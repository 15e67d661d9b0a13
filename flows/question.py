"""The on-demand question as a flow: a UI user names a finished run and a file of new queries; the run's model,
curvature and training index answer it, with no training gradient (`influence_core.pipeline.score.query`)."""

from typing import Any, Optional

from prefect import flow
from pydantic import Field

from influence_core.pipeline.store.run_store import RunStore
from influence_core.pipeline.specs import SearchSpec, StorageSpec
from tasks.question import answer_question

from . import refusals

refusals.install()  # refusals log one line, no traceback


@flow(name="influence-question", log_prints=True, validate_parameters=True)
def influence_question(
    run_url: str = Field(..., description="Output URL of a finished run with a training index (local path or s3://bucket/prefix), e.g. runs/on-demand/<parameter fingerprint>: the summary of an influence-run flow run names it."),
    queries: str = Field(..., description="An .npz file of the new queries: x_test and y_test (or x and y), local or s3://."),
    top_k: int = Field(5, ge=1, description="Most helpful and most harmful training examples per query."),
    output_url: str = Field("", description="Where the answer goes (a Zarr group of top-k arrays); empty: {run_url}/questions/{flow run name}."),
    storage: StorageSpec = StorageSpec(),
    search: SearchSpec = SearchSpec(),
    rerank: Optional[int] = Field(None, ge=0, description="Over a compressed index: each query's this many most helpful and most harmful candidates are scored again exactly, so the top-k carry exact scores. Empty: 8 × top_k; 0: off."),
) -> dict[str, Any]:
    """Which training examples made the model predict this, for new queries, from an existing run's index."""
    from prefect.runtime import flow_run

    run = RunStore(output_url=run_url, storage=storage)
    output = RunStore(output_url=output_url or run.url(f"questions/{flow_run.get_name() or 'local'}"), storage=storage)
    answer = answer_question(run, queries, top_k, output, search, rerank)
    how = "an exact scan" if search.kind == "scan" else f"its FAISS {answer['search']['index']} index ({'built now' if answer['search']['built'] else 'kept from an earlier question'})"
    reranked = answer["search"].get("rerank")
    exact = f", of which {reranked['rows']} of the candidates' re-ranked exactly ({reranked['per_side']} a side)" if reranked else " (the queries')"
    print(f"{answer['queries']} queries answered from {run_url}'s index by {how}: {answer['work']['gradient_rows']} gradient rows{exact}; the answer is in {answer['answer']}")
    return answer
