"""A run's outputs: the run directory, the experiment record, metric loggers and the
progress bar."""
