"""Shared pieces of the serving tests: a tiny generator with a chat template and a fitted detector."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
from conftest import make_tiny_llama, make_word_tokenizer

from actmap.detectors import DetectorInputs
from actmap.detectors.base import CorrectnessDetector
from actmap.llm.models import ModelSource
from actmap.serve.engine import Engine
from actmap.serve.loaded_run import load_detector_run
from actmap.serve.policy import Policy
from actmap.training.recipe import TrainConfig

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
TINY_SOURCE = ModelSource("tiny-llama", "memory", None, "test")


def save_tiny_detector(folder: Path, seed: int = 0) -> Path:
    """A logreg detector fitted for two epochs on random maps: a real, deterministic scorer."""
    rng = np.random.default_rng(seed)
    maps = rng.normal(size=(24, 12, 32, 128)).astype(np.float16)
    labels = np.arange(24) % 2
    config = TrainConfig(max_epochs=2, warmup_epochs=1, patience=2, device="cpu", batch_size=8)
    detector = CorrectnessDetector("logreg", config=config, seed=seed, device="cpu")
    detector.fit(maps[:16], labels[:16], maps[16:], labels[16:])
    return detector.save(folder / f"seed-{seed}")


def save_tiny_plus(folder: Path, seed: int = 0) -> Path:
    """An actmap-plus (4 map components + the six scalars) fitted on random maps whose label
    follows the scalars: a real scorer that reads both inputs."""
    from actmap.capture.answer_scalars import SCALAR_NAMES
    from actmap.detectors.plus import ActMapPlus, PlusConfig

    rng = np.random.default_rng(seed)
    maps = rng.normal(size=(40, 12, 32, 128)).astype(np.float16)
    scalars = rng.normal(size=(40, len(SCALAR_NAMES)))
    labels = (scalars[:, 2] + 0.5 * rng.normal(size=40) > 0).astype(int)
    config = PlusConfig(n_components=4, n_strengths=3, cv_folds=2)
    plus = ActMapPlus(config).fit(DetectorInputs(maps, scalars), labels)
    return plus.save(folder / f"seed-{seed}", metadata={"validation_auroc": 0.5})


def tiny_generator():
    """A fresh tiny Llama and word tokenizer with a chat template (the session fixtures stay
    untouched: a chat template changes how capture tokenizes)."""
    tokenizer = make_word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return make_tiny_llama(len(tokenizer)), tokenizer


def tiny_engine(run: Path, policy: Policy = Policy(), audit=None, **kwargs) -> Engine:
    model, tokenizer = tiny_generator()
    return Engine(
        model,
        tokenizer,
        TINY_SOURCE,
        load_detector_run(run),
        policy,
        max_context=64,
        audit=audit,
        **kwargs,
    )


MAX_TOKENS = 5


def client_for(run: Path, engine_factory=None, **settings):
    """A TestClient over the app serving ``run`` with the tiny generator (or ``engine_factory``);
    ``settings`` override ServeSettings fields."""
    from fastapi.testclient import TestClient

    from actmap.serve.app import ServeSettings, create_app

    options = dict(model="tiny", detector=run, default_max_tokens=MAX_TOKENS, max_tokens_cap=16)
    options.update(settings)
    factory = engine_factory or (lambda: tiny_engine(run))
    return TestClient(create_app(ServeSettings(**options), factory))


def reference(engine: Engine, prompt: str, max_tokens: int = MAX_TOKENS, n_tokens=None):
    """(generation, raw p(correct)) by capture + map (+ the answer's scalars when the served
    detector reads them) + the detector called directly, outside the server; with
    ``n_tokens``, p of the answer's first n tokens."""
    from actmap.capture import CaptureConfig, generate_with_capture
    from actmap.capture.answer_scalars import answer_scalars
    from actmap.maps import build_map, stored_form

    config = CaptureConfig(max_new_tokens=max_tokens, max_context=engine.max_context)
    (gen,) = generate_with_capture(engine.model, engine.tokenizer, [prompt], config)
    n = gen.n_tokens if n_tokens is None else n_tokens
    stored = stored_form(build_map(gen.trajectory[:, :n]))[None]
    detector = engine.detector.detector
    if "scalars" in engine.detector.requires:
        scalars = answer_scalars(gen.logprobs[:n], gen.entropies[:n])[None]
        return gen, float(detector.predict_proba(stored, scalars)[0])
    return gen, float(detector.predict_proba(stored)[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """A uvicorn server on loopback in a thread (its lifespan runs as in `actmap serve`)."""

    def __init__(self, app, port: int | None = None) -> None:
        self.app, self.port = app, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        import uvicorn

        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def stop_process_group(process: subprocess.Popen) -> None:
    """End a server started with ``start_new_session=True`` and every process it started."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
