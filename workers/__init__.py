"""Compute plane: thin Ray actors around plain rollout, trainer and weight-transport classes."""
