"""Races: async-rl against a peer trainer, and asynchronous against synchronous under slow
rewards and slow tools."""
