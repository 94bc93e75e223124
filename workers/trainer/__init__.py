"""The trainer role: a torch shard of the policy trained with the GRPO loss."""
