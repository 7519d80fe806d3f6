"""What ``actmap.stream_scores`` costs a streamed answer on vLLM's server with the plugin.

One plugin server on the tests' tiny random-weight model (`tests/test_vllm_plugin.py`: its
folder, detector and server start), one client: the same greedy ``--tokens``-token stream
(``ignore_eos``) with and without running scores, alternated ``--repeats`` times; prints each
repeat's wall time and the medians (the first pair left out: warm-up). A watched stream costs
one ``actmap_peek`` RPC and one scoring of the prefix per chunk.

    OMP_NUM_THREADS=1 python benchmarks/bench_vllm_stream_scores.py --tokens 128 --repeats 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_vllm_plugin as plugin_tests  # noqa: E402
from serve_helpers import stop_process_group  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-stream-scores-"))
    folder = plugin_tests.tiny_folder(root / "tiny")
    run = plugin_tests.detector_for(root / "run", folder)
    server, url = plugin_tests.start_vllm(folder, run, root / "audit", root / "vllm.log")
    try:
        problem = plugin_tests.wait_up(server, url, root / "vllm.log", time.time() + 900)
        if problem is not None:
            raise SystemExit(problem)
        body = {"model": plugin_tests.MODEL, "messages": plugin_tests.MESSAGES,
                "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}  # fmt: skip
        modes = {"plain": {}, "stream_scores": {"actmap": {"stream_scores": True}}}
        times: dict[str, list[float]] = {name: [] for name in modes}
        scores = 0
        for _ in range(args.repeats):
            for name, extra in modes.items():
                start = time.perf_counter()
                chunks = plugin_tests.streamed(url, {**body, **extra})
                times[name].append(time.perf_counter() - start)
                if extra:
                    scores = sum("n_tokens" in c.get("actmap", {}) for c in chunks)
        for name, values in times.items():
            rounded = [round(v, 3) for v in values]
            print(f"{name}: median {statistics.median(values[1:]):.3f} s, each {rounded}")
        print(f"running scores in the last watched stream: {scores} of {args.tokens} tokens")
    finally:
        stop_process_group(server)


if __name__ == "__main__":
    main()
