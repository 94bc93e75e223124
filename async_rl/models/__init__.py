"""Local models: the tiny Qwen2 models and their supervised warm start (no hub needed)."""
