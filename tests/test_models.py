"""Model resolution: a GGUF file's digest names its de-quantized cache and its revision."""

from __future__ import annotations

import hashlib
import os

from actmap.llm import models


def test_a_gguf_digest_is_read_once_until_the_file_changes(tmp_path):
    """A check before a load and the load resolve the same file: the SHA-256 is read once,
    and read again when the file is replaced or rewritten."""
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"first weights" * 1000)
    models._digest.cache_clear()
    source = models.resolve_model(str(path))
    # independent reference: hashlib over the whole file
    assert source.revision == hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    assert models.resolve_model(str(path)).revision == source.revision
    assert models._digest.cache_info().hits == 1 and models._digest.cache_info().misses == 1
    path.write_bytes(b"other weights" * 1000)  # the same size, rewritten in place
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert (
        models.resolve_model(str(path)).revision
        == (hashlib.sha256(path.read_bytes()).hexdigest()[:16])
    )
    assert models._digest.cache_info().misses == 2
