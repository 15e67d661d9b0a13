"""Service defaults a team expects, as code: the work pool's concurrency limit and a notification on failed runs.

`make serve` runs `python -m flows.service` after creating the pool; the e2e tests run the same function. The
notification goes to the webhook URL in $INFLUENCE_FAILURE_WEBHOOK_URL (any HTTP endpoint: a chat webhook, an
alerting gateway), through Prefect's CustomWebhookNotificationBlock, so it works on a network without Prefect Cloud.
"""

from __future__ import annotations

import os
from datetime import timedelta
from uuid import UUID

from prefect.automations import Automation
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolUpdate
from prefect.events.actions import SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture

POOL = "influence-pool"
POOL_CONCURRENCY = 2  # flow runs at once on the pool: each starts its own Dask cluster on the worker's machine
WEBHOOK_ENV = "INFLUENCE_FAILURE_WEBHOOK_URL"
BLOCK = "influence-failure-webhook"
AUTOMATION = "influence-run failed"
SUBJECT = "influence-run failed: {{ flow_run.name }}"
BODY = "Flow run {{ flow_run.name }} ({{ flow_run.id }}) ended {{ flow_run.state.name }}: {{ flow_run.state.message }}"


def limit_pool(pool: str = POOL, limit: int = POOL_CONCURRENCY) -> None:
    """At most `limit` flow runs at once on the work pool; later ones wait in Scheduled/Pending."""
    with get_client(sync_client=True) as client:
        client.update_work_pool(pool, WorkPoolUpdate(concurrency_limit=limit))


def notify_failures(webhook_url: str) -> UUID:
    """Save the webhook block and (re)create the automation posting to it whenever an influence-run flow run fails."""
    block = CustomWebhookNotificationBlock(
        name=AUTOMATION, url=webhook_url, json_data={"subject": "{{subject}}", "body": "{{body}}"},
        allow_private_urls=True,  # an in-house endpoint is the usual target
    )
    block_id = block.save(BLOCK, overwrite=True)
    trigger = EventTrigger(
        expect={"prefect.flow-run.Failed"},
        match={"prefect.resource.id": "prefect.flow-run.*"},
        match_related={"prefect.resource.role": "flow", "prefect.resource.name": "influence-run"},
        posture=Posture.Reactive, threshold=1, within=timedelta(0),
    )
    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(AUTOMATION):
            client.delete_automation(old.id)
    automation = Automation(
        name=AUTOMATION, description=f"Posts every failed influence-run flow run to the webhook of the block {BLOCK}.",
        trigger=trigger, actions=[SendNotification(block_document_id=block_id, subject=SUBJECT, body=BODY)],
    ).create()
    return automation.id


def main() -> None:
    """Apply both defaults; without $INFLUENCE_FAILURE_WEBHOOK_URL, say that no notification is set up."""
    limit_pool()
    url = os.environ.get(WEBHOOK_ENV)
    if url:
        notify_failures(url)
        print(f"failed influence runs are posted to the webhook in ${WEBHOOK_ENV} (automation {AUTOMATION!r})")
    else:
        print(f"no failure notification: set ${WEBHOOK_ENV} to a webhook URL and run `python -m flows.service` again")


if __name__ == "__main__":
    main()
