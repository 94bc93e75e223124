"""The vocabulary every layer speaks: the records that cross a boundary (prompts, groups,
batches, step results, reports), the config vocabulary (``ConfigError``, field bounds,
the data plane's sections) and calls run side by side (``each``)."""
