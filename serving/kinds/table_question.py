"""Table question answering (Neural Programmer): question text, column names and a table in."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from serving.base import ServedModel
from serving.kinds import register
from serving.protocol import RequestError, TensorSpec


@register("table_question")
class TableQuestionModel(ServedModel):
    """A one-graph table QA model (Neural Programmer) on raw input: the question as text, the
    column names as text, the table as numbers; answers with the executed program's soft choices.

    Numbers in a question become the number token and their value the pivot (one per question).
    """

    platform = "attnzoo_table_qa"
    limit_axes = {"question": {0: ("questions", "rows")}, "table": {1: ("table rows", "steps")}}

    def __init__(self, name: str, version: int, folder: Path, meta: dict, graphs: dict, limits=None):
        self.graph, self.serving = graphs["model"], meta["serving"]
        self.vocab = {w: i for i, w in enumerate(self.serving["vocabulary"])}
        # A version published before its operations were named answers with their numbers.
        self.labels = {"op_weights": list(self.serving["operations"])} if "operations" in self.serving else {}
        super().__init__(name, version, [
            TensorSpec("question", "BYTES", (-1,)), TensorSpec("columns", "BYTES", (-1, -1)),
            TensorSpec("table", "FP32", (-1, -1, -1))], [
            TensorSpec("answer", "FP32", (-1,)), TensorSpec("is_lookup", "BOOL", (-1,)),
            TensorSpec("cells", "BOOL", (-1, -1, -1)), TensorSpec("operations", "BYTES", (-1, -1)),
            TensorSpec("op_weights", "FP32", (-1, -1, -1)), TensorSpec("col_weights", "FP32", (-1, -1, -1))],
            limits)

    def _ids(self, words: list[str], what: str) -> list[int]:
        unknown = sorted({w for w in words if w not in self.vocab})
        if unknown:
            raise RequestError(f"{what}: unknown word(s) {unknown}; known: {sorted(self.vocab)[:40]}")
        return [self.vocab[w] for w in words]

    def infer(self, feeds, params):
        questions, columns, table = feeds["question"].reshape(-1), feeds["columns"], feeds["table"].astype(np.float32)
        n = len(questions)
        if columns.shape[0] != n or table.shape[0] != n or table.shape[2] != columns.shape[1]:
            raise RequestError("question [N], columns [N,C] and table [N,rows,C] must agree on N and C")
        if n == 0 or table.shape[1] == 0 or not np.isfinite(table).all():
            raise RequestError("each table needs at least one row of finite numbers")
        ids, pivots = [], []
        for q in questions:
            words, nums = [], []
            for w in str(q).lower().replace("?", " ").split():
                try:
                    nums.append(float(w))
                    words.append(self.serving["number_token"])
                except ValueError:
                    words.append(w)
            if len(nums) > 1:
                raise RequestError(f"question '{q}': at most one number is supported")
            if not words or len(words) > 64:
                raise RequestError(f"question '{q}' must have 1 to 64 words")
            ids.append(self._ids(words, f"question '{q}'"))
            pivots.append(nums[0] if nums else 0.0)
        question = np.zeros((n, max(map(len, ids))), np.int64)  # [N,L] right-padded
        for i, row in enumerate(ids):
            question[i, : len(row)] = row
        cols = np.array([self._ids([str(c).lower() for c in row], "columns") for row in columns], np.int64)
        out = self.graph({"question": question, "q_len": np.array([len(r) for r in ids], np.int64), "columns": cols,
                          "table": table, "row_mask": np.ones(table.shape[:2], np.float32),
                          "pivot": np.array(pivots, np.float32)})
        lookup = out["is_lookup"].astype(bool)
        # The operation each program step executed: its largest weight, as the hard program chose it.
        names = self.labels.get("op_weights") or [f"operation {k}" for k in range(out["op_weights"].shape[-1])]
        chosen = np.asarray(names, dtype=object)[out["op_weights"].argmax(-1)]  # [N,T] names
        # A lookup answer is the selected cells; its scalar is 0 (JSON has no NaN).
        return {"answer": (np.where(lookup, 0.0, out["scalar"]).astype(np.float32), "FP32"),
                "is_lookup": (lookup, "BOOL"), "cells": (out["lookup"] > 0.5, "BOOL"), "operations": (chosen, "BYTES"),
                "op_weights": (out["op_weights"], "FP32"), "col_weights": (out["col_weights"], "FP32")}
