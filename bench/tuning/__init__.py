"""Benchmarks of the tuner and the autopilot."""
