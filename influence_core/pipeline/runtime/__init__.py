"""Where and how work runs: Dask clusters, torch threads, worker logs and the preflight checks."""
