"""A rollout worker's generation: engine set-ups, CPU libraries, idle cost."""
