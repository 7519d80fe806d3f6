"""How far vLLM capture is from the transformers capture: max differences over the same prompts.

Greedy SmolLM2 float32 chat answers (built-in arithmetic questions), all in flight together
on a small engine (128 tokens per step; a KV cache of 24 blocks of 32 tokens, so 32 requests
preempt), against `actmap.capture.generate_batch` on the same prompts. Prints, per batch
size: prompts with identical tokens, and the max absolute / relative difference of
trajectories, maps (12x32x128, float32), log-probs and entropies.

    OMP_NUM_THREADS=1 python benchmarks/check_vllm_equality.py --model <smollm2 gguf> --n 2,32

``--compiled`` builds the engine the way vLLM runs by default (its model compiled; on CPU,
Dynamo traced once and Inductor-compiled, which takes minutes on a few cores the first time).
"""

from __future__ import annotations

import argparse

import torch

from actmap.capture.generate import generate_batch
from actmap.capture.records import CaptureConfig
from actmap.capture.vllm_engine import VllmCapture, VllmOptions
from actmap.data.builtin import INSTRUCTION, make_questions
from actmap.llm.models import load_model
from actmap.maps import MapConfig, build_maps_from_list


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--n", default="2,32")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--compiled", action="store_true", help="vLLM's compiled model")
    args = parser.parse_args()
    options = VllmOptions(
        max_num_seqs=32, max_num_batched_tokens=128, block_size=32, num_kv_blocks=24,
        enforce_eager=not args.compiled,
    )  # fmt: skip
    engine = VllmCapture(args.model, options=options, max_context=512)
    model, tokenizer, _ = load_model(args.model)
    config = CaptureConfig(max_new_tokens=args.max_tokens, max_context=512)
    for n in (int(x) for x in args.n.split(",")):
        questions = [f"{q} {INSTRUCTION}" for q, _ in make_questions(n, seed=3)]
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            )
            for q in questions
        ]
        before = engine.recorder.recomputed
        got = engine.generate(prompts, config)
        want = generate_batch(model, tokenizer, prompts, config)
        same = [g.token_ids == w.token_ids for g, w in zip(got, want, strict=True)]
        pairs = [(g, w) for g, w, s in zip(got, want, same, strict=True) if s and w.n_tokens]

        def gap(a, b):
            d = (a - b).abs()
            return float(d.max()), float((d / b.abs().clamp_min(1e-3)).max()), float(b.abs().max())

        traj = [gap(g.trajectory, w.trajectory) for g, w in pairs]
        maps_g = build_maps_from_list([g.trajectory for g, _ in pairs], MapConfig())
        maps_w = build_maps_from_list([w.trajectory for _, w in pairs], MapConfig())
        lp = max(float((g.logprobs - w.logprobs).abs().max()) for g, w in pairs)
        ent = max(float((g.entropies - w.entropies).abs().max()) for g, w in pairs)
        print(
            f"{n} in flight ({engine.recorder.recomputed - before} recomputed request-steps): "
            f"identical tokens {sum(same)}/{n}; trajectory max |diff| "
            f"{max(t[0] for t in traj):.2e} (values up to {max(t[2] for t in traj):.0f}); "
            f"maps max |diff| {float((maps_g - maps_w).abs().max()):.2e} (values up to "
            f"{float(maps_w.abs().max()):.1f}); log-prob {lp:.2e}; entropy {ent:.2e}"
        )


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
