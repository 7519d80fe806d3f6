"""Proxied answers vs generation-time capture, in figures: ``actmap serve --upstream`` in front of a
running vLLM server (SmolLM2) reads the map of each answer by teacher forcing over vLLM's
token ids in ``--dtype``; this prints how far that map and its p(correct) are from capture
during generation of the same prompt with the same (local) weights in the same dtype, plus the
start-up probe's log-prob difference.

    python benchmarks/check_proxy_equality.py --upstream http://127.0.0.1:8001 --n 20
    python benchmarks/check_proxy_equality.py --upstream URL --dtype bfloat16 --upstream-dtype bfloat16

(the vLLM server as in README "Score answers from any engine", --served-model-name smollm2)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="vLLM base URL (no /v1)")
    parser.add_argument("--n", type=int, default=20, help="TriviaQA train questions")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--dtype", default="float32", help="the proxy's (and generation's) dtype")
    parser.add_argument("--upstream-dtype", help="the vLLM server's --dtype (default: --dtype)")
    args = parser.parse_args()

    from bench_proxy import INSTRUCTION, MODEL, SERVED, questions
    from bench_serve import make_detector
    from fastapi.testclient import TestClient

    from actmap.capture import CaptureConfig, generate_with_capture
    from actmap.llm.models import load_model
    from actmap.maps import build_map, stored_form
    from actmap.serve.app import ServeSettings, create_app
    from actmap.serve.audit import AuditTrail
    from actmap.serve.engine import Engine
    from actmap.serve.loaded_run import load_detector_run
    from actmap.serve.settings import ProxySettings
    from actmap.store import MapStore

    model, tokenizer, source = load_model(MODEL, dtype=args.dtype)
    root = Path(tempfile.mkdtemp(prefix="proxy-equality-"))
    run = make_detector(root / "run", args.dtype)
    settings = ServeSettings(
        model=MODEL, detector=run, served_model_name=SERVED, audit=root / "audit",
        dtype=args.dtype, proxy=ProxySettings(args.upstream + "/v1", dtype=args.upstream_dtype),
    )  # fmt: skip

    def factory():
        trail = AuditTrail(root / "audit", background=False)
        return Engine(model, tokenizer, source, load_detector_run(run), audit=trail)

    rows = []
    with TestClient(create_app(settings, factory)) as client:
        state = client.app.state.actmap
        print("probe", json.dumps(state.proxy.probe.to_json()))
        engine = state.engine
        config = CaptureConfig(max_new_tokens=args.max_tokens, max_context=2048, greybox=False)
        for question in questions(args.n):
            messages = [{"role": "user", "content": INSTRUCTION.format(question)}]
            body = {"model": SERVED, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0}  # fmt: skip
            out = client.post("/v1/chat/completions", json=body).json()
            (gen,) = generate_with_capture(model, tokenizer, [engine.render_chat(messages)], config)
            expected = stored_form(build_map(gen.trajectory))
            p_raw = float(engine.detector.predict_proba(expected[None])[0])
            same = gen.answer == out["choices"][0]["message"]["content"]
            rows.append((out["actmap"], expected, p_raw, same))
        engine.audit.flush()
    maps = {}
    for batch, meta in MapStore.open(root / "audit").iter_maps(batch_size=64, columns=("id",)):
        maps.update(zip(meta.column("id").to_pylist(), batch, strict=True))
    same = [r for r in rows if r[3]]
    diffs = [np.abs(maps[b["map_id"]].astype(np.float32) - e.astype(np.float32)) for b, e, _, _ in same]  # fmt: skip
    relative = [d.max() / np.abs(e.astype(np.float32)).max() for d, (_, e, _, _) in zip(diffs, same, strict=True)]  # fmt: skip
    p_diff = [abs(b["p_correct_raw"] - p) for b, _, p, _ in same]
    sources = sorted({b["tokens"]["source"] for b, *_ in rows})
    print(
        f"{len(same)}/{len(rows)} answers with the same tokens as local greedy generation; "
        f"map max |diff| {max(d.max() for d in diffs):.3g} (relative to the map's largest value "
        f"{max(relative):.3g}); p_correct_raw max |diff| {max(p_diff):.3g}; token sources "
        f"{sources}; flagged mismatches {sum(b['tokens']['mismatch'] for b, *_ in rows)}"
    )


if __name__ == "__main__":
    main()
