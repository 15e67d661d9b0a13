"""One Prefect task per pipeline stage: thin wrappers that turn refs into inputs and call influence_core."""

from .stages import aggregate, compute_influences, compute_metagradients, compute_test_factors, fit_model, fit_preconditioner, index_training, prepare_data, rerank, validate_run

__all__ = ["aggregate", "compute_influences", "compute_metagradients", "compute_test_factors", "fit_model", "fit_preconditioner", "index_training", "prepare_data", "rerank", "validate_run"]
