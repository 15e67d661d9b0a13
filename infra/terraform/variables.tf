variable "prefect_api_url" {
  description = "Prefect API URL (PREFECT_API_URL): a self-hosted server, e.g. http://localhost:4200/api, or Prefect Cloud."
  type        = string
  default     = "http://localhost:4200/api"
}

variable "prefect_api_key" {
  description = "Prefect Cloud API key; leave null for a self-hosted server. Prefer the PREFECT_API_KEY environment variable."
  type        = string
  default     = null
  sensitive   = true
}

variable "prefect_account_id" {
  description = "Prefect Cloud account ID (UUID); null for a self-hosted server."
  type        = string
  default     = null
}

variable "prefect_workspace_id" {
  description = "Prefect Cloud workspace ID (UUID); null for a self-hosted server."
  type        = string
  default     = null
}

variable "results_prefix" {
  description = "Where runs write results; each deployment writes below it (<prefix>/nightly, <prefix>/on-demand)."
  type        = string
  default     = "s3://influence/runs"
}

variable "s3_endpoint_url" {
  description = "S3-compatible endpoint as seen from the worker (storage.endpoint_url); null for AWS S3."
  type        = string
  default     = "http://minio:9000"
}

variable "dask_scheduler_address" {
  description = "Dask scheduler reached by the flow (compute.address, with compute.cluster = address)."
  type        = string
  default     = "tcp://dask-scheduler:8786"
}

variable "code_directory" {
  description = "Directory holding flows/influence_run.py where the flow runs (the project image keeps the source there)."
  type        = string
  default     = "/opt/influence-pipeline"
}

variable "nightly_cron" {
  description = "Cron expression of the nightly deployment's schedule."
  type        = string
  default     = "0 2 * * *"

  validation {
    condition     = length(split(" ", trimspace(var.nightly_cron))) == 5
    error_message = "nightly_cron must be a five-field cron expression, e.g. \"0 2 * * *\"."
  }
}

variable "nightly_timezone" {
  description = "Time zone of the nightly schedule."
  type        = string
  default     = "UTC"
}

variable "failure_webhook_url" {
  description = "Webhook that receives every failed influence-run flow run (a chat or alerting endpoint); null: no notification. Prefer TF_VAR_failure_webhook_url: the URL may hold a token."
  type        = string
  default     = null
  sensitive   = true
}
