"""Capture: hooks on every decoder layer during ordinary generation."""

from actmap.capture.forced import capture_answers
from actmap.capture.generate import (
    generate_batch,
    generate_plain,
    generate_with_capture,
    tokenize_prompts,
)
from actmap.capture.layers import UnknownModelLayout, find_attention_modules, find_decoder_layers
from actmap.capture.records import CaptureConfig, Generation

__all__ = [
    "CaptureConfig",
    "Generation",
    "UnknownModelLayout",
    "capture_answers",
    "find_attention_modules",
    "find_decoder_layers",
    "generate_batch",
    "generate_plain",
    "generate_with_capture",
    "tokenize_prompts",
]
