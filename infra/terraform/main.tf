provider "prefect" {
  endpoint     = var.prefect_api_url
  api_key      = var.prefect_api_key
  account_id   = var.prefect_account_id
  workspace_id = var.prefect_workspace_id
}

locals {
  entrypoint = "flows/influence_run.py:influence_run"

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
    }
  }

  # Prefect validates run parameters against this schema; regenerate it with update_parameter_schema.py.
  parameter_schema = file("${path.module}/flow_parameter_schema.json")

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
  parameters               = jsonencode(merge(local.stack_params, { output_url = "${var.results_prefix}/nightly" }))
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
  parameters               = jsonencode(merge(local.stack_params, { output_url = "${var.results_prefix}/on-demand" }))
  concurrency_limit        = 2
  pull_steps               = local.pull_steps
  tags                     = ["influence", "on-demand"]
}
