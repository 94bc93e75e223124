"""Held-out evaluation outside the rollout engines: greedy decoding with transformers."""
