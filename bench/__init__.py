"""The benchmarks, one folder per thing measured; run each from the repository root as
``python -m bench.FOLDER.SCRIPT`` (bench/README.md lists them)."""
