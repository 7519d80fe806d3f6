"""Tensor parallel 2 against 1 with the actmap plugin in vLLM's own server: the same maps?

Starts ``python -m vllm.entrypoints.openai.api_server`` with the plugin twice, one after the
other (TP=1, then TP=2 with one core per rank: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``), asks both
the same greedy chat questions, and compares what the audit stores hold for every answer whose
tokens are the same under both (bfloat16 reductions summed in another order may turn a greedy
answer another way; those answers are counted, not compared). Printed: answers compared, the
largest map difference relative to the map's largest value, the largest p(correct) difference,
and each setting's difference to the same answers read by teacher forcing in transformers at
the same dtype (the noise a single device already has). Issue 54 item 2 (the maps of TP=2
equal TP=1's; the throughput ratio to plain TP=2 is `bench_vllm_plugin.py --vllm-args
"--tensor-parallel-size 2"` with the same binding).

    OMP_NUM_THREADS=1 python benchmarks/check_vllm_tp.py --model \\
        $(../shared/models/get-model qwen2.5-coder-0.5b-instruct) \\
        --dtype bfloat16 --questions 16 --out runs/check-vllm-tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import free_port, make_detector, questions  # noqa: E402
from bench_vllm import SRC, stop_server, wait  # noqa: E402
from bench_vllm_plugin import PLUGIN  # noqa: E402


def answers(args, folder: str, tp: int, audit: Path, prompts: list[str]) -> dict:
    """{prompt index: (token ids, p_correct_raw, map)} from one plugin server at ``tp``."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": SRC, "VLLM_CPU_KVCACHE_SPACE": "2"}
    if tp == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    settings = {"actmap": {"detector": str(args.detector), "audit": str(audit)}}
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
        "--served-model-name", "check", "--dtype", args.dtype, "--port", str(port),
        "--max-model-len", "1024", "--enforce-eager", "--tensor-parallel-size", str(tp),
        *PLUGIN, "--additional-config", json.dumps(settings),
    ]  # fmt: skip
    log_path = audit.parent / f"server-tp{tp}.log"
    out: dict = {}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            started = time.time()
            wait(process, base, "/health", log=log_path)
            print(f"TP={tp}: up in {time.time() - started:.0f} s", flush=True)
            for i, prompt in enumerate(prompts):
                reply = httpx.post(
                    f"{base}/v1/chat/completions",
                    json={"model": "check", "messages": [{"role": "user", "content": prompt}],
                          "max_tokens": args.max_tokens, "temperature": 0,
                          "return_token_ids": True},
                    timeout=600,
                ).json()  # fmt: skip
                choice = reply["choices"][0]
                block = choice.get("actmap") or reply["actmap"]
                out[i] = (choice["token_ids"], block["p_correct_raw"], block["map_id"])
        finally:
            stop_server(process)
    from actmap.store import MapStore

    stored = {}
    for batch, meta in MapStore.open(audit).iter_maps(batch_size=64, columns=("id",)):
        stored.update(zip(meta.column("id").to_pylist(), batch, strict=True))
    return {i: (ids, p, stored[key]) for i, (ids, p, key) in out.items()}


def reference_maps(folder: str, dtype: str, prompts: list[str], runs: dict) -> dict:
    """{prompt index: stored map} read by teacher forcing in transformers at ``dtype``: the
    single-device reference both tensor-parallel settings are measured against."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actmap.capture import CaptureConfig, capture_answers
    from actmap.maps import build_map, stored_form

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = {}
    for i, (ids, _, _) in runs.items():
        answer = [t for t in ids if t != tokenizer.eos_token_id]
        messages = [{"role": "user", "content": prompts[i]}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        config = CaptureConfig(max_new_tokens=len(answer) + 1, max_context=1024)
        (gen,) = capture_answers(model, tokenizer, [prompt], [answer], config)
        out[i] = stored_form(build_map(gen.trajectory))
    return out


def relative(a: np.ndarray, b: np.ndarray) -> float:
    """The largest difference of two maps over the first one's largest value (at least 1)."""
    a, b = a.astype(np.float32), b.astype(np.float32)
    return float(np.abs(a - b).max()) / max(1.0, float(np.abs(a).max()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from actmap.capture.vllm_engine import vllm_model_folder

    folder, _ = vllm_model_folder(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="check-vllm-tp-"))
    args.detector = make_detector(tmp / "run", dtype=args.dtype)
    prompts = questions(args.questions)
    one = answers(args, folder, 1, tmp / "audit-tp1", prompts)
    two = answers(args, folder, 2, tmp / "audit-tp2", prompts)
    same = [i for i in one if one[i][0] == two[i][0]]
    rel = [relative(one[i][2], two[i][2]) for i in same]
    dp = [abs(one[i][1] - two[i][1]) for i in same]
    forced = reference_maps(folder, args.dtype, prompts, {i: one[i] for i in same})
    to_reference = {tp: [relative(forced[i], run[i][2]) for i in same]
                    for tp, run in (("tp1", one), ("tp2", two))}  # fmt: skip
    result = {
        "model": args.model, "dtype": args.dtype, "questions": len(prompts),
        "same_tokens": len(same), "max_rel_map_diff": max(rel, default=None),
        "median_rel_map_diff": float(np.median(rel)) if rel else None,
        "max_abs_p_diff": max(dp, default=None),
        **{f"max_rel_map_diff_{tp}_vs_transformers": max(v, default=None)
           for tp, v in to_reference.items()},
        **{f"median_rel_map_diff_{tp}_vs_transformers": float(np.median(v)) if v else None
           for tp, v in to_reference.items()},
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
