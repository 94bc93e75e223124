"""A training step's plan: advantages from a group's rewards, token-balanced shard batches
and micro-batches."""
