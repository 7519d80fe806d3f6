"""Experiments: training runs over seeds, evaluation, and the demo, as library functions
that return plain results (the CLI only calls them)."""
