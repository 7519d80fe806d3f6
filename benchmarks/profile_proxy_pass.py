"""Where the proxy's teacher-forced pass spends its time, per dtype: the operator profile of
`score_answers` over a batch of real answers, the padding a batch reads, and passes split by
length (`length_groups`) against one pass per batch, in CPU time on one thread.

The answers come from a running OpenAI-compatible server that returns token ids (vLLM:
``--served-model-name smollm2``), as the proxy reads them:

    python benchmarks/profile_proxy_pass.py --upstream http://127.0.0.1:8001 --answers 64

CPU time on a shared machine still moves with load: ``uptime`` is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="base URL (no /v1)")
    parser.add_argument("--answers", type=int, default=64, help="TriviaQA train questions")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=2, help="A/B rounds, order alternating")
    args = parser.parse_args()

    import torch
    from bench_proxy import INSTRUCTION, MODEL, SERVED, questions
    from bench_serve import make_detector

    import actmap.serve.answers as answers_module
    from actmap.serve.answers import ScoreJob, chat_prefix, length_groups, score_answers
    from actmap.serve.app import ServeSettings, build_engine

    torch.set_num_threads(1)
    asked = questions(args.answers)
    answers = []
    for question in asked:
        body = {"model": SERVED, "messages": [{"role": "user", "content": INSTRUCTION.format(question)}],
                "max_tokens": args.max_tokens, "temperature": 0, "return_token_ids": True}  # fmt: skip
        out = httpx.post(args.upstream + "/v1/chat/completions", json=body, timeout=600).json()
        answers.append(out["choices"][0]["token_ids"])
    work = Path(tempfile.mkdtemp(prefix="profile-pass-"))
    one_pass = lambda lengths, pass_tokens=0: [list(range(len(lengths)))]  # noqa: E731
    for dtype in args.dtypes.split(","):
        run = make_detector(work / dtype, dtype)
        engine = build_engine(ServeSettings(model=MODEL, detector=run))  # reads in `dtype`
        prefix = chat_prefix(engine)
        prompts = [engine.render_chat([{"role": "user", "content": INSTRUCTION.format(q)}]) for q in asked]  # fmt: skip
        ids = [answers_module.strip_end_tokens(engine, a) for a in answers]
        batches = [
            [ScoreJob(p, a) for p, a in zip(prompts[i : i + args.batch], ids[i : i + args.batch], strict=True)]
            for i in range(0, len(prompts), args.batch)
        ]  # fmt: skip
        shared = 0 if prefix is None else len(prefix.ids)
        real = padded = 0
        groups = []
        for jobs in batches:
            lengths = [(engine.count_tokens(j.prompt) - shared, len(j.answer)) for j in jobs]
            real += sum(p + a for p, a in lengths)
            padded += len(lengths) * (max(p for p, _ in lengths) + max(a for _, a in lengths))
            groups.append([len(g) for g in length_groups(lengths)])
        score_answers(engine, batches[0][:2], prefix)  # warm
        cpu = {"one pass": 0.0, "length groups": 0.0}
        for round_ in range(args.repeats):
            arms = [("one pass", one_pass), ("length groups", length_groups)]
            for name, grouping in arms if round_ % 2 == 0 else arms[::-1]:
                answers_module.length_groups = grouping
                started = time.process_time()
                for jobs in batches:
                    score_answers(engine, [ScoreJob(j.prompt, j.answer) for j in jobs], prefix)
                cpu[name] += time.process_time() - started
        answers_module.length_groups = length_groups
        with torch.profiler.profile() as profile:
            score_answers(engine, [ScoreJob(j.prompt, j.answer) for j in batches[0]], prefix)
        table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        n = len(prompts) * args.repeats
        print(f"\n== {dtype}: {len(prompts)} answers in batches of {args.batch}, chat prefix "
              f"{shared} tokens; tokens read {real} real, {padded} padded; passes per batch "
              f"{groups}")  # fmt: skip
        print(json.dumps({k: f"{1000 * v / n:.1f} cpu ms/answer" for k, v in cpu.items()}))
        print(table)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
