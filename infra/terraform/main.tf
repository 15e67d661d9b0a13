provider "prefect" {
  endpoint     = var.prefect_api_url
  api_key      = var.prefect_api_key
  account_id   = var.prefect_account_id
  workspace_id = var.prefect_workspace_id
}

locals {
  entrypoint          = "flows/influence_run.py:influence_run"
  question_entrypoint = "flows/question.py:influence_question"

  # Parameters for the stack in this folder, one flow parameter per section; Prefect merges a run's parameters into
  # these section by section. Dask is reached by address, results go to an S3-compatible store.
  # Credentials are never parameters: workers take AWS_* from their environment.
  stack_params = {
    compute = {
      cluster = "address"
      address = var.dask_scheduler_address
    }
    storage = {
      endpoint_url = var.s3_endpoint_url
      cache_url    = "${var.results_prefix}/stages" # shared: a new question over the same training rows reuses the model
    }
  }

  # Prefect validates run parameters against this schema; regenerate it with update_parameter_schema.py.
  parameter_schema          = file("${path.module}/flow_parameter_schema.json")
  question_parameter_schema = file("${path.module}/question_parameter_schema.json")

  # The worker runs the entrypoint from the source kept in the project image.
  pull_steps = [
    {
      type      = "set_working_directory"
      directory = var.code_directory
    },
  ]
}

# The default base job template of a process worker, as the server publishes it.
data "prefect_worker_metadata" "defaults" {}

resource "prefect_work_pool" "influence" {
  name              = "influence-pool"
  type              = "process"
  description       = "Influence runs, executed as subprocesses of a worker built from the project image."
  paused            = false
  concurrency_limit = 2
  base_job_template = data.prefect_worker_metadata.defaults.base_job_configs.process
}

resource "prefect_flow" "influence_run" {
  name = "influence-run"
  tags = ["influence"]
}

resource "prefect_deployment" "nightly" {
  name                     = "nightly"
  description              = "Scheduled influence run (cron), results under ${var.results_prefix}/nightly."
  flow_id                  = prefect_flow.influence_run.id
  entrypoint               = local.entrypoint
  work_pool_name           = prefect_work_pool.influence.name
  work_queue_name          = "default"
  enforce_parameter_schema = true
  parameter_openapi_schema = local.parameter_schema
  parameters               = jsonencode(merge(local.stack_params, { output_url = "${var.results_prefix}/nightly/{fingerprint}" }))
  concurrency_limit        = 1
  pull_steps               = local.pull_steps
  tags                     = ["influence", "nightly"]
}

resource "prefect_deployment_schedule" "nightly" {
  deployment_id = prefect_deployment.nightly.id
  active        = true
  cron          = var.nightly_cron
  timezone      = var.nightly_timezone
}

resource "prefect_deployment" "on_demand" {
  name                     = "on-demand"
  description              = "Influence run started by hand or through the API (no schedule), results under ${var.results_prefix}/on-demand."
  flow_id                  = prefect_flow.influence_run.id
  entrypoint               = local.entrypoint
  work_pool_name           = prefect_work_pool.influence.name
  work_queue_name          = "default"
  enforce_parameter_schema = true
  parameter_openapi_schema = local.parameter_schema
  parameters               = jsonencode(merge(local.stack_params, { output_url = "${var.results_prefix}/on-demand/{fingerprint}" }))
  concurrency_limit        = 2
  pull_steps               = local.pull_steps
  tags                     = ["influence", "on-demand"]
}

# The on-demand question: a finished run's output URL and a file of new queries, answered from the run's training
# index (flows/question.py); results under <run>/questions/<flow run name>.
resource "prefect_flow" "influence_question" {
  name = "influence-question"
  tags = ["influence"]
}

resource "prefect_deployment" "question" {
  name                     = "question"
  description              = "New queries against a finished run's training index (no training gradient); results under <run>/questions."
  flow_id                  = prefect_flow.influence_question.id
  entrypoint               = local.question_entrypoint
  work_pool_name           = prefect_work_pool.influence.name
  work_queue_name          = "default"
  enforce_parameter_schema = true
  parameter_openapi_schema = local.question_parameter_schema
  parameters               = jsonencode({ storage = local.stack_params.storage })
  concurrency_limit        = 4
  pull_steps               = local.pull_steps
  tags                     = ["influence", "question"]
}

# Failed runs are posted to a webhook, as `python -m flows.service` does for `make serve`: a custom-webhook
# notification block (its data write-only, so the URL stays out of the state) and an automation on
# prefect.flow-run.Failed of the flow influence-run. Subject and body match flows/service.py (checked by tests/infra).
resource "prefect_block" "failure_webhook" {
  count     = var.failure_webhook_url == null ? 0 : 1
  name      = "influence-failure-webhook"
  type_slug = "custom-webhook"
  data_wo = jsonencode({
    name               = "influence-run failed"
    url                = var.failure_webhook_url
    json_data          = { subject = "{{subject}}", body = "{{body}}" }
    allow_private_urls = true
  })
  data_wo_version = 1
}

resource "prefect_automation" "failed_runs" {
  count       = var.failure_webhook_url == null ? 0 : 1
  name        = "influence-run failed"
  description = "Posts every failed influence-run flow run to the webhook of the block influence-failure-webhook."
  enabled     = true
  trigger = {
    event = {
      posture       = "Reactive"
      match         = jsonencode({ "prefect.resource.id" = "prefect.flow-run.*" })
      match_related = jsonencode({ "prefect.resource.role" = "flow", "prefect.resource.name" = "influence-run" })
      expect        = ["prefect.flow-run.Failed"]
      threshold     = 1
      within        = 0
    }
  }
  actions = [
    {
      type              = "send-notification"
      block_document_id = prefect_block.failure_webhook[0].id
      subject           = "influence-run failed: {{ flow_run.name }}"
      body              = "Flow run {{ flow_run.name }} ({{ flow_run.id }}) ended {{ flow_run.state.name }}: {{ flow_run.state.message }}"
    },
  ]
}
