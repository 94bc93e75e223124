"""Versioned weights from trainer shard 0 to every rollout engine, through vLLM's
weight-transfer API (a gloo engine on CPU; NCCL or CUDA IPC on GPUs)."""
