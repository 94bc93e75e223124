"""The rollout role: a vLLM engine that turns prompts into scored groups."""
