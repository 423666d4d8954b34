"""Recurrent decode throughput, and state bytes against a softmax model's KV cache.

    python -m benchmarks.bench_decode [--steps 32] [--json]

Decode tokens/s of the `tiny` model at 1, 64 and 1280 concurrent sequences
(one batch; each step feeds one token per sequence and carries the fp32
state), measured in one run. Then the recurrent state per sequence of `tiny`
and `laplace-3b` beside the KV cache (bf16) of a softmax model of the same
depth and width at 2k, 8k and 32k tokens of context.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import model_zoo

CONCURRENCY = (1, 64, 1280)
CONTEXTS = (2048, 8192, 32768)


def decode_tokens_per_s(model, batch: int, steps: int, prompt_len: int = 16) -> float:
    prompt = torch.randint(1, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    model.generate(prompt, 2)  # warm up
    start = time.perf_counter()
    model.generate(prompt, steps)
    seconds = time.perf_counter() - start
    return batch * steps / seconds


def state_table() -> list[dict]:
    rows = []
    for name in ("tiny", "laplace-3b"):
        model = model_zoo.build(name, device="meta")
        state = model.recurrent_state_bytes_per_sequence()
        row = {"model": name, "state_bytes": state}
        for context in CONTEXTS:
            kv = model.kv_cache_bytes_softmax(context)
            row[f"kv_bytes_{context}"] = kv
            row[f"kv_over_state_{context}"] = kv / state
        rows.append(row)
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = model_zoo.build("tiny").eval()
    results = {
        "decode_tokens_per_s": {b: decode_tokens_per_s(model, b, args.steps) for b in CONCURRENCY},
        "state": state_table(),
    }
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(_text(results))
    return results


def _text(results: dict) -> str:
    lines = ["decode, tiny model (one token per sequence per step, fp32 state, CPU):"]
    for batch, rate in results["decode_tokens_per_s"].items():
        lines.append(f"  {batch:5d} concurrent sequences: {rate:12,.0f} tokens/s")
    lines.append("state per sequence vs softmax KV cache (bf16) of the same depth and width:")
    for row in results["state"]:
        kv = ", ".join(f"{c // 1024}k: {row[f'kv_bytes_{c}'] / 1e6:,.1f} MB (x{row[f'kv_over_state_{c}']:,.0f})"
                       for c in CONTEXTS)
        lines.append(f"  {row['model']:<10} state {row['state_bytes'] / 1e6:.3f} MB; KV cache {kv}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
