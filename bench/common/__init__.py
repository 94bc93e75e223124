"""What the benchmarks share: stdout kept for the result, the options of whole-run benchmarks."""
