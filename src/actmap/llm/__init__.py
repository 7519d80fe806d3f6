"""The language models at the edges: loading generators and judges, and running shared prefixes once."""
