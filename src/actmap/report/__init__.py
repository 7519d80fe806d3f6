"""Tables from stored results: nothing here recomputes a score."""
