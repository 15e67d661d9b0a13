"""Storage, refs and stage bookkeeping: where results live, the run's lock, stage keys, loading and publishing."""
