output "work_pool_name" {
  description = "Work pool the workers poll (prefect worker start --pool ...)."
  value       = prefect_work_pool.influence.name
}

output "deployment_ids" {
  description = "Deployment IDs by name."
  value = {
    nightly     = prefect_deployment.nightly.id
    "on-demand" = prefect_deployment.on_demand.id
    question    = prefect_deployment.question.id
  }
}
