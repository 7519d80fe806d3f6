"""P(True) prompt and target variants on a store's balanced test rows (read only).

    python scripts/ptrue_variants.py STORE

Two forward passes of the store's generator per row set (chat template where the tokenizer
has one, and the plain prompt), then, from the same log-probabilities, the AUROC [95%
bootstrap interval] of P(target) for "True", " True", "A", " A" and of the normalised
P(True) / (P(True) + P(False)). Seconds per answer are printed too (one CPU thread unless
OMP_NUM_THREADS says otherwise).
"""

from __future__ import annotations

import argparse
import time

import torch

from actmap.baselines.inputs import StoreInputs
from actmap.baselines.options import BaselineOptions
from actmap.baselines.ptrue import PTrue, last_token_logprobs, left_pad
from actmap.scoring.intervals import bootstrap
from actmap.store import MapStore
from actmap.store.rows import balanced_splits


def one_token(tokenizer, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    store = MapStore.open(args.store)
    splits = balanced_splits(store, persist=False)  # nothing is written into the store
    inputs = StoreInputs(store, BaselineOptions(device="cpu"), splits)
    ids = splits["test"]
    rows, labels = inputs.verification(ids), inputs.labels(ids)
    model, tokenizer = inputs.generator()
    chat = tokenizer.chat_template is not None
    print(f"{args.store}: {len(labels)} balanced test rows, chat template {chat}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for use_chat in [True, False] if chat else [False]:
        scorer = PTrue(model, tokenizer, use_chat=use_chat)
        start, parts = time.perf_counter(), []
        for i in range(0, len(rows), args.batch):
            batch, mask = left_pad([scorer.encode(r) for r in rows[i : i + args.batch]], pad)
            parts.append(last_token_logprobs(model, batch, mask))
        logp = torch.cat(parts).double()
        seconds = time.perf_counter() - start
        print(f"chat={use_chat}: {1000 * seconds / len(rows):.0f} ms per answer")
        for target in ("True", " True", "A", " A"):
            tid = one_token(tokenizer, target)
            if tid is not None:
                p = logp[:, tid].exp().numpy()
                print(f"  P({target!r}): mean {p.mean():.4f}, AUROC {bootstrap(p, labels)}")
        for yes, no in (("True", "False"), (" True", " False")):
            t, f = one_token(tokenizer, yes), one_token(tokenizer, no)
            if t is not None and f is not None:
                p = (logp[:, t] - torch.logaddexp(logp[:, t], logp[:, f])).exp().numpy()
                print(f"  P({yes!r}) normalised: mean {p.mean():.3f}, AUROC {bootstrap(p, labels)}")


if __name__ == "__main__":
    main()
