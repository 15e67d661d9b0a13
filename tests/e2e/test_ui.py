"""The Prefect UI in Debian's Chromium, driven by Playwright: a custom run with a changed parameter, to completion."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from influence_core.pipeline.store import storage

pytestmark = pytest.mark.e2e
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "prefect-ui-custom-run.png"
REPORT_SCREENSHOT = "prefect-ui-report-artifact.png"
CONTAINER = "xpath=ancestor::*[contains(concat(' ', normalize-space(@class), ' '), ' p-label ')][1]"  # a form property
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def browser():  # type: ignore[no-untyped-def]
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (.ci/run installs it: apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        instance = p.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)  # no browser download
        yield instance
        instance.close()


def property_input(page, label: str, selector: str):  # type: ignore[no-untyped-def]
    """The input of the form property whose label reads `label`."""
    return page.get_by_text(label, exact=True).locator(CONTAINER).locator(selector).first


def test_custom_run_from_the_deployment_page(deployed, browser, tmp_path):
    from prefect.client.orchestration import SyncPrefectClient

    ui = deployed["PREFECT_API_URL"].removesuffix("/api")
    with SyncPrefectClient(api=deployed["PREFECT_API_URL"]) as client:
        deployment = client.read_deployment_by_name("influence-run/on-demand")
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    refused: list = []  # the API's answers of 400 and more, and requests that got none: why a submit failed
    page.on("response", lambda response: refused.append(response) if response.status >= 400 else None)
    page.on("requestfailed", lambda request: refused.append(request))
    page.goto(f"{ui}/deployments/deployment/{deployment.id}", wait_until="networkidle")
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Custom run").click()
    page.wait_for_url(re.compile(r".*/run(\?.*)?$"))
    page.wait_for_load_state("networkidle")

    output = tmp_path / "ui-run"
    property_input(page, "output_url (Optional)", "textarea").fill(str(output))
    property_input(page, "Training examples (Optional)", "input[type=number]").fill("300")
    property_input(page, "Top k (Optional)", "input[type=number]").fill("7")
    # the form is drawn: optional numbers and strings are inputs left blank, not the UI's type switch set to None;
    # the switches left are real choices: the gradient projection (none, or a Projection's settings) and the LoRA
    # adapters (none: every weight trained, or a LoraSpec's settings)
    none_switch = 'Property is type "None"'
    choices = [page.get_by_text(title, exact=True).locator(CONTAINER) for title in ("Gradient projection (Optional)", "LoRA adapters (Optional)")]
    assert page.get_by_text(none_switch).count() == 2 and [choice.get_by_text(none_switch).count() for choice in choices] == [1, 1]
    back_on_the_deployment = re.compile(r".*/deployments/deployment/[0-9a-f-]+(\?tab=Runs)?$")
    page.get_by_role("button", name="Submit").click()
    try:
        try:
            page.wait_for_url(back_on_the_deployment, timeout=60_000)
        except PlaywrightTimeout:
            # the server once answered create_flow_run with 503 Service Unavailable (fc21), a transient answer that
            # Prefect's clients retry and its UI does not: a person submits again, and so does the test, once
            if not any(getattr(r, "status", None) == 503 and r.url.endswith("/create_flow_run") for r in refused):
                raise
            page.get_by_role("button", name="Submit").click()
            page.wait_for_url(back_on_the_deployment, timeout=60_000)
    except PlaywrightTimeout:  # what the form shows instead (a validation message, an error toast), for the failure report
        page.screenshot(path=str(tmp_path / "submit-timeout.png"), full_page=True)
        calls = [f"{r.status} {r.request.method} {r.url}: {r.text()[:500]}" if hasattr(r, "status") else f"no answer: {r.method} {r.url} ({r.failure})" for r in refused]
        pytest.fail(f"the form did not return to the deployment within 60 s; the API calls that failed: {calls or 'none'}; the page ({tmp_path / 'submit-timeout.png'}) reads: {page.inner_text('body')[-1500:]}")

    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with SyncPrefectClient(api=deployed["PREFECT_API_URL"]) as client:
        mine = [r for r in client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))) if r.parameters.get("output_url") == str(output)]
        assert len(mine) == 1, "the form did not create exactly one run with the edited parameters"
        flow_run_id = mine[0].id
        deadline = time.time() + 600
        while not (run := client.read_flow_run(flow_run_id)).state.is_final():
            assert time.time() < deadline, "the run from the UI did not finish"
            time.sleep(1)
    assert run.state.is_completed(), f"{run.state}: {open(deployed['WORKER_LOG']).read()[-3000:]}"
    assert run.parameters["aggregate"]["top_k"] == 7 and run.parameters["dataset"]["n_train"] == 300

    page.goto(f"{ui}/runs/flow-run/{flow_run_id}", wait_until="networkidle")
    page.get_by_text("Completed").first.wait_for(timeout=30_000)
    # The README's screenshots are refreshed with INFLUENCE_UPDATE_DOCS=1; otherwise they go to the test's tmp dir.
    shots = SCREENSHOT.parent if os.environ.get("INFLUENCE_UPDATE_DOCS") == "1" else tmp_path
    page.screenshot(path=str(shots / SCREENSHOT.name))
    assert (shots / SCREENSHOT.name).stat().st_size > 10_000

    # the report: an image artifact of the run, rendered by the UI from the browser (the PNG is inline, so it shows
    # whether the output is on the worker's disk or in a bucket the browser cannot reach)
    with SyncPrefectClient(api=deployed["PREFECT_API_URL"]) as client:
        (report,) = [a for a in client.read_artifacts() if a.flow_run_id == flow_run_id and a.key == "influence-report"]
        (table,) = [a for a in client.read_artifacts() if a.flow_run_id == flow_run_id and a.key == "influence-topk"]
    assert report.type == "image" and report.data.startswith("data:image/png;base64,")
    assert {"helpful_7", "harmful_7"} <= set(json.loads(table.data)[0]) and "helpful_8" not in json.loads(table.data)[0]
    page.goto(f"{ui}/artifacts/artifact/{report.id}", wait_until="networkidle")
    image = page.locator("img[src^='data:image/png']").first
    image.wait_for(timeout=30_000)
    assert image.evaluate("img => img.complete && img.naturalWidth") > 300  # decoded and drawn, not a broken image
    page.screenshot(path=str(shots / REPORT_SCREENSHOT), full_page=True)
    group = storage.open_group(str(output / "influence.zarr"), {}, mode="r")
    assert group.attrs["status"] == "complete"
    assert np.asarray(group["topk_helpful_indices"][...]).shape[1] == 7
    assert group["scores"].shape[1] == 300
