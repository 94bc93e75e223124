"""Weight delivery from the trainer to the rollout engines."""
