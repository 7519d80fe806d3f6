"""actmap: checkable LLM answers from generation-time activation maps."""

__version__ = "0.1.0"
