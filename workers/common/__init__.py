"""What every worker uses and none owns: spans and device usage, errors told in one line,
free ports, an event loop in a thread, and importing user code a config names."""
