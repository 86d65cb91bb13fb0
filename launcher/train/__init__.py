"""The built-in trainer and what it is made of: data, optimiser, gradient sync, checkpoints, metrics."""
