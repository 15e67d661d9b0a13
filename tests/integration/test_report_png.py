"""report.png names the method, shows every one of top_k (up to 10) most helpful and most harmful examples per
query, and keeps its title clear of the first row."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from flows.influence_run import influence_run
from influence_core.pipeline.store import storage
from influence_core.pipeline.store.publish import read_run, report_heading
from influence_core.pipeline.report.report import example_view, report_figure
from influence_core.pipeline.store.loading import open_data
from influence_core.pipeline.store.publish import stored_refs
from tests.helpers import read_outputs, small_params

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.fixture(scope="module")
def cg_run(tmp_path_factory: pytest.TempPathFactory, prefect_api: None):  # type: ignore[no-untyped-def]
    """A run by CG with top_k = 5, three queries in the report."""
    params = small_params(str(tmp_path_factory.mktemp("report") / "out"), method={"name": "cg", "regularization": 1e-3}, aggregate={"top_k": 5, "report_queries": 3})
    influence_run(**params.sections())
    return params


def test_the_report_names_the_method_and_shows_all_of_top_k(cg_run):
    store = cg_run.store()
    png = Image.open(io.BytesIO(storage.read_bytes(store.url("report.png"), store.options)))
    assert png.info["Title"] == "Influence by Conjugate gradients (method cg), top 5"
    columns = 1 + 2 * 5
    assert png.size[0] == pytest.approx(1.6 * columns * 110, abs=2)  # one 1.6-inch column per cell at 110 dpi


@pytest.mark.parametrize("n_rows", [1, 6])
@pytest.mark.parametrize("note", [None, "LDS 0.412 ± 0.031 (Spearman, mean over 20 queries) from 64 retrained subsets of 50%"])
def test_the_title_is_clear_of_the_first_row(cg_run, n_rows, note):
    """The report's own figure, drawn from the stored run as publish draws it (one or six queries, with or without
    a validation note): the suptitle's box ends above every first-row cell's title."""
    store = cg_run.store()
    group, _ = read_outputs(store)
    data = stored_refs(store, group.attrs)["prepare_data"]
    arrays = open_data(data, store.options)  # type: ignore[arg-type]
    _, rows = read_run(store, 6, 5)
    fig = report_figure(rows[:n_rows], example_view(arrays["x_test"]), example_view(arrays["x_train"]), data.image_shape, report_heading(group.attrs["config"], 5), note)  # type: ignore[attr-defined]
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    title = fig._suptitle.get_window_extent(renderer)
    first_row = [ax.title.get_window_extent(renderer) for ax in fig.axes[:11]]
    assert len(rows[0].helpful) == len(rows[0].harmful) == 5
    assert all(title.y0 >= cell.y1 - 1 for cell in first_row), (title, max(cell.y1 for cell in first_row))  # at most touching (a pixel)
