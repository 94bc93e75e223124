"""The trainer: one step's speed and memory, packing, a real-size model's stage costs, and
the GPU check."""
