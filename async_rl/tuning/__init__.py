"""Tuning: what may change, searched on the simulator, checked with short real runs."""
