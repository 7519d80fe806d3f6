"""Serving: an OpenAI-compatible server whose every answer carries p(correct) and a decision.

`policy` (decisions, fitting, prior setting) and `audit` (the audit store) import no
web framework; `app` builds the FastAPI server (the ``serve`` extra).
"""
