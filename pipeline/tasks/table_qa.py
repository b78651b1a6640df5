"""Synthetic table question answering (Neelakantan et al. 2015 §3.1, scaled down).

Each example is a table of ``min_rows``–``max_rows`` rows and three numeric columns (integers
0–99) whose names are drawn from ``COLUMN_NAMES``, and a templated question of one of the kinds
count / sum / greater / lesser / first / last / select (print), e.g. "sum of price where age
greater than <num>". Numbers in the question become a <num> token; their value is the pivot.
Answers are scalars (count, sum) or table cells (print, first, last). Filters are drawn so that
at least one row is selected. Generated from a seed; the split is by generated example.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pipeline.tasks import Task, register_task

COLUMN_NAMES = ["price", "age", "score", "height", "weight", "rank", "year", "speed"]
WORDS = ["<pad>", "<num>", "how", "many", "rows", "have", "greater", "lesser", "than", "sum", "of",
         "where", "print", "first", "last"] + COLUMN_NAMES
VOCAB = {w: i for i, w in enumerate(WORDS)}
COLUMNS = 3
# kind -> (question template, answer kind); {a}: the answer column, {b}: the filter column.
KINDS = {
    "count": ("how many rows", "scalar"),
    "count_greater": ("how many rows have {b} greater than <num>", "scalar"),
    "count_lesser": ("how many rows have {b} lesser than <num>", "scalar"),
    "sum": ("sum of {a}", "scalar"),
    "sum_greater": ("sum of {a} where {b} greater than <num>", "scalar"),
    "sum_lesser": ("sum of {a} where {b} lesser than <num>", "scalar"),
    "print_greater": ("print {a} where {b} greater than <num>", "lookup"),
    "print_lesser": ("print {a} where {b} lesser than <num>", "lookup"),
    "first": ("first {a}", "lookup"),
    "last": ("last {a}", "lookup"),
    "first_greater": ("first {a} where {b} greater than <num>", "lookup"),
    "last_lesser": ("last {a} where {b} lesser than <num>", "lookup"),
}


def make_example(rng: np.random.Generator, rows: int, kind: str) -> dict:
    """One table, question and answer (see module docstring)."""
    names = rng.choice(len(COLUMN_NAMES), size=COLUMNS, replace=False)
    table = rng.integers(0, 100, size=(rows, COLUMNS)).astype(np.float32)
    a, b = rng.choice(COLUMNS, size=2, replace=False)
    template, answer_kind = KINDS[kind]
    words = template.format(a=COLUMN_NAMES[names[a]], b=COLUMN_NAMES[names[b]]).split()
    pivot = 0.0
    selected = np.ones(rows, dtype=bool)
    if "greater" in kind:  # pivot below the column's maximum: at least one row passes
        pivot = float(rng.integers(0, int(table[:, b].max()))) if table[:, b].max() > 0 else -1.0
        selected = table[:, b] > pivot
    elif "lesser" in kind:
        pivot = float(rng.integers(int(table[:, b].min()) + 1, 101))
        selected = table[:, b] < pivot
    cells = np.zeros((rows, COLUMNS), dtype=np.float32)
    answer = 0.0
    if kind.startswith("count"):
        answer = float(selected.sum())
    elif kind.startswith("sum"):
        answer = float(table[selected, a].sum())
    else:
        idx = np.flatnonzero(selected)
        chosen = idx[:1] if kind.startswith("first") else idx[-1:] if kind.startswith("last") else idx
        cells[chosen, a] = 1.0
    return {"question": [VOCAB[w] for w in words], "columns": [VOCAB[COLUMN_NAMES[n]] for n in names],
            "table": table, "pivot": pivot, "answer": answer, "cells": cells,
            "is_lookup": answer_kind == "lookup", "kind": kind}


class TableQATask(Task):
    name = "table_qa"
    card = {"data": "synthetic tables and templated questions generated from the seed in params.yaml",
            "licence": "generated: no third-party data",
            "paper": "Neelakantan et al. 2016 (Neural Programmer)"}
    # The server tokenises questions itself: numbers become <num> (their value the pivot).
    serving = {"input": "table_question", "vocabulary": WORDS, "number_token": "<num>"}

    def make_split(self, rng: np.random.Generator, count: int, params: dict) -> dict:
        kinds = list(KINDS)
        rows = rng.integers(params["min_rows"], params["max_rows"] + 1, size=count)
        exs = [make_example(rng, int(r), kinds[int(k)]) for r, k in zip(rows, rng.integers(0, len(kinds), size=count))]
        m, length = int(rows.max()), max(len(e["question"]) for e in exs)
        out = {"question": np.zeros((count, length), np.int64), "q_len": np.zeros(count, np.int64),
               "columns": np.zeros((count, COLUMNS), np.int64), "table": np.zeros((count, m, COLUMNS), np.float32),
               "rows": rows.astype(np.int64), "pivot": np.zeros(count, np.float32),
               "answer": np.zeros(count, np.float32), "cells": np.zeros((count, m, COLUMNS), np.float32),
               "is_lookup": np.zeros(count, np.int64), "kind": np.zeros(count, np.int64)}
        for i, e in enumerate(exs):
            n, r = len(e["question"]), len(e["table"])
            out["question"][i, :n], out["q_len"][i] = e["question"], n
            out["columns"][i], out["table"][i, :r], out["cells"][i, :r] = e["columns"], e["table"], e["cells"]
            out["pivot"][i], out["answer"][i] = e["pivot"], e["answer"]
            out["is_lookup"][i], out["kind"][i] = e["is_lookup"], kinds.index(e["kind"])
        return {k: torch.from_numpy(v) for k, v in out.items()}

    def prepare(self, params: dict, out: Path) -> dict:
        rng = np.random.default_rng(params["seed"])
        splits = {s: self.make_split(rng, params[f"{s}_size"], params) for s in ("train", "val", "test")}
        for name, split in splits.items():
            torch.save(split, out / f"{name}.pt")
        return {"counts": {k: len(v["q_len"]) for k, v in splits.items()}, "kinds": list(KINDS),
                "vocabulary": WORDS, "model_defaults": {"vocab_size": len(WORDS)}}

    def load(self, data_dir: Path, split: str) -> list:
        d = torch.load(data_dir / f"{split}.pt")
        return [{k: d[k][i] for k in d} for i in range(len(d["q_len"]))]

    def length(self, item) -> int:
        return int(item["rows"])

    def collate(self, items: list) -> dict:
        """question [B,L], q_len, columns [B,C], table/answer_cells [B,M,C], row_mask [B,M],
        pivot, answer [B] float, answer_is_lookup [B]."""
        bsz, m = len(items), max(int(it["rows"]) for it in items)
        length = max(int(it["q_len"]) for it in items)
        batch = {"question": torch.zeros(bsz, length, dtype=torch.long), "table": torch.zeros(bsz, m, COLUMNS),
                 "answer_cells": torch.zeros(bsz, m, COLUMNS), "row_mask": torch.zeros(bsz, m)}
        for b, it in enumerate(items):
            r, n = int(it["rows"]), int(it["q_len"])
            batch["question"][b, :n] = it["question"][:n]
            batch["table"][b, :r], batch["answer_cells"][b, :r] = it["table"][:r], it["cells"][:r]
            batch["row_mask"][b, :r] = 1.0
        batch.update({"q_len": torch.stack([it["q_len"] for it in items]),
                      "columns": torch.stack([it["columns"] for it in items]),
                      "pivot": torch.stack([it["pivot"] for it in items]),
                      "answer": torch.stack([it["answer"] for it in items]),
                      "answer_is_lookup": torch.stack([it["is_lookup"] for it in items])})
        return batch

    def example_batch(self, cfg: dict, seed: int = 0, batch: int = 3) -> dict:
        """Questions over tables of 3 to 5 rows."""
        split = self.make_split(np.random.default_rng(seed), batch, {"min_rows": 3, "max_rows": 5})
        return self.collate([{k: v[i] for k, v in split.items()} for i in range(batch)])

    def evaluate(self, model, run, plots: Path) -> tuple[dict, dict]:
        from models.neural_programmer import OPERATIONS, correct
        from pipeline import plots as P

        items = self.load(run.data_dir, "test")
        kinds = json.loads((run.data_dir / "manifest.json").read_text())["kinds"]
        right, kind_ids = [], []
        for start in range(0, len(items), 500):
            chunk = items[start : start + 500]
            batch = self.collate(chunk)
            out = model.predict(batch)
            right.append(correct(out, batch))
            kind_ids += [int(it["kind"]) for it in chunk]
            if start == 0:
                for i in range(3):  # the soft program: operation × step and column × step
                    words = " ".join(WORDS[t] for t in chunk[i]["question"][: int(chunk[i]["q_len"])].tolist())
                    cols = [WORDS[t] for t in chunk[i]["columns"].tolist()]
                    steps = [f"step {t + 1}" for t in range(out["op_weights"].shape[1])]
                    P.alignment(out["op_weights"][i].numpy(), OPERATIONS, steps, plots / f"program_ops_{i}.png",
                                f"{run.name}: operations — {words}", "operation", "program step")
                    P.alignment(out["col_weights"][i].numpy(), cols, steps, plots / f"program_columns_{i}.png",
                                f"{run.name}: columns — {words}", "column", "program step")
        right_t, kind_t = torch.cat(right).float(), torch.tensor(kind_ids)
        by_kind = {k: round(float(right_t[kind_t == i].mean()), 4) for i, k in enumerate(kinds) if (kind_t == i).any()}
        metrics = {"accuracy": round(float(right_t.mean()), 4), "accuracy_by_kind": by_kind,
                   "test_examples": len(items)}
        row = {"headline": {"accuracy": metrics["accuracy"]},
               "by_length": {"metric": "accuracy", "xlabel": "question kind", "labels": list(by_kind),
                             "values": list(by_kind.values())}}
        return metrics, row

    def parity_batches(self, data_dir: Path) -> list[tuple[str, dict]]:
        items = self.load(data_dir, "test")
        return [(f"batch {n}", self.collate(items[s : s + n])) for s, n in ((0, 1), (1, 8), (9, 256))]


register_task(TableQATask())
