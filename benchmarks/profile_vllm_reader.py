"""Where the proxy's ``--reader vllm`` spends its CPU: `InProcessReader` on TriviaQA prompts, its
readings sharing cached prompt blocks and (alternating, for comparison) each with a cache salt of
its own, split into vLLM's forward, the rest of vLLM's engine step, taking the rows and scoring.

No servers: the reader alone, in this process, one thread, ``--batch`` readings at a time
(the proxy's scoring batches hold 2-3 answers at 16 concurrent). The answers are a few words
(the question's first words, as token ids), like the few-word answers of
``benchmarks/bench_proxy.py``; the detector is `bench_serve.make_detector`'s (map-only).

    OMP_NUM_THREADS=1 python benchmarks/profile_vllm_reader.py --answers 48 --batch 3
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(counts: collections.Counter, obj, name: str, label: str) -> None:
    """Wrap ``obj.name`` so that its CPU seconds add up in ``counts[label]``."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        started = time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            counts[label] += time.process_time() - started

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=48, help="TriviaQA train questions")
    parser.add_argument("--batch", type=int, default=3, help="readings per reader call")
    parser.add_argument("--rounds", type=int, default=2, help="A/B rounds (own salt, shared)")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    import torch
    from bench_proxy import INSTRUCTIONS, MODEL, questions
    from bench_serve import make_detector

    from actmap.llm.models import load_model
    from actmap.serve.answers import ScoreJob
    from actmap.serve.app import ServeSettings, build_engine
    from actmap.serve.vllm_reader import InProcessReader

    torch.set_num_threads(1)
    _, tokenizer, _ = load_model(MODEL)
    asked = questions(args.answers)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": INSTRUCTIONS["short"].format(q)}],
            add_generation_prompt=True, tokenize=False,
        )
        for q in asked
    ]  # fmt: skip
    answers = [tokenizer(" ".join(q.split()[:3]), add_special_tokens=False)["input_ids"][:8]
               for q in asked]  # fmt: skip
    run = make_detector(Path(tempfile.mkdtemp(prefix="profile-reader-")) / "run", args.dtype)
    settings = ServeSettings(model=MODEL, detector=run, dtype=args.dtype)
    engine = build_engine(settings)
    reader = InProcessReader.build(settings, engine, args.dtype)
    capture = reader.capture
    counts: collections.Counter = collections.Counter()
    timed(counts, capture.recorder.runner, "_model_forward", "forward")
    timed(counts, capture.engine, "step", "engine step")
    timed(counts, capture, "_rows", "taking the rows")
    timed(counts, engine, "score", "scoring")
    shared = reader.salt
    try:
        reader([ScoreJob(prompts[0], answers[0])])  # warm
        for _ in range(args.rounds):
            for salt, name in ((None, "a salt per reading"), (shared, "shared prompt blocks")):
                reader.salt = salt
                capture.llm.reset_prefix_cache()
                counts.clear()
                started = time.process_time()
                for i in range(0, len(prompts), args.batch):
                    pairs = zip(prompts[i : i + args.batch], answers[i : i + args.batch], strict=True)  # fmt: skip
                    reader([ScoreJob(p, a) for p, a in pairs])
                total = time.process_time() - started
                parts = {k: round(1000 * v / len(prompts), 1) for k, v in counts.items()}
                parts["engine step, rest"] = round(parts["engine step"] - parts["forward"], 1)
                print(f"{name:>22}: {1000 * total / len(prompts):.1f} CPU ms per answer "
                      f"(batches of {args.batch}); of which {parts}", flush=True)  # fmt: skip
    finally:
        reader.close()


if __name__ == "__main__":
    main()
