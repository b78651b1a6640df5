"""Training throughput of the Transformer by batching: sentence batches against token batches.

Target tokens per second (non-padding, with EOS) of forward + backward + AdamW steps with bf16
autocast on the CPU (``--precision fp32``: without), for ``batch_size: 64``
(``pipeline.training.batches.bucket_batches``) and ``max_tokens`` of 2,048, 4,096 and 8,192
(``pipeline.training.batches.token_batches``), on the prepared translation data and ``models.transformer``'s
params.yaml config (``--dropout``: another dropout). Each configuration runs until it has trained
``--tokens`` target tokens (after one step of warm-up); the configurations run in turn, ``--repeats``
times, and the median is reported with the minutes one pass over the corpus would take.

    python scripts/bench_token_batches.py --tokens 60000 --repeats 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import cli_errors
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> None:
    import models
    from pipeline.config import TrainConfig, resolve
    from pipeline.tasks import get_task
    from pipeline.training.batches import epoch_batches

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=60000, help="target tokens timed per configuration and repeat")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                    help="bf16: autocast as train.precision bf16 runs (a CPU with native bf16); fp32: none")
    ap.add_argument("--dropout", type=float, help="the model's dropout (default: params.yaml's)")
    ap.add_argument("--sentence-batches", action=argparse.BooleanOptionalAction, default=True,
                    help="also time batch_size 64")
    args = ap.parse_args(argv)
    # the same merge as `train --set dropout=...`: pipeline.config.resolve validates the key
    run = resolve("transformer", overrides=None if args.dropout is None else {"model.dropout": args.dropout})
    task = get_task(run.task)
    items = task.load(run.data_dir, "train")
    lengths = [task.length(it) for it in items]
    corpus = sum(len(it["tgt"]) + 1 for it in items)
    configs = {**({"batch_size 64": TrainConfig(batch_size=64)} if args.sentence_batches else {}),
               **{f"max_tokens {n}": TrainConfig(max_tokens=n) for n in args.max_tokens}}
    torch.manual_seed(0)
    model = models.build(run.arch, run.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rates: dict[str, list[float]] = {k: [] for k in configs}
    for rep in range(args.repeats):
        for name, cfg in configs.items():
            batches = epoch_batches(cfg, lengths, rep + 1)
            random.Random(rep).shuffle(batches)
            steps, tokens, start = 0, 0, 0.0
            for b in batches:
                batch = task.collate([items[i] for i in b])
                if steps == 1:  # the first step warms up allocations and kernels: not timed
                    start, tokens = time.perf_counter(), 0
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                    loss, _ = model.loss(batch)
                opt.zero_grad()
                loss.backward()
                opt.step()
                tokens += int((batch["tgt_out"] != 0).sum())
                steps += 1
                if steps > 1 and tokens >= args.tokens:
                    break
            rates[name].append(tokens / (time.perf_counter() - start))
            print(f"repeat {rep}: {name}: {rates[name][-1]:.0f} target tokens/s", flush=True)
    print(f"\n{corpus:,} target tokens a pass")
    print("| batches | steps a pass | target tokens/s (median) | minutes a pass |\n|---|---|---|---|")
    for name, cfg in configs.items():
        rate = statistics.median(rates[name])
        print(f"| {name} | {len(epoch_batches(cfg, lengths, 0)):,} | {rate:,.0f} | {corpus / rate / 60:.1f} |")


if __name__ == "__main__":
    cli_errors.run(main)
