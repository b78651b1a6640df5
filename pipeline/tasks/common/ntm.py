"""The NTM tasks' evaluation (``repeat_copy``, ``associative_recall``): bit errors per sequence on
each test split and a memory trace (inputs, outputs, head weightings) of the first sequence."""

from __future__ import annotations

from pathlib import Path


def evaluate_ntm(task, model, run, plots: Path, splits: list[str]) -> tuple[dict, dict]:
    """Mean bit errors per sequence (over the masked output steps) on each test split, and a
    memory trace (inputs, outputs, head weightings) for the first sequence of each."""
    from pipeline import plots as P

    errors = {}
    for split in splits:
        items = task.load(run.data_dir, split)
        wrong = 0.0
        for start in range(0, len(items), 100):
            batch = task.collate(items[start : start + 100])
            out = model.predict(batch)
            wrong += float(((out["bits"] != batch["y"]).float() * batch["mask"].unsqueeze(-1)).sum())
            if start == 0:
                n = int(batch["mask"][0].nonzero().max()) + 1
                P.memory_trace(batch["x"][0, :n].numpy(), batch["y"][0, :n].numpy(), out["bits"][0, :n].numpy(),
                               out["write_weights"][0, :n, 0].numpy(), out["read_weights"][0, :n, 0].numpy(),
                               plots / f"memory_trace_{split}.png", f"{run.name}: {split}")
        errors[split.removeprefix("test_")] = round(wrong / len(items), 4)
    metrics = {"bit_errors_per_seq": errors, **{f"bit_errors_{k}": v for k, v in errors.items()},
               "sequences_per_case": len(task.load(run.data_dir, splits[0]))}
    row = {"headline": {f"bit_errors_{k}": v for k, v in errors.items()},
           "by_length": {"metric": "bit errors / sequence", "xlabel": "test case",
                         "labels": list(errors), "values": list(errors.values())}}
    return metrics, row
