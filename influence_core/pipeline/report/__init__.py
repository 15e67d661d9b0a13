"""What people look at (the top-k table and report) and the run's integrity check."""
