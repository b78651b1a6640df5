"""Neural Programmer: Neelakantan, Le & Sutskever 2015 (arXiv:1511.04834).

A question RNN reads the question (numbers replaced by a <num> token, their values given apart as
the pivot); for T steps a history RNN, fed the previous step's soft choices (c_t = [α_opᵀ U;
α_colᵀ P], §2.3), drives two soft selectors over built-in operations and over the table's columns,
α_op = softmax(U tanh(W_op [q; h_t])) and α_col = softmax(P tanh(W_col [q; h_t])) — P are the
column names' word embeddings, so a column is chosen by what it is called. Each step also attends
over the question's words with h_t and adds that summary q_t to [q; h_t]. Each step applies every
operation to the row selector of the previous step and mixes the results by α (§2.4):

    row_select_t = α_reset·1 + α_greater·Σ_j α_col_j [T_ij > pivot] + α_lesser·Σ_j α_col_j [T_ij < pivot]
                   + α_first·first(rs) + α_last·last(rs) + (α_count + α_sum + α_print)·rs
    scalar_t     = α_count·Σ_i rs_i + α_sum·Σ_j α_col_j Σ_i rs_i T_ij
    lookup_t     = α_print·α_col_j·rs_i                        (rs = row_select_{t-1})

Training uses the soft program with the paper's losses: Huber on scalar answers, cell-wise log-loss
on lookup answers (§2.5). Prediction executes the discrete program (argmax op and column per
step), as the paper does at test time, so answers are exact; the soft selections are returned as
the model's attention. Scaled-down scope (documented in the task): one number per question, so the
pivot needs no attention over several numbers; operations and/or/assign are left out.

Dimension legend
    B batch, L question length, W word vocabulary, E embedding, H hidden, M rows, C columns,
    K operations, T program steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import register
from models.export import ExportSpec, graph

OPERATIONS = ["reset", "greater", "lesser", "first", "last", "count", "sum", "print"]
RESET, GREATER, LESSER, FIRST, LAST, COUNT, SUM, PRINT = range(len(OPERATIONS))


@dataclass
class NeuralProgrammerConfig:
    vocab_size: int = 32
    emb_dim: int = 64
    hidden: int = 128
    steps: int = 3  # T
    huber_delta: float = 1.0  # on log(1 + ŷ) - log(1 + y)
    lookup_weight: float = 1.0
    pad_id: int = 0


def first_selected(rs: Tensor, hard: bool) -> Tensor:
    """rs [B,M] in [0,1] -> the first selected row: rs_i · Π_{k<i} (1 - rs_k).

    The product is a cumulative sum of logs (ONNX has no cumulative product); a 0/1 selector
    (``hard``) uses the exact form: selected, and nothing selected before.
    """
    before = torch.cumsum(rs, dim=1) - rs  # [B,M] Σ_{k<i} rs_k
    if hard:
        return rs * (before == 0).to(rs.dtype)
    logs = torch.log((1 - rs).clamp(min=1e-6))
    return rs * torch.exp(torch.cumsum(logs, dim=1) - logs)


def one_hot_max(w: Tensor) -> Tensor:
    """[B,N] -> one-hot of the argmax (first on ties), written so N stays a dynamic ONNX axis."""
    ids = torch.arange(w.shape[-1], device=w.device).unsqueeze(0)  # [1,N]
    return (ids == w.argmax(-1, keepdim=True)).to(w.dtype)


@register("neural_programmer", NeuralProgrammerConfig)
class NeuralProgrammer(nn.Module):
    serving = {"operations": OPERATIONS}  # published with the model: op_weights' last axis, by name

    def __init__(self, cfg: NeuralProgrammerConfig):
        super().__init__()
        self.cfg = cfg
        k, e, h = len(OPERATIONS), cfg.emb_dim, cfg.hidden
        self.embed = nn.Embedding(cfg.vocab_size, e, padding_idx=cfg.pad_id)
        self.question_rnn = nn.GRU(e, h, batch_first=True)
        self.ops = nn.Parameter(torch.randn(k, h) * 0.1)  # U: operation embeddings
        self.history = nn.GRUCell(h + e, h)
        self.op_select = nn.Linear(3 * h, h)  # W_op
        self.col_select = nn.Linear(3 * h, e)  # W_col, compared with column-name embeddings

    def encode_question(self, question: Tensor, q_len: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """question [B,L] int64 (right-padded), q_len [B] -> q [B,H] (the state after the last
        word), the states of every word z [B,L,H] and their mask [B,L]."""
        z, _ = self.question_rnn(self.embed(question))  # [B,L,H]
        last = (q_len - 1).clamp(min=0).view(-1, 1, 1).expand(-1, 1, z.shape[2])  # [B,1,H]
        mask = torch.arange(z.shape[1], device=z.device).unsqueeze(0) < q_len.unsqueeze(1)  # [B,L]
        return z.gather(1, last).squeeze(1), z, mask

    def run(self, batch: dict[str, Tensor], hard: bool) -> dict[str, Tensor]:
        """The T-step program. ``hard``: execute argmax choices (prediction) instead of the mixture.

        Returns scalar [B], lookup [B,M,C], soft op_weights [B,T,K] and col_weights [B,T,C].
        """
        table, row_mask = batch["table"], batch["row_mask"]  # [B,M,C], [B,M]
        q, words, word_mask = self.encode_question(batch["question"], batch["q_len"])  # [B,H], [B,L,H], [B,L]
        cols = self.embed(batch["columns"])  # [B,C,E] column-name embeddings (P)
        pivot = batch["pivot"].view(-1, 1, 1)  # [B,1,1]
        greater = (table > pivot).to(table.dtype) * row_mask.unsqueeze(-1)  # [B,M,C]
        lesser = (table < pivot).to(table.dtype) * row_mask.unsqueeze(-1)
        rs = row_mask
        h = q.new_zeros(q.shape[0], self.cfg.hidden)
        prev = q.new_zeros(q.shape[0], self.cfg.hidden + self.cfg.emb_dim)  # c_0
        scalar = q.new_zeros(q.shape[0])
        lookup = torch.zeros_like(table)
        op_ws, col_ws = [], []
        for _ in range(self.cfg.steps):
            h = self.history(prev, h)  # [B,H]
            # Question attention (§2.3): each step reads the words it needs, e.g. the filter
            # column's name first and the answer column's name later.
            beta = torch.softmax(torch.bmm(words, h.unsqueeze(-1)).squeeze(-1) + (~word_mask) * -1e9, dim=-1)  # [B,L]
            q_t = torch.bmm(beta.unsqueeze(1), words).squeeze(1)  # [B,1,L]x[B,L,H] -> [B,H]
            qh = torch.cat([q, q_t, h], dim=-1)  # [B,3H]
            op_w = torch.softmax(torch.tanh(self.op_select(qh)) @ self.ops.T, dim=-1)  # [B,H]x[H,K] -> [B,K]
            col_w = torch.softmax(torch.bmm(cols, torch.tanh(self.col_select(qh)).unsqueeze(-1)).squeeze(-1)
                                  + (batch["columns"] == self.cfg.pad_id) * -1e9, dim=-1)  # [B,C,E]x[B,E,1] -> [B,C]
            op_ws.append(op_w)
            col_ws.append(col_w)
            if hard:  # the discrete program: one operation and one column per step
                op_w, col_w = one_hot_max(op_w), one_hot_max(col_w)
            a = op_w.unsqueeze(-1)  # [B,K,1]
            on_col = col_w.unsqueeze(1)  # [B,1,C]
            cells = (rs.unsqueeze(-1) * table).sum(1)  # [B,C] column sums over selected rows
            scalar = a[:, COUNT, 0] * rs.sum(1) + a[:, SUM, 0] * (col_w * cells).sum(1)  # [B]
            lookup = a[:, PRINT].unsqueeze(-1) * rs.unsqueeze(-1) * on_col  # [B,1,1]*[B,M,1]*[B,1,C] -> [B,M,C]
            last = first_selected(rs.flip(1), hard).flip(1)  # [B,M]
            rs = (a[:, RESET] * row_mask + a[:, GREATER] * (greater * on_col).sum(-1)
                  + a[:, LESSER] * (lesser * on_col).sum(-1) + a[:, FIRST] * first_selected(rs, hard)
                  + a[:, LAST] * last + (a[:, COUNT] + a[:, SUM] + a[:, PRINT]) * rs)  # [B,M]
            prev = torch.cat([op_w @ self.ops, torch.bmm(col_w.unsqueeze(1), cols).squeeze(1)], dim=-1)  # [B,H+E]
        return {"scalar": scalar, "lookup": lookup, "is_lookup": op_ws[-1].argmax(-1) == PRINT,
                "op_weights": torch.stack(op_ws, 1), "col_weights": torch.stack(col_ws, 1)}  # T x [B,·] -> [B,T,·]

    # ---- model contract --------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Huber loss on scalar answers (in log space), log-loss over real cells on lookup answers
        (§2.5)."""
        cfg = self.cfg
        out = self.run(batch, hard=False)
        is_lookup = batch["answer_is_lookup"].to(out["scalar"].dtype)  # [B]
        # Huber in log space: counts (≤ 10) and sums (hundreds) weigh alike (on one absolute
        # scale counts were never learned), and a wrong operation is never a cheap answer (on
        # the relative error, "count" was a bounded-cost answer to every sum and stuck there).
        scalar_loss = F.huber_loss(torch.log1p(out["scalar"].clamp(min=0)), torch.log1p(batch["answer"]),
                                   delta=cfg.huber_delta, reduction="none")  # [B]
        cell_mask = batch["row_mask"].unsqueeze(-1) * (batch["columns"] != cfg.pad_id).unsqueeze(1)  # [B,M,C]
        bce = F.binary_cross_entropy(out["lookup"].clamp(1e-6, 1 - 1e-6), batch["answer_cells"], reduction="none")
        lookup_loss = (bce * cell_mask).sum((1, 2)) / cell_mask.sum((1, 2))  # [B]
        loss = ((1 - is_lookup) * scalar_loss + cfg.lookup_weight * is_lookup * lookup_loss).mean()
        with torch.no_grad():
            right = correct(self.run(batch, hard=True), batch)
        return loss, {"accuracy": right.float().mean()}

    @torch.no_grad()
    def predict(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Executes the argmax program. Returns scalar [B], lookup [B,M,C] (0/1 cells),
        is_lookup [B] (int64: 1 = the answer is the lookup), and the soft op_weights [B,T,K] and
        col_weights [B,T,C]."""
        out = self.run(batch, hard=True)
        return {**out, "is_lookup": out["is_lookup"].long()}

    def export_graphs(self) -> dict[str, ExportSpec]:
        """One graph, ``model``: a fixed number of program steps over a padded table."""
        b = {0: "batch"}
        ex = {"question": torch.tensor([[1, 2, 3], [1, 2, 0]]), "q_len": torch.tensor([3, 2]),
              "columns": torch.tensor([[4, 5, 6], [4, 5, 6]]), "table": torch.rand(2, 4, 3) * 100,
              "row_mask": torch.ones(2, 4), "pivot": torch.tensor([50.0, 20.0])}
        axes = {"question": {0: "batch", 1: "words"}, "q_len": b, "columns": {0: "batch", 1: "columns"},
                "table": {0: "batch", 1: "rows", 2: "columns"}, "row_mask": {0: "batch", 1: "rows"}, "pivot": b,
                "scalar": b, "lookup": {0: "batch", 1: "rows", 2: "columns"}, "is_lookup": b,
                "op_weights": b, "col_weights": {0: "batch", 2: "columns"}}
        return {"model": graph(self, _program, ex, ["scalar", "lookup", "is_lookup", "op_weights", "col_weights"],
                               axes)}


def correct(out: dict[str, Tensor], batch: dict[str, Tensor]) -> Tensor:
    """[B] bool: the predicted answer equals the reference (scalar to 1e-3, lookup cell for cell)."""
    real = batch["row_mask"].unsqueeze(-1) > 0  # [B,M,1]
    cells_ok = (((out["lookup"] > 0.5) == (batch["answer_cells"] > 0.5)) | ~real).flatten(1).all(1)  # [B]
    scalar_ok = (out["scalar"] - batch["answer"]).abs() < 1e-3
    want_lookup = batch["answer_is_lookup"] > 0
    return (out["is_lookup"].bool() == want_lookup) & torch.where(want_lookup, cells_ok, scalar_ok)


def _program(model: NeuralProgrammer, question: Tensor, q_len: Tensor, columns: Tensor, table: Tensor,
             row_mask: Tensor, pivot: Tensor) -> tuple[Tensor, ...]:
    batch = {"question": question, "q_len": q_len, "columns": columns, "table": table, "row_mask": row_mask,
             "pivot": pivot}
    out = model.run(batch, hard=True)
    return out["scalar"], out["lookup"], out["is_lookup"].long(), out["op_weights"], out["col_weights"]
