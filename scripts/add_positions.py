"""Add position states (`actmap.capture.positions`) to a copy of a store, by one teacher-forced
pass per stored answer: prefill only, the stored prompt and the stored answer token ids, so the
tokens are the same by construction (as `actmap capture --answers` reads answers).

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/add_positions.py \
        --source stores/qwen-1.5b-triviaqa-bf16 \
        --out stores/qwen-1.5b-triviaqa-bf16-pos \
        --model $(../shared/models/get-model qwen2.5-coder-1.5b-instruct) --dtype bfloat16

The source is only read. The copy's shards are hard links of the source's (copies where links
fail); each round first links the shards the source committed since (a capture still running
into it is fine: its committed rows are the ids in ``maps``), then writes a ``positions`` shard
per batch of rows that have none yet. Killed, it loses at most the batch in flight; rerun the
same command to resume (and to pick up rows the source gained). ``--rounds 0`` keeps
following the source until it stops growing and every row has its positions.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import torch

from actmap.capture.forced import capture_answers_batch
from actmap.capture.records import CaptureConfig
from actmap.llm.models import load_model
from actmap.reproduce import link_copy
from actmap.store import MapStore, encode_array
from actmap.store.lock import holder_is_writing

log = logging.getLogger("add_positions")
DERIVED = ("positions", "splits")  # the copy's own tables, never taken from the source


def sync(source: Path, out: Path) -> MapStore:
    """The copy at ``out``, holding every shard the source has now."""
    if not (out / "manifest.json").is_file():
        link_copy(source, out)
    copy = MapStore.open(out)
    copy.link_tables(
        MapStore.open(source),
        skip=lambda name: name in DERIVED or name.startswith("results"),
    )
    return copy


def todo(copy: MapStore) -> list[str]:
    done = copy.ids("positions") if copy.has_table("positions") else set()
    return sorted(copy.ids("maps") - done)


def capture_config(copy: MapStore, batch_size: int) -> CaptureConfig:
    """The store's own capture settings (context, special tokens), map-only, positions kept."""
    stored = dict(copy.manifest["config"]["capture"])
    stored["stop_strings"] = tuple(stored.get("stop_strings") or ())
    known = {f for f in CaptureConfig.__dataclass_fields__}
    config = CaptureConfig(**{k: v for k, v in stored.items() if k in known})
    return replace(
        config,
        attention_keys=0,
        keep_dense=False,
        greybox=False,  # the store's share_prefix is kept: the few-shot block runs once a batch
        keep_positions=True,
        batch_size=batch_size,
    )


def add_batch(model, tokenizer, copy: MapStore, ids: list[str], config: CaptureConfig) -> float:
    """Positions of ``ids`` written as one shard; returns the seconds of the forward pass."""
    meta = copy.metadata().set_index("id").loc[ids]
    gens = copy.read_latest("generations", ["token_ids", "prompt_tokens"], ids=ids)
    index = {k: i for i, k in enumerate(gens.column("id").to_pylist())}
    answers = [gens.column("token_ids")[index[k]].as_py() for k in ids]
    prompts = meta["prompt"].tolist()
    tick = time.perf_counter()
    records = capture_answers_batch(model, tokenizer, prompts, answers, config)
    seconds = time.perf_counter() - tick
    for key, record, ids_ in zip(ids, records, answers, strict=True):
        stored = gens.column("prompt_tokens")[index[key]].as_py()
        if record.token_ids != ids_ or record.prompt_tokens != stored:
            raise SystemExit(
                f"{key}: the teacher-forced pass read other tokens than the capture "
                f"(prompt {record.prompt_tokens} vs {stored} tokens)"
            )
    table = pa.table(
        {
            "id": ids,
            "shape": pa.array([list(r.positions.shape) for r in records], pa.list_(pa.int32())),
            "positions": [encode_array(r.positions.float().numpy()) for r in records],
        }
    )
    copy.write_table("positions", table)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", required=True, help="The store's generator (path or hub id).")
    parser.add_argument("--dtype", default=None, help="Default: the store's recorded dtype.")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="0 = follow the source.")
    parser.add_argument("--wait", type=float, default=300, help="Seconds between rounds.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    copy = sync(args.source, args.out)
    dtype = args.dtype or copy.manifest["config"]["model"].get("dtype", "float32")
    model, tokenizer, _ = load_model(args.model, device="cpu", dtype=dtype)
    config = capture_config(copy, args.batch_size)
    round_ = 0
    while True:
        round_ += 1
        copy = sync(args.source, args.out)
        left = todo(copy)
        log.info("round %d: %d rows without positions", round_, len(left))
        for start in range(0, len(left), args.batch_size):
            ids = left[start : start + args.batch_size]
            seconds = add_batch(model, tokenizer, copy, ids, config)
            log.info("%d/%d rows (%.1f s/row)", start + len(ids), len(left), seconds / len(ids))
        if args.rounds and round_ >= args.rounds:
            break
        if not left and not todo(sync(args.source, args.out)):
            if holder_is_writing(args.source) is None:  # the lock file stays after a writer
                break
        time.sleep(args.wait)
    copy.close()


if __name__ == "__main__":
    main()
