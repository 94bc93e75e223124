"""async-rl: asynchronous, pipelined, off-policy GRPO post-training for LLMs."""

__version__ = "0.1.0"
