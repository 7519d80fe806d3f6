"""Lookback attention read inside vLLM (`actmap.capture.vllm_attention`) against the
transformers capture (`actmap.capture.lookback`, itself tested against eager attention).

Tiny random llama and qwen2 models (float32, 4 query heads on 2 key/value heads, head size
32: the CPU attention kernel's smallest), one in-process vLLM engine per family, built small
on purpose: at most 32 tokens per step (a 48-token prompt is prefilled in two chunks) and a KV
cache of 6 blocks of 32 tokens, so eight requests in flight cannot all fit and vLLM preempts
and recomputes some of them. The reference is `actmap.capture.generate_batch` (left-padded
static batch) on the same weights.

Tolerance: greedy tokens identical; attention entries ``atol=1e-5`` (measured: at most
~6e-8 apart, float32 rounding of two kernels' queries and keys); stored attention (float16)
``atol=1e-3``; the full preset's p(correct) from vLLM's rows and from transformers' within
1e-3.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama

from actmap.capture.generate import generate_batch
from actmap.capture.records import CaptureConfig

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'actmap[vllm]')")
pytestmark = pytest.mark.vllm

KEYS = 10  # the full preset's
CONFIG = CaptureConfig(
    max_new_tokens=14, max_context=128, attention_keys=KEYS, lookback_attention=True
)
ATTENTION_TOL = dict(rtol=1e-4, atol=1e-5)
LONG = " ".join(["one two three four five six"] * 8)  # 48 tokens: two prefill chunks
PROMPTS = ["what is the capital of the river", "red blue", LONG]


def tiny_qwen2(vocab_size: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def tiny(family: str, vocab_size: int):
    if family == "qwen2":
        return tiny_qwen2(vocab_size)
    return make_tiny_llama(vocab_size, layers=2, head_dim=32)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family_engine(request, word_tokenizer, tmp_path_factory):
    """(family, transformers model, vLLM engine over the same weights)."""
    from actmap.capture.vllm_engine import VllmCapture, VllmOptions

    family = request.param
    model = tiny(family, len(word_tokenizer))
    folder = tmp_path_factory.mktemp(f"tiny-{family}")
    model.save_pretrained(folder)
    word_tokenizer.save_pretrained(folder)
    options = VllmOptions(max_num_seqs=8, max_num_batched_tokens=32, block_size=32, num_kv_blocks=6)
    engine = VllmCapture(str(folder), options=options, max_context=128)
    # transformers reads a qwen2 folder's tokenizer as Qwen2's BPE; the word tokenizer is the
    # one the model and the reference use (vLLM itself reads only token ids here)
    engine.tokenizer = word_tokenizer
    yield family, model, engine
    engine.close()


def assert_same_attention(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.attention.shape == w.attention.shape == (w.n_tokens, 2, 4, KEYS)
        torch.testing.assert_close(g.attention, w.attention, **ATTENTION_TOL)
        torch.testing.assert_close(g.trajectory, w.trajectory, rtol=1e-4, atol=1e-4)


def test_batch_of_different_prompt_lengths_equals_transformers(family_engine, word_tokenizer):
    family, model, engine = family_engine
    got = engine.generate(PROMPTS, CONFIG)
    want = generate_batch(model, word_tokenizer, PROMPTS, CONFIG)
    assert len({g.prompt_tokens for g in got}) == 3
    assert max(g.n_tokens for g in got) > KEYS  # an answer longer than K
    long = next(w for w in want if w.n_tokens > KEYS)
    assert (long.attention[KEYS + 1 :] > 0).all()  # every key kept is a generated token
    assert (long.attention[0] == 0).all() and (long.attention[3, :, :, 3:] == 0).all()
    assert_same_attention(got, want)


def test_preempted_requests_keep_their_attention(family_engine, word_tokenizer, monkeypatch):
    """Eight requests of two cache blocks each share six: vLLM preempts and recomputes some
    (a recompute prefills prompt + answer; its new row's keys include the ones it rewrote).
    Each layer's logits are normalised as soon as they are read (a budget of one byte), as
    a long context's are, not with the step's other layers."""
    from actmap.capture import vllm_attention

    family, model, engine = family_engine
    if family != "llama":
        pytest.skip("one family is enough for the scheduler's cases")
    monkeypatch.setattr(vllm_attention, "LOGITS_BUDGET", 1)
    weighed = []
    original = vllm_attention.AttentionTap._weigh

    def counted(self):
        weighed.append(len(self._logits))
        return original(self)

    monkeypatch.setattr(vllm_attention.AttentionTap, "_weigh", counted)
    words = "what is the capital of the river and the city how many days".split()
    prompts = [" ".join(words[i:] + words[:i] + words[:8]) for i in range(8)]  # 22 tokens
    before = engine.recorder.recomputed
    got = engine.generate(prompts, CONFIG)
    assert engine.recorder.recomputed > before, "no request was preempted"
    assert max(weighed) == 1  # one layer at a time
    assert_same_attention(got, generate_batch(model, word_tokenizer, prompts, CONFIG))


def test_cli_capture_writes_the_local_engines_attention_table(family_engine, tmp_path, monkeypatch):
    """`actmap capture --engine vllm --attention-keys 10 --lookback-attention` writes the
    attention side table `--engine local` writes for the same prompts (the module's engine
    stands in for the one the command would build: one engine per process)."""
    import json

    from typer.testing import CliRunner

    import actmap.capture.vllm_engine as vllm_engine
    from actmap.cli import app
    from actmap.store import MapStore

    family, model, engine = family_engine
    if family != "llama":
        pytest.skip("the store path does not depend on the family")
    monkeypatch.setattr(vllm_engine, "VllmCapture", lambda *args, **kwargs: engine)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    common = [
        "capture", "--prompts", str(prompts), "--model", engine.source.path,
        "--max-new-tokens", str(CONFIG.max_new_tokens), "--batch-size", "3",
        "--attention-keys", str(KEYS), "--lookback-attention",
    ]  # fmt: skip
    stores = {}
    for name in ("vllm", "local"):
        result = CliRunner().invoke(app, [*common, "--engine", name, "--out", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        stores[name] = MapStore.open(tmp_path / name)
    assert stores["vllm"].manifest["runs"][-1]["engine"]["name"] == "vllm"
    ids = sorted(stores["local"].ids())
    assert len(ids) == 3 and sorted(stores["vllm"].ids()) == ids
    got = stores["vllm"].read_arrays("attention", ids)
    want = stores["local"].read_arrays("attention", ids)
    assert max(w.shape[0] for w in want.values()) > KEYS
    for key in ids:
        assert got[key].shape == want[key].shape and want[key].shape[1:] == (2, 4, KEYS)
        np.testing.assert_allclose(got[key].astype(np.float32), want[key].astype(np.float32),
                                   atol=1e-3)  # fmt: skip


def test_full_preset_scores_vllm_rows_as_transformers_rows(family_engine, word_tokenizer):
    """An actmap-plus:full fit (map, scalars, position probes, RAUQ and TAD blocks) gives the
    same p(correct) from either engine's rows; without the attention it would not. The fit
    is trained on transformers rows of the same model, labelled by an attention feature (the
    mean weight of layer 0, head 0 to the previous token), so its score leans on attention."""
    from dataclasses import replace

    from conftest import WORDS

    from actmap.capture.answer_scalars import answer_scalars
    from actmap.detectors import live_inputs
    from actmap.detectors.stacked import StackConfig, StackedPlus
    from actmap.maps import build_map, stored_form

    family, model, engine = family_engine
    if family != "llama":
        pytest.skip("one family is enough for the detector")
    config = CaptureConfig(**{**CONFIG.__dict__, "keep_positions": True, "batch_size": 50})

    def inputs(gens):
        maps = np.stack([stored_form(build_map(g.trajectory)) for g in gens])
        scalars = np.stack([answer_scalars(g.logprobs, g.entropies) for g in gens])
        return live_inputs(maps, scalars, gens)

    rng = np.random.default_rng(0)
    prompts = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 12)))) for _ in range(100)]
    rows = [g for g in generate_batch(model, word_tokenizer, prompts, config) if g.n_tokens > 2]
    feature = np.array([g.attention[1:, 0, 0, 0].mean().item() for g in rows])
    y = (feature > np.median(feature)).astype(int)
    half = len(rows) * 2 // 3
    fit = StackedPlus(
        StackConfig(preset="full", map_components=8, tad_previous=KEYS, fallback=False)
    ).fit(inputs(rows[:half]), y[:half], inputs(rows[half:]), y[half:])
    assert "attention" in fit.requires

    got = engine.generate(PROMPTS, config)
    want = generate_batch(model, word_tokenizer, PROMPTS, config)
    from_vllm = fit.predict_proba(inputs(got))
    from_transformers = fit.predict_proba(inputs(want))
    np.testing.assert_allclose(from_vllm, from_transformers, atol=1e-3)
    blind = [replace(g, attention=torch.zeros_like(g.attention)) for g in got]
    assert np.abs(fit.predict_proba(inputs(blind)) - from_vllm).max() > 1e-2  # reads attention


# -- the pieces, without an engine ------------------------------------------------------------
@pytest.mark.parametrize(("block", "bag"), [(32, 64), (64, 64), (64, 16)])
@pytest.mark.parametrize(
    ("isa", "dtype"),
    [("vec", torch.float32), ("vec16", torch.float32), ("amx", torch.bfloat16)],
)
def test_keys_read_from_the_cache_as_vllm_wrote_them(isa, dtype, block, bag, monkeypatch):
    """`key_blocks` reads back the keys vLLM's CPU cache writer stored, and the lookback
    weights from `bag_logits` (in place) and `gathered_logits` equal a naive per-row loop (GQA: query head h reads key head
    h // G); ``bag``: the most positions an in-place read's row covers (16: several chunks a
    block, as a 128-position block has with the default 64)."""
    from vllm import _custom_ops as ops

    from actmap.capture import vllm_attention

    if dtype != torch.float32 and bag != 64:
        pytest.skip("bfloat16 keys are gathered: the in-place read's width does not apply")
    monkeypatch.setattr(vllm_attention, "BAG_WIDTH", bag)

    from actmap.capture.vllm_attention import (
        _CPU_KEY_PACKING,
        bag_index,
        bag_logits,
        bag_readable,
        bag_width,
        gather_key_blocks,
        gathered_logits,
        key_blocks,
        lookback_from_logits,
    )

    torch.manual_seed(0)
    n_blocks, kv_heads, heads, dim, keys = 5, 2, 4, 32, 4
    layers = torch.zeros(2, n_blocks, kv_heads, block, 2 * dim, dtype=dtype)  # two layers
    cache = layers[0]
    key_cache, value_cache = cache.view(n_blocks, kv_heads, 2 * block, dim).chunk(2, dim=2)
    table = torch.tensor([[3, 0, 4], [1, 2, 0]], dtype=torch.int32)  # two requests
    lengths = [70, 40]
    slots, written = [], []
    for r, length in enumerate(lengths):
        for p in range(length):
            slots.append(int(table[r, p // block]) * block + p % block)
    written = torch.randn(len(slots), kv_heads, dim).to(dtype)
    try:
        ops.cpu_attn_reshape_and_cache(
            written, torch.randn_like(written), key_cache, value_cache,
            torch.tensor(slots, dtype=torch.long), isa,
        )  # fmt: skip
        other_keys, other_values = layers[1].view(n_blocks, kv_heads, 2 * block, dim).chunk(2, 2)
        ops.cpu_attn_reshape_and_cache(
            torch.randn_like(written), torch.randn_like(written), other_keys, other_values,
            torch.tensor(slots, dtype=torch.long), isa,
        )  # fmt: skip
    except RuntimeError as error:
        pytest.skip(f"this CPU's vLLM build has no {isa} kernel: {error}")
    packing = _CPU_KEY_PACKING[isa]
    tile = packing[0] or block
    view = key_blocks(cache, packing)  # (blocks, KV, block / tile, d / per, tile, per)
    for i, slot in enumerate(slots):
        at = slot % block
        read = view[slot // block, :, at // tile, :, at % tile, :].reshape(kv_heads, dim)
        assert torch.equal(read, written[i])
    # rows: request 0 at position 69 (row 9) and 35, request 1 at position 39 (row 2)
    batch, positions, rows = [0, 0, 1], [69, 35, 39], [9, 1, 2]
    query = torch.randn(3, heads, dim).to(dtype)
    tables = table.index_select(0, torch.tensor(batch))[:, : 69 // block + 1].long()
    # float32 in the transposed layout is read in place (`bag_logits`), bfloat16 tiles are
    # gathered: both equal the naive loop, over the whole blocks and over positions 0..69
    assert bag_readable(cache, packing) == (dtype == torch.float32)

    def in_place(query, cache, tables, packing, scale, keep):
        return bag_logits(query, cache, *bag_index(tables, cache.shape, heads, keep), scale)

    def own_chunks(query, cache, tables, packing, scale, keep):  # a row's own chunks only
        index = bag_index(tables, cache.shape, heads, keep, torch.tensor(positions))
        return bag_logits(query, cache, *index, scale)

    def from_the_step(query, cache, tables, packing, scale, keep):  # rows among 5 tokens
        tokens = torch.tensor([4, 0, 2])
        step = torch.randn(5, heads, dim).to(query.dtype)
        step[tokens] = query
        index = bag_index(tables, cache.shape, heads, keep, torch.tensor(positions), tokens)
        return bag_logits(step, cache, *index, scale, (len(tokens), heads))

    readings = [(gathered_logits, None), (gathered_logits, 70)]
    if bag_readable(cache, packing):
        readings += [(in_place, None), (in_place, 70), (own_chunks, 70), (from_the_step, 70)]
    for read, keep in readings:
        logits = read(query, cache, tables, packing, 0.125, keep)
        if keep is not None and read is not gathered_logits:  # whole chunks of positions
            assert logits.shape[-1] == -(-keep // bag_width(block)) * bag_width(block)
        got = lookback_from_logits(
            logits, torch.tensor(positions), torch.tensor([min(r, keys) for r in rows]), keys
        )
        start = [0, sum(lengths[:1])]
        for m, (r, p, row) in enumerate(zip(batch, positions, rows, strict=True)):
            own = written[start[r] : start[r] + p + 1].float()  # keys of positions 0..p
            for h in range(heads):
                z = own[:, h // (heads // kv_heads)] @ query[m, h].float() * 0.125
                w = torch.softmax(z, dim=0)
                want = torch.zeros(keys)
                for k in range(1, min(row, keys) + 1):
                    want[k - 1] = w[p + 1 - k]
                torch.testing.assert_close(got[m, h], want, rtol=1e-5, atol=1e-7)
    # the fast gather (contiguous runs) reads what indexing the view reads, in both layers
    for cache in layers:
        torch.testing.assert_close(
            gather_key_blocks(cache, tables, packing), key_blocks(cache, packing)[tables],
            rtol=0, atol=0,
        )  # fmt: skip
    # rows within one block read only its first `keep` positions (rounded up to whole tiles):
    # the same logits as reading the whole block, on those positions; the same weights
    one = table[:, :1].long()  # request 0 at position 19, request 1 at 9: block 0 of each
    near, keep = torch.tensor([19, 9]), 20
    whole = gathered_logits(query[:2], layers[0], one, packing, 0.125)
    short = gathered_logits(query[:2], layers[0], one, packing, 0.125, keep=keep)
    assert keep <= short.shape[-1] <= whole.shape[-1] == block
    assert short.shape[-1] == (keep if packing[0] is None else -(-keep // tile) * tile)
    torch.testing.assert_close(short, whole[..., : short.shape[-1]], rtol=1e-5, atol=1e-5)
    takes = torch.tensor([keys, keys])
    torch.testing.assert_close(
        lookback_from_logits(short, near, takes, keys),
        lookback_from_logits(whole, near, takes, keys), rtol=1e-5, atol=1e-7,
    )  # fmt: skip


def test_what_cannot_be_read_is_refused_by_name(tmp_path):
    import json

    from actmap.capture.vllm_attention import attention_problem
    from actmap.serve.vllm_launch import model_type

    # the launcher reads the family from the folder before vLLM loads it
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert model_type(str(tmp_path)) == "llama"
    both = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}
    (tmp_path / "config.json").write_text(json.dumps(both))
    assert model_type(str(tmp_path)) == "gemma3_text"
    assert model_type(str(tmp_path / "absent")) is None

    def config(family):
        return SimpleNamespace(hf_text_config=SimpleNamespace(model_type=family))

    assert "not 'gpt2'" in attention_problem(SimpleNamespace(), config("gpt2"))
    parallel = SimpleNamespace(tensor_parallel_size=2)
    assert "tensor_parallel_size=1" in attention_problem(
        SimpleNamespace(), config("llama"), parallel
    )
    assert "without actmap's attention points" in attention_problem(
        SimpleNamespace(_actmap_attention=None), config("qwen2")
    )


def test_the_plugins_worker_sends_the_same_attention(family_engine, word_tokenizer):
    """A second `ActmapWorker` over the same vLLM runner, configured as the API server
    configures it for an actmap-plus:full run (its settings, not a request's: the ids are
    vLLM's API server's): the rows it sends become the transformers capture's attention. The
    engine's own worker stops recording meanwhile."""
    from vllm import SamplingParams

    from actmap.capture.vllm_rows import generation_from_payload
    from actmap.capture.vllm_worker import ActmapWorker

    family, model, engine = family_engine
    if family != "llama":
        pytest.skip("one family is enough for the worker")
    runner = engine.recorder.runner
    execute = runner.__dict__["execute_model"]  # the engine's worker's wrapper
    worker = ActmapWorker()
    worker.model_runner, worker.rank = runner, 0
    engine.set_recording(False)
    try:
        info = worker.actmap_configure(
            {"greybox": True, "keep_positions": False, "attention_keys": KEYS, "push": False}
        )
        assert info["recording"] and info["rows_address"] is None  # "push": false: RPC only
        params = SamplingParams(
            max_tokens=CONFIG.max_new_tokens, temperature=0.0, stop_token_ids=[1],
            logprobs=0, detokenize=False,
        )  # fmt: skip
        ids = engine.encode(PROMPTS, CONFIG)
        for i, prompt_ids in enumerate(ids):
            engine.engine.add_request(f"cmpl-base{i}-0000000{i}", {"prompt_token_ids": prompt_ids},
                                      params)  # fmt: skip
        while engine.engine.has_unfinished_requests():
            engine.engine.step()
        got = []
        for i in range(len(PROMPTS)):
            (item,) = worker.actmap_take([f"base{i}"])
            got.append(generation_from_payload(item, word_tokenizer, {1}))
    finally:
        worker.actmap_close()
        runner.execute_model = execute
        engine.set_recording(True)
    assert_same_attention(got, generate_batch(model, word_tokenizer, PROMPTS, CONFIG))


def test_a_teacher_forced_reading_refuses_attention_by_name(family_engine):
    from actmap.errors import ActmapUserError

    family, model, engine = family_engine
    if family != "llama":
        pytest.skip("one family is enough")
    with pytest.raises(ActmapUserError, match="teacher-forced reading.*attention_keys"):
        engine.submit_read("what is", "the", CONFIG)
