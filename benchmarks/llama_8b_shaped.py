"""An 8B-shaped Llama folder for the GPU run of `bench_vllm_plugin.py` (issue 54, item 6).

Writes only ``config.json`` (Llama-3-8B's shape: 32 layers, hidden 4096, 32 heads, 8 KV heads,
MLP 14336) and SmolLM2's tokenizer (its 49,152-token vocabulary, so the embedding and head
are 49,152 rows): vLLM starts it with ``--load-format dummy`` (random weights, nothing to
download or write).

    python benchmarks/llama_8b_shaped.py /tmp/llama-8b-shaped
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer, LlamaConfig

    from actmap.capture.vllm_engine import vllm_model_folder

    folder, _ = vllm_model_folder("smollm2-135m-instruct")  # its de-quantized folder
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="bfloat16",
    )
    args.out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out} (config + tokenizer; start vLLM with --load-format dummy)")


if __name__ == "__main__":
    main()
