"""The control plane: one run's logic in plain Python (no ray, torch or vllm).

The orchestrator and what it sees of the workers (``protocols``), the rollout pool, run
health, the prompt ledger, checkpoints and the evaluation schedule."""
