"""The data path: balancing, the replay queue, the driver's cost by value and by reference,
the tasks' lengths."""
