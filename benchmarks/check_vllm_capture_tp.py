"""`VllmCapture` with tensor parallel against the transformers capture of the same weights.

The capture records in the vLLM plugin's worker (`actmap.capture.vllm_worker`); with
``tensor_parallel_size=2`` vLLM starts two worker processes and rank 0 records (every layer's
residual stream after its all-reduce is the same on each rank). This builds a small random
llama (2 layers, hidden 128, 4 query heads on 2 key/value heads: divisible across 2 ranks;
SmolLM2's tokenizer and vocabulary), starts `VllmCapture` at ``--tp`` ranks and compares, for
generated answers (grey-box; map-only with position states) and for teacher-forced readings:
tokens, trajectories, log-probs, entropies and position states, against
`actmap.capture.generate_batch` / `capture_answers`; then an abort leaves nothing in flight.
Exits non-zero on a difference past float32 rounding.

    VLLM_CPU_OMP_THREADS_BIND="0|1" OMP_NUM_THREADS=1 python benchmarks/check_vllm_capture_tp.py

(On this CPU build each rank needs a thread binding; a script, not stdin: vLLM spawns the
workers.)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

PROMPTS = ["What is the capital of France?", "Name a colour.", "Count: one, two,"]
ANSWERS = ["Paris is the capital.", "Blue.", " three, four"]


def tiny_folder(out: str) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from actmap.capture.vllm_engine import vllm_model_folder

    tokenizer = AutoTokenizer.from_pretrained(vllm_model_folder("smollm2-135m-instruct")[0])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def compare(got, want, what: str) -> None:
    worst = {"trajectory": 0.0, "logprobs": 0.0, "entropies": 0.0, "positions": 0.0}
    for g, w in zip(got, want, strict=True):
        if g.token_ids != w.token_ids:
            raise SystemExit(f"{what}: tokens differ: {g.token_ids} vs {w.token_ids}")
        for name in worst:
            a, b = getattr(g, name), getattr(w, name)
            if (a is None) != (b is None):
                raise SystemExit(f"{what}: {name} kept by one capture only")
            if a is not None and a.numel():
                worst[name] = max(worst[name], float((a.float() - b.float()).abs().max()))
    print(f"{what}: tokens identical; max abs differences "
          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))  # fmt: skip
    limits = {"trajectory": 1e-3, "logprobs": 1e-4, "entropies": 1e-4, "positions": 2e-3}
    if any(worst[k] > limits[k] for k in worst):
        raise SystemExit(f"{what}: past the limits {limits}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=12)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actmap.capture.forced import capture_answers
    from actmap.capture.generate import generate_batch
    from actmap.capture.records import CaptureConfig
    from actmap.capture.vllm_engine import VllmCapture, VllmOptions

    torch.set_num_threads(1)
    if (
        args.tp > 1
        and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
        and not torch.cuda.is_available()
    ):
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(args.tp))
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_folder(tmp)
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        started = time.perf_counter()
        options = VllmOptions(max_num_seqs=8, engine_args={"tensor_parallel_size": args.tp})
        engine = VllmCapture(folder, options=options, max_context=256)
        print(f"VllmCapture at tensor_parallel_size={args.tp}: started in "
              f"{time.perf_counter() - started:.1f} s")  # fmt: skip
        try:
            for config in (
                CaptureConfig(max_new_tokens=args.max_tokens, max_context=256),
                CaptureConfig(max_new_tokens=args.max_tokens, max_context=256, greybox=False,
                              keep_positions=True),
            ):  # fmt: skip
                got = engine.generate(PROMPTS, config)
                want = generate_batch(model, tokenizer, PROMPTS, config)
                compare(got, want, f"generate (greybox={config.greybox}, "
                                   f"keep_positions={config.keep_positions})")  # fmt: skip
            config = CaptureConfig(max_context=256)
            got = engine.read(PROMPTS, ANSWERS, config)
            want = [capture_answers(model, tokenizer, [p], [a], config)[0]
                    for p, a in zip(PROMPTS, ANSWERS, strict=True)]  # fmt: skip
            compare(got, want, "teacher-forced reading")
            key = engine.submit(PROMPTS[0], config)
            engine.step()
            engine.step()
            engine.abort(key)
            while engine.engine.has_unfinished_requests():
                engine.step()
            if engine.busy:
                raise SystemExit("an aborted request is still in flight")
            print("abort: nothing left in flight")
        finally:
            engine.close()


if __name__ == "__main__":
    main()
