"""``async-rl simulate``: the real orchestrator on a virtual clock, with simulated workers."""
