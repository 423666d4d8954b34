"""flash-linear-attention's GLA model through backend="laplace": compile, training step, decode.

    python -m benchmarks.bench_fla                 # all three parts
    python -m benchmarks.bench_fla --part decode --json

Needs flash-linear-attention (the `test` extra) and a source checkout (the
eager reference is tests/fla_reference.py). Measured side by side in one run:

* train: fla's GLAForCausalLM (default flags, d 64, 2 layers) at B = 2,
  T = 2048: compile time of the laplace backend (first forward + backward,
  less one steady step), then forward + backward through laplace against the
  same weights run eagerly in plain PyTorch (fla's token loop for GLA).
* decode: greedy decode tokens/s at 1, 64 and 1280 sequences through the
  compiled model and fla's cache (one token per sequence per step, median
  of 8 steps after the prefill), with the recurrent form for decode sites
  (the default) and without it (every step a chunk padded to the target's
  128 rows).
* crossover: one GLA site of T tokens without gradient in each form,
  compiled: milliseconds per forward on this CPU (target cpu; B = 64, the
  tiny model's heads), and trn2's estimated instructions (`laplace_passes.unroll.size`,
  also for the 1.3B shape); where the chunked form starts to win sets
  `recurrent_max_tokens` in `laplace_passes.infra.targets`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

import laplace_passes
from benchmarks.common import interleaved_medians, once
from laplace_passes.infra.targets import CPU, TRN2

TINY = dict(hidden_size=64, num_hidden_layers=2, num_heads=2, vocab_size=128)
CONCURRENCY = (1, 64, 1280)
CROSSOVER_T = (1, 8, 16, 24, 32, 40, 48, 64, 96, 128, 192, 256)
NO_RECURRENT_FORM = dataclasses.replace(TRN2, recurrent_max_tokens=0)


def fla_model(seed=0):
    from fla.models import GLAConfig, GLAForCausalLM

    torch.manual_seed(seed)
    return GLAForCausalLM(GLAConfig(**TINY))


def train(seq_len: int = 2048, batch: int = 2, repeats: int = 3) -> dict:
    from tests import fla_reference

    model = fla_model()
    ids = torch.randint(0, TINY["vocab_size"], (batch, seq_len), generator=torch.Generator().manual_seed(1))
    compiled = laplace_passes.compile(model, target="trn2")

    def laplace_step():
        model.zero_grad(set_to_none=True)
        compiled(input_ids=ids, labels=ids).loss.backward()

    def reference_step():
        model.zero_grad(set_to_none=True)
        logits, _ = fla_reference.forward(model, ids)
        fla_reference.cross_entropy(logits, ids).backward()

    first = once(laplace_step)
    times = interleaved_medians({"laplace": laplace_step, "reference": reference_step}, repeats, warmup=0)
    return {"T": seq_len, "B": batch, "compile_s": first - times["laplace"], "laplace_step_s": times["laplace"],
            "reference_step_s": times["reference"], "speedup": times["reference"] / times["laplace"]}


def decode(steps: int = 8, prompt_len: int = 16) -> dict:
    """Decode tokens/s per concurrency, with and without the recurrent form."""
    results = {}
    for label, target in (("recurrent", TRN2), ("padded chunk", NO_RECURRENT_FORM)):
        results[label] = {batch: _decode_rate(target, batch, steps, prompt_len) for batch in CONCURRENCY}
    return results


def _decode_rate(target, batch: int, steps: int, prompt_len: int) -> float:
    """Greedy decode through the compiled model and fla's cache: sequences / median seconds per step."""
    # A fresh compile per batch size: a second size would recompile with a dynamic batch, and a
    # chunked site of a dynamic batch is declined (it would no longer measure the padded chunk).
    torch._dynamo.reset()
    model = fla_model().eval()
    model.compile(backend="laplace", options={"target": target, "report": laplace_passes.Report()})
    prompt = torch.randint(3, TINY["vocab_size"], (batch, prompt_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        state = {"out": out}

        def step():
            token = state["out"].logits[:, -1:].argmax(-1)
            state["out"] = model(input_ids=token, past_key_values=state["out"].past_key_values, use_cache=True)

        for _ in range(2):  # compiles; the second step recompiles with the cache's token count dynamic
            step()
        seconds = sorted(once(step) for _ in range(steps))
    return batch / seconds[len(seconds) // 2]


def crossover(batch: int = 64, repeats: int = 7) -> dict:
    """Per T: CPU ms of one inference site in each form (one thread, best of `repeats`), and trn2 estimates.

    One thread and the best time: this machine is shared, and the fastest
    run is the one least disturbed. Estimated instructions are given for the
    tiny model's heads and for the 1.3B shape's (on the meta device).
    """
    from tests.gla_cases import make_inputs

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for T in CROSSOVER_T:
            row = {"T": T}
            tiny = make_inputs(batch, T, 2, 16, 32)
            big = [torch.empty(t.shape, device="meta") for t in make_inputs(1, T, 4, 256, 512)]
            for form, limit in (("recurrent", 1 << 30), ("chunked", 0)):
                cpu, trn2 = (dataclasses.replace(t, recurrent_max_tokens=limit) for t in (CPU, TRN2))
                row[f"{form}_ms"] = _time_site(cpu, tiny, repeats)[0]
                row[f"{form}_instructions"] = _time_site(trn2, tiny, 0)[1]
                row[f"{form}_instructions_1.3b"] = _time_site(trn2, big, 0)[1]
            rows.append(row)
    finally:
        torch.set_num_threads(threads)
    return {"rows": rows, **{key: _first_win(rows, key) for key in ("ms", "instructions", "instructions_1.3b")}}


def _time_site(target, inputs, repeats: int) -> tuple[float, int]:
    """(best ms over `repeats` calls, trn2-estimated instructions) of one compiled site."""
    report = laplace_passes.Report()
    torch._dynamo.reset()  # one compile per (T, form): more than Dynamo's recompile limit
    site = laplace_passes.compile(_site, target=target, report=report)
    best = float("nan")
    with torch.no_grad():
        site(*inputs)
        if repeats:
            best = min(once(lambda: site(*inputs)) for _ in range(repeats)) * 1e3
    return best, next(g.size.instructions for g in report.graphs if g.size is not None)


def _first_win(rows: list[dict], key: str) -> int | None:
    """The smallest T at which the chunked form costs no more than the recurrent one."""
    return next((r["T"] for r in rows if r[f"chunked_{key}"] <= r[f"recurrent_{key}"]), None)


def _site(q, k, v, gk, h0):
    return laplace_passes.gla(q, k, v, gk, initial_state=h0, output_final_state=True)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("train", "decode", "crossover", "all"), default="all")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    parts = ("train", "decode", "crossover") if args.part == "all" else (args.part,)
    results = {name: {"train": train, "decode": decode, "crossover": crossover}[name]() for name in parts}
    print(json.dumps(results, indent=2) if args.json else _text(results))
    return results


def _text(results: dict) -> str:
    lines = []
    if "train" in results:
        r = results["train"]
        lines += [f"fla GLAForCausalLM (d 64, 2 layers, default flags), B = {r['B']}, T = {r['T']}, CPU:",
                  f"  laplace compile (first fwd+bwd less one step)  {r['compile_s']:8.1f} s",
                  f"  fwd+bwd through laplace                        {r['laplace_step_s']:8.3f} s",
                  f"  fwd+bwd eager plain-PyTorch reference           {r['reference_step_s']:8.3f} s"
                  f"   (laplace x{r['speedup']:.1f} faster)"]
    if "decode" in results:
        lines.append("greedy decode tokens/s (trn2 target, inner eager, CPU):")
        lines.append(f"  {'sequences':>9}  {'recurrent form':>15}  {'padded chunk':>13}  ratio")
        for batch in CONCURRENCY:
            after, before = results["decode"]["recurrent"][batch], results["decode"]["padded chunk"][batch]
            lines.append(f"  {batch:9d}  {after:15,.0f}  {before:13,.0f}  x{after / before:.1f}")
    if "crossover" in results:
        c = results["crossover"]
        lines.append("one GLA site without gradient: CPU ms (target cpu, chunk 64; B = 64, H = 2, K = 16, V = 32; one")
        lines.append("thread, best of 7) and trn2 estimated instructions (chunk 128; same shape, and B = 1 with the")
        lines.append("1.3B shape, H = 4, K = 256, V = 512)")
        lines.append(f"  {'T':>4}  {'recurrent ms':>12}  {'chunked ms':>10}  {'instr rec':>9}  {'instr chunk':>11}"
                     f"  {'1.3b rec':>9}  {'1.3b chunk':>10}")
        for r in c["rows"]:
            lines.append(f"  {r['T']:4d}  {r['recurrent_ms']:12.2f}  {r['chunked_ms']:10.2f}  "
                         f"{r['recurrent_instructions']:9,d}  {r['chunked_instructions']:11,d}  "
                         f"{r['recurrent_instructions_1.3b']:9,d}  {r['chunked_instructions_1.3b']:10,d}")
        lines.append(f"  chunked form first as cheap at T = {c['ms']} (CPU time), {c['instructions']} (trn2 estimate), "
                     f"{c['instructions_1.3b']} (trn2 estimate, 1.3B shape)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
