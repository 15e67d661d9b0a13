"""Scoring machinery (chunk tasks, score layout, reductions, FastIF, per-token scores) and questions to the index."""
