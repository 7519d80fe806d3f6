"""``actmap baselines``: every method's score per stored row, written into the store's results."""
