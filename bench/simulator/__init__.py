"""The simulator against real runs and published results, and its own speed."""
