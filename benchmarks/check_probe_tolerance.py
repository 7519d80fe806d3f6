"""The figures behind the weights probe's dtype tolerances (`actmap.serve.upstream.PROBE_TOLERANCE`):
greedy answers of a running upstream (vLLM, ``--served-model-name smollm2``, in whatever dtype
it serves) to the probe's prompt and ``--n`` TriviaQA train questions, read teacher-forced by
SmolLM2 in float32 and in bfloat16 here; then the same answers read by copies of the weights
with relative Gaussian noise (other checkpoints of the same architecture), in bfloat16.

For each reading: the largest log-prob difference over the answer's tokens (against the
upstream's own log-probs) and the largest margin (how far below the local greedy token the
upstream's token lies), on the probe's prompt and over all prompts.

    python benchmarks/check_probe_tolerance.py --upstream http://127.0.0.1:8001 --n 30
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="base URL (no /v1)")
    parser.add_argument("--n", type=int, default=30, help="TriviaQA train questions")
    parser.add_argument("--noise", default="0.002,0.005,0.01,0.02,0.05")
    args = parser.parse_args()

    import torch
    from bench_proxy import MODEL, SERVED, questions

    from actmap.llm.models import load_model
    from actmap.serve.upstream import PROBE_MESSAGES, PROBE_TOKENS

    torch.set_num_threads(1)
    prompts = [PROBE_MESSAGES[0]["content"], *questions(args.n)]
    answers = []
    for content in prompts:
        body = {"model": SERVED, "messages": [{"role": "user", "content": content}],
                "max_tokens": PROBE_TOKENS, "temperature": 0, "logprobs": True,
                "return_token_ids": True}  # fmt: skip
        out = httpx.post(args.upstream + "/v1/chat/completions", json=body, timeout=600).json()
        choice = out["choices"][0]
        theirs = [c["logprob"] for c in choice["logprobs"]["content"]]
        answers.append((out["prompt_token_ids"], choice["token_ids"], theirs))

    def read(model) -> np.ndarray:
        """(prompts, 2): largest log-prob difference and largest margin of each answer."""
        rows = []
        for prompt, answer, theirs in answers:
            ids = torch.tensor([prompt + answer])
            with torch.inference_mode():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            logp = torch.log_softmax(logits.float(), -1)
            chosen = logp.gather(-1, torch.tensor(answer)[:, None])[:, 0]
            diff = (chosen - torch.tensor(theirs[: len(answer)])).abs().max()
            rows.append((float(diff), float((logp.max(-1).values - chosen).max())))
        return np.array(rows)

    def line(name: str, r: np.ndarray) -> None:
        print(f"{name:>26}: probe prompt diff {r[0, 0]:.4f} margin {r[0, 1]:.4f} | "
              f"{len(r)} prompts: max diff {r[:, 0].max():.4f}, median {np.median(r[:, 0]):.4f}, "
              f"max margin {r[:, 1].max():.4f}")  # fmt: skip

    for dtype in ("float32", "bfloat16"):
        line(f"same weights, {dtype}", read(load_model(MODEL, dtype=dtype)[0]))
    for scale in (float(s) for s in args.noise.split(",")):
        model = load_model(MODEL, dtype="float32")[0]
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * p.float().std() * scale)
        line(f"{scale:.1%} noise, bfloat16", read(model.to(torch.bfloat16)))


if __name__ == "__main__":
    main()
