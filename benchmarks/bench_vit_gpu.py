"""Where the ViT's GPU scoring time goes at batch 256: kernels vs launches, and CUDA graphs.

    PYTHONPATH=src python benchmarks/bench_vit_gpu.py [--device cuda] [--repeats 300]

For the paper's ViT (untrained weights; latency does not depend on them) on one batch
of float32 maps already on the device, each variant's median wall time per map over
interleaved repeats (warm-up excluded), beside the summed time of the CUDA kernels one
forward pass launches (torch.profiler) and their count: a wall time far above the kernel
time means the host (Python, dispatch, launches) is the limit, which CUDA graphs remove.
Variants: eager float32 (TF32 off: the recipe's numerics; and on), eager bf16 autocast,
torch.compile's default mode and its "reduce-overhead" mode (CUDA graphs), each in
float32 and bf16. Prints the largest |logit difference| of each from eager float32.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from actmap.detectors import create_detector
from actmap.experiments.cost import time_calls

MAP_SHAPE = (12, 32, 128)


def kernel_time(fn) -> tuple[float, int]:
    """(summed CUDA kernel ms, kernel count) of one call, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1e3, len(kernels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--detector", default="vit")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = create_detector(args.detector).to(device).eval()
    x = torch.randn(args.batch, *MAP_SHAPE, device=device)

    def eager(bf16: bool, tf32: bool = False):
        def call():
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
            with torch.inference_mode(), torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                return model(x)

        return call

    def compiled(mode: str, bf16: bool):
        twin = create_detector(args.detector).to(device).eval()
        twin.load_state_dict(model.state_dict())
        forward = torch.compile(twin, mode=mode)

        def call():
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            with torch.inference_mode(), torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                out = forward(x)
                return out.clone() if mode == "reduce-overhead" else out

        return call

    variants = {
        "eager fp32": eager(False),
        "eager fp32 tf32": eager(False, tf32=True),
        "eager bf16": eager(True),
    }
    if device.type == "cuda":
        for mode in ("default", "reduce-overhead"):
            for bf16 in (False, True):
                variants[f"compiled {mode} {'bf16' if bf16 else 'fp32'}"] = compiled(mode, bf16)
    reference = eager(False)().float()
    for label, fn in variants.items():
        for _ in range(3):  # compile and warm up before timing
            out = fn()
        print(f"{label}: max |logit difference| {(out.float() - reference).abs().max():.1e}")
    # no peak memory here: the warm-up above already recorded the CUDA graphs, whose pools
    # would not count (bench_scoring.py reports each variant's peak)
    times, _ = time_calls(variants, device, args.repeats, warmup=3)
    print(
        f"\n{torch.cuda.get_device_name(device) if device.type == 'cuda' else device}, "
        f"torch {torch.__version__}, batch {args.batch}, median of {args.repeats}"
    )
    print(f"{'variant':<30} {'ms/map':>8} {'ms/batch':>9} {'kernel ms':>9} {'kernels':>8}")
    for label, fn in variants.items():
        median = statistics.median(times[label])
        kms, count = kernel_time(fn) if device.type == "cuda" else (float("nan"), 0)
        print(
            f"{label:<30} {1e3 * median / args.batch:>8.4f} {1e3 * median:>9.3f} {kms:>9.3f} "
            f"{count:>8}"
        )


if __name__ == "__main__":
    main()
