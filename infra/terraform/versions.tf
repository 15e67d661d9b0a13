terraform {
  required_version = ">= 1.5"

  required_providers {
    prefect = {
      source = "prefecthq/prefect"
      # v3 dropped attributes this configuration does not use (manifest_path, catchup, max_active_runs).
      version = "~> 3.0"
    }
  }
}
