"""New labels for a stored store without generating again: another QA rule, or a factuality judge."""
