"""Failures: workers killed during a run, and what the run loses."""
