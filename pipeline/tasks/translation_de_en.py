"""German→English sentence pairs from Debian's ``dict-de-en`` (TU Chemnitz "Ding" dictionary).

The dictionary holds, between word entries, example sentences: a German sentence ending in
``.?!`` followed by its English translation, indented three spaces. Lines wrap at 72 columns
with unindented continuation lines. We keep pairs where both sides are full sentences, strip
annotations, drop ambiguous alternatives, deduplicate, and split by English sentence so no test
reference was seen in training. Subwords: one SentencePiece unigram model per language, saved
with the data so they travel with the published model.
"""

from __future__ import annotations

import gzip
import random
import re
from collections import defaultdict
from pathlib import Path

import torch

from pipeline.tasks import Task, TaskError, register_task

SOURCE = Path("/usr/share/dictd/german-english.dict.dz")
PACKAGE = "dict-de-en"
WRAP = 60  # a line at least this long may continue on the next, unindented line
PAD, BOS, EOS, UNK = 0, 1, 2, 3
_ANNOT = re.compile(r"\{[^}]*\}|\[[^\]]*\]|/[^/]*/|\([^)]*\)")
_SENT_END = re.compile(r"[.?!]$")
_QUOTES = str.maketrans({"’": "'", "‘": "'", "“": '"', "”": '"', "„": '"', "‚": "'", "–": "-"})


def _clean(text: str) -> str:
    text = _ANNOT.sub(" ", text.translate(_QUOTES))
    return re.sub(r"\s+", " ", text).strip()


def _continues(prev: str, line: str) -> bool:
    """Is ``line`` the wrapped tail of ``prev``? Only long lines wrap; a new entry after a
    sentence-final line starts with a capital, a wrapped tail usually does not."""
    if len(prev) < WRAP or not line or line.startswith(" "):
        return False
    return not _SENT_END.search(prev.rstrip()) or not line[0].isupper()


def dictionary_entries(lines: list[str]) -> list[tuple[str, str]]:
    """Parse the dictd text into raw (german, english) entries, wrapped lines joined."""
    pairs = []
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        if not line or line.startswith(" "):
            i += 1
            continue
        german = line
        j = i + 1
        while j < n and _continues(lines[j - 1], lines[j]):
            german += " " + lines[j]
            j += 1
        # Optional part-of-speech line (" {f} [tag]") or blank line before the English side.
        if j < n and (lines[j] == "" or (lines[j].startswith(" ") and not lines[j].startswith("   "))):
            j += 1
        if j < n and lines[j].startswith("   "):
            english = lines[j].strip()
            k = j + 1
            while k < n and _continues(lines[k - 1], lines[k]):
                english += " " + lines[k]
                k += 1
            pairs.append((german.strip(), english))
            i = k
        else:
            i = j
    return pairs


_PLACEHOLDERS = ("sth.", "sb.", "etw.", "jdm.", "jdn.", "jds.", "jd.")


def extract_pairs(lines: list[str]) -> list[tuple[str, str]]:
    """Example sentence pairs: both sides full sentences, first English alternative."""
    out = []
    for german, english in dictionary_entries(lines):
        if not _SENT_END.search(german) or "/" in german or "/" in english:
            continue
        english = english.split(";")[0].split("|")[0].strip()
        german, english = _clean(german), _clean(english)
        if not (_SENT_END.search(german) and _SENT_END.search(english)):
            continue
        if not german[0].isupper() or not english[0].isupper():
            continue
        if any(p in english or p in german for p in _PLACEHOLDERS):
            continue
        if 3 <= len(german.split()) and 3 <= len(english.split()):
            out.append((german, english))
    return out


def extract_lexicon(lines: list[str], max_words: int = 4) -> list[tuple[str, str]]:
    """Word and phrase entries (not sentences): (headword, first English alternative), both
    sides at most ``max_words`` words, no placeholders. Used as extra training data: the
    ~15k sentences alone cannot teach the vocabulary the test sentences use."""
    out = set()
    for german, english in dictionary_entries(lines):
        if _SENT_END.search(german) or "/" in german or "/" in english:
            continue
        german, english = _clean(german), _clean(english.split(";")[0].split("|")[0])
        if not german or not english or any(p in english or p in german for p in _PLACEHOLDERS):
            continue
        if len(german.split()) <= max_words and len(english.split()) <= max_words:
            out.add((german, english))
    return sorted(out)


def _split(pairs, seed: int, val_size: int, test_size: int):
    """Deduplicate, then split by English sentence (all Germans of one English go together)."""
    by_english = defaultdict(set)
    for de, en in pairs:
        by_english[en].add(de)
    groups = sorted(by_english)
    random.Random(seed).shuffle(groups)
    split, count = {"test": [], "val": [], "train": []}, {"test": 0, "val": 0}
    for en in groups:
        name = "test" if count["test"] < test_size else "val" if count["val"] < val_size else "train"
        for de in sorted(by_english[en]):
            split[name].append((de, en))
        if name != "train":
            count[name] += 1
    return split


class TranslationTask(Task):
    name = "translation_de_en"
    card = {"data": "German→English example sentences of the TU Chemnitz 'Ding' dictionary "
                    "(Debian package dict-de-en), tokenised with SentencePiece",
            "licence": "GPL-2+ (dict-de-en)",
            "paper": "Bahdanau et al. 2015; Luong et al. 2015; Vaswani et al. 2017"}

    def prepare(self, params: dict, out: Path) -> dict:
        import sentencepiece as spm

        if not SOURCE.exists():
            raise TaskError(
                f"{SOURCE} is missing: install the Debian package with "
                f"`sudo apt-get install {PACKAGE}` (or run `make setup`)."
            )
        lines = gzip.open(SOURCE, "rt", encoding="utf-8").read().split("\n")
        pairs = [p for p in extract_pairs(lines) if len(p[0].split()) <= params["max_words"]
                 and len(p[1].split()) <= params["max_words"]]
        split = _split(sorted(set(pairs)), params["seed"], params["val_size"], params["test_size"])
        lexicon = extract_lexicon(lines)
        lexicon = random.Random(params["seed"]).sample(lexicon, min(params["lexicon_pairs"], len(lexicon)))
        meta = {"pairs": {k: len(v) for k, v in split.items()}, "lexicon_pairs": len(lexicon),
                "sentence_repeat": params["sentence_repeat"]}
        # Training rows: each example sentence repeated, plus the sampled dictionary phrases.
        split["train"] = split["train"] * params["sentence_repeat"] + lexicon
        for side, idx in (("de", 0), ("en", 1)):
            text = out / f"train.{side}.txt"
            rows = sorted({p[idx] for p in split["train"]})
            text.write_text("\n".join(rows) + "\n", encoding="utf-8")
            spm.SentencePieceTrainer.train(
                input=str(text), model_prefix=str(out / f"spm.{side}"),
                vocab_size=params["vocab_size"], model_type="unigram", character_coverage=1.0,
                pad_id=PAD, bos_id=BOS, eos_id=EOS, unk_id=UNK, num_threads=1,
                shuffle_input_sentence=False, minloglevel=2,
            )
            text.unlink()
        sp = {s: spm.SentencePieceProcessor(model_file=str(out / f"spm.{s}.model")) for s in ("de", "en")}
        for name, rows in split.items():
            torch.save({
                "src": [sp["de"].encode(de) + [EOS] for de, _ in rows],
                "tgt": [sp["en"].encode(en) for _, en in rows],
                "src_text": [de for de, _ in rows],
                "tgt_text": [en for _, en in rows],
            }, out / f"{name}.pt")
        meta.update(source=str(SOURCE), package=PACKAGE, vocab_size=params["vocab_size"],
                    model_defaults={"src_vocab": params["vocab_size"], "tgt_vocab": params["vocab_size"],
                                    "pad_id": PAD, "bos_id": BOS, "eos_id": EOS},
                    artifacts=["spm.de.model", "spm.en.model"])
        return meta

    def load(self, data_dir: Path, split: str) -> list[dict]:
        d = torch.load(data_dir / f"{split}.pt")
        return [{"src": s, "tgt": t, "src_text": st, "tgt_text": tt}
                for s, t, st, tt in zip(d["src"], d["tgt"], d["src_text"], d["tgt_text"])]

    def evaluate(self, model, run, plots: Path) -> tuple[dict, dict]:
        return evaluate_translation(model, run, plots)

    def parity_batches(self, data_dir: Path) -> list[tuple[str, dict]]:
        return translation_parity_batches(data_dir)

    def length(self, item: dict) -> int:
        return max(len(item["src"]), len(item["tgt"]))

    def collate(self, items: list[dict]) -> dict:
        """Pads to the longest item. tgt_in = BOS + y, tgt_out = y + EOS."""
        bsz = len(items)
        src_len = torch.tensor([len(it["src"]) for it in items])
        tgt_len = max(len(it["tgt"]) for it in items) + 1
        src = torch.full((bsz, int(src_len.max())), PAD, dtype=torch.long)
        tgt_in = torch.full((bsz, tgt_len), PAD, dtype=torch.long)
        tgt_out = torch.full((bsz, tgt_len), PAD, dtype=torch.long)
        for b, it in enumerate(items):
            src[b, : len(it["src"])] = torch.tensor(it["src"])
            y = torch.tensor(it["tgt"], dtype=torch.long)
            tgt_in[b, 0] = BOS
            tgt_in[b, 1 : len(y) + 1] = y
            tgt_out[b, : len(y)] = y
            tgt_out[b, len(y)] = EOS
        return {"src": src, "src_len": src_len, "tgt_in": tgt_in, "tgt_out": tgt_out}



def _buckets(edges: list[int]) -> list[tuple[str, int, int]]:
    """[5, 10] -> [("1-5", 1, 5), ("6-10", 6, 10), ("11+", 11, inf)]."""
    out, low = [], 1
    for edge in edges:
        out.append((f"{low}-{edge}", low, edge))
        low = edge + 1
    return out + [(f"{low}+", low, 10**9)]


def evaluate_translation(model, run, plots: Path) -> tuple[dict, dict]:
    """Test BLEU (sacrebleu) with greedy and beam search, BLEU by source length, heatmaps.

    Returns: (metrics, comparison row for the task report).
    """
    import numpy as np
    import sacrebleu
    import sentencepiece as spm
    from tqdm.auto import tqdm

    from pipeline import plots as P
    from pipeline.graphs import TorchGraph
    from serving.decode import beam_search

    task = TranslationTask()
    items = task.load(run.data_dir, "test")
    limit = run.evaluate.get("max_sentences")
    items = items[:limit] if limit else items
    sp = {s: spm.SentencePieceProcessor(model_file=str(run.data_dir / f"spm.{s}.model")) for s in ("de", "en")}
    cfg = model.cfg
    greedy_ids = [None] * len(items)
    order = sorted(range(len(items)), key=lambda i: len(items[i]["src"]))
    for start in range(0, len(order), 64):
        idx = order[start : start + 64]
        out = model.predict(task.collate([items[i] for i in idx]))
        for row, i in enumerate(idx):
            greedy_ids[i] = out["tokens"][row, : out["lengths"][row]].tolist()
    specs = model.export_graphs()
    enc, step = TorchGraph(specs["encoder"]), TorchGraph(specs["decoder_step"])
    beam = run.evaluate.get("beam", 5)
    beam_out = []
    for it in tqdm(items, desc=f"beam {beam} {run.name}", mininterval=5):
        src = np.array([it["src"]], dtype=np.int64)
        beam_out.append(beam_search(enc, step, src, np.array([src.shape[1]]), cfg.bos_id, cfg.eos_id,
                                    cfg.max_len, beam=beam, length_penalty=run.evaluate.get("length_penalty", 1.0)))
    refs = [it["tgt_text"] for it in items]
    hyp_greedy = [sp["en"].decode(ids) for ids in greedy_ids]
    hyp_beam = [sp["en"].decode(o["tokens"].tolist()) for o in beam_out]
    metrics = {
        "bleu_greedy": round(sacrebleu.corpus_bleu(hyp_greedy, [refs]).score, 2),
        "bleu_beam": round(sacrebleu.corpus_bleu(hyp_beam, [refs]).score, 2),
        "chrf_beam": round(sacrebleu.corpus_chrf(hyp_beam, [refs]).score, 2),
        "beam": beam, "test_sentences": len(items),
    }
    buckets = []
    for label, low, high in _buckets(run.evaluate.get("length_buckets", [5, 10, 15])):
        sel = [i for i, it in enumerate(items) if low <= len(it["src_text"].split()) <= high]
        score = sacrebleu.corpus_bleu([hyp_beam[i] for i in sel], [[refs[i] for i in sel]]).score if sel else 0.0
        buckets.append({"bucket": label, "sentences": len(sel), "bleu": round(score, 2)})
    metrics["bleu_by_length"] = buckets
    metrics["examples"] = [{"src": items[i]["src_text"], "ref": refs[i], "beam": hyp_beam[i], "greedy": hyp_greedy[i]}
                           for i in range(min(8, len(items)))]
    if hasattr(model, "decode_uncached"):
        metrics["cache_check"] = cache_check(model, task, items)
    if getattr(cfg, "attention", None) != "none":  # the RNNencdec ablation has no alignment
        for n, i in enumerate(sorted(range(len(items)), key=lambda i: len(items[i]["src"]))[len(items) // 2 :][:4]):
            src_tok = [sp["de"].id_to_piece(t) for t in items[i]["src"]]
            tgt_tok = [sp["en"].id_to_piece(t) for t in beam_out[i]["tokens"].tolist()] + ["</s>"]
            P.alignment(beam_out[i]["attention"], src_tok, tgt_tok, plots / f"alignment_{n}.png",
                        f"{run.name}: {hyp_beam[i][:60]}", "German source piece", "English output piece (beam)",
                        reference=refs[i][:80])
            greedy = model.predict(task.collate([items[i]]))
            if "attention_heads" in greedy:  # Transformer: every layer and head (greedy decode)
                steps = int(greedy["lengths"][0]) + 1  # the emitted pieces and the EOS step
                tgt_tok = [sp["en"].id_to_piece(t) for t in greedy["tokens"][0, : steps - 1].tolist()] + ["</s>"]
                P.head_grid(greedy["attention_heads"][0, :steps].numpy(), src_tok, tgt_tok,
                            plots / f"heads_{n}.png", f"{run.name}: {hyp_greedy[i][:60]}")
    row = {"headline": {"bleu_beam": metrics["bleu_beam"], "bleu_greedy": metrics["bleu_greedy"]},
           "by_length": {"metric": "BLEU (beam)", "xlabel": "source sentence length (words)",
                         "labels": [b["bucket"] for b in buckets], "values": [b["bleu"] for b in buckets]}}
    return metrics, row


def cache_check(model, task, items: list[dict]) -> dict:
    """Greedy decoding with the key/value cache (``predict``) against re-running the whole prefix
    (``decode_uncached``) on every test sentence: tokens must be identical."""
    same, worst = 0, 0.0
    for start in range(0, len(items), 64):
        batch = task.collate(items[start : start + 64])
        cached, full = model.predict(batch), model.decode_uncached(batch)
        if cached["tokens"].shape == full["tokens"].shape:  # else some row differs: none counted
            same += int((cached["tokens"] == full["tokens"]).all(dim=1).sum())
            worst = max(worst, float((cached["log_probs"] - full["log_probs"]).abs().max()))
    return {"sentences": len(items), "identical_tokens": same, "max_log_prob_diff": worst,
            "passed": same == len(items)}


def translation_parity_batches(data_dir: Path) -> list[tuple[str, dict]]:
    """Real test sentences: short, median and long sources at batch sizes 1, 4 and 16."""
    task = TranslationTask()
    items = sorted(task.load(data_dir, "test"), key=lambda it: len(it["src"]))
    cases = []
    for size in (1, 4, 16):
        for name, at in (("short", 0), ("median", len(items) // 2), ("long", len(items) - size)):
            chunk = items[at : at + size]
            cases.append((f"{name} src (≤{max(len(c['src']) for c in chunk)} tokens) × batch {size}",
                          task.collate(chunk)))
    return cases


register_task(TranslationTask())
