"""German→English translation on real parallel text from Debian packages, or on a user's own corpus.

``prepare`` builds the corpus with :mod:`pipeline.tasks.translation_de_en.corpus` (LibreOffice and GNOME help, KDE
handbooks, man pages, package descriptions, gettext catalogs: ``params.yaml`` switches each
source), split by document; a sample of the ``dict-de-en`` example sentences that share no side
with the corpus is kept as an out-of-domain test set (``test_dict``). ``tasks.<task>.corpus: pairs.tsv``
(or ``.parquet``; columns source, target) replaces the Debian sources with a user's pairs, any
language pair; a task of another name runs the same code with ``like: translation_de_en``.
Subwords: one SentencePiece unigram model per side, saved with the data so they travel with the
published model.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import torch

from pipeline.tasks import Task, TaskError, register_task

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SIDES = (("de", 0), ("en", 1))  # file names of the two sides (any language pair: "de" is the source)


def held_out_dictionary(params: dict, cache: Path, split: dict) -> list:
    """Up to ``dict_test_size`` dict-de-en example sentences, cleaned like the corpus, none sharing a
    side with any corpus pair (an out-of-domain check: everyday sentences, not documentation)."""
    from pipeline.tasks.translation_de_en.corpus import get_source
    from pipeline.tasks.translation_de_en.corpus.clean import Rules, clean_pair, key
    from pipeline.tasks.translation_de_en.corpus.debian import fetch

    source = get_source("dictionary")
    fetched = fetch(source.packages({}), cache, hint="set tasks.translation_de_en.dict_test_size: 0")
    trees = {n: tree for n, (_, tree) in fetched.items()}
    taken = {key(x) for rows in split.values() for p in rows for x in (p.de, p.en)}
    rules, out, seen = Rules.of(params.get("clean")), [], set()
    for p in source.pairs(trees, {}, cache):
        got = clean_pair(p.de, p.en, rules)
        if got and key(got[0]) not in taken and key(got[1]) not in taken and key(got[1]) not in seen:
            seen.add(key(got[1]))
            out.append(type(p)(got[0], got[1], p.source, p.doc, p.licence))
    return random.Random(params["seed"]).sample(out, min(params["dict_test_size"], len(out)))


def _pack(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Ragged id lists as one flat int32 tensor + offsets (compact on disk; lists of 360k lists are not)."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    flat = torch.tensor([t for r in rows for t in r], dtype=torch.int32)
    return {"ids": flat, "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])}


def _unpack(packed: dict[str, torch.Tensor]) -> list[list[int]]:
    ids, off = packed["ids"].tolist(), packed["offsets"].tolist()
    return [ids[a:b] for a, b in zip(off[:-1], off[1:])]


class TranslationTask(Task):
    name = "translation_de_en"
    card = {"data": "German→English pairs from Debian packages: LibreOffice help, package descriptions (DDTP), "
                    "man pages, KDE and GNOME handbooks (data/provenance/translation_de_en.json "
                    "lists packages and versions), split by document, tokenised with SentencePiece",
            "licence": "per pair, of its package (MPL-2.0, GPL, GFDL, CC-BY-SA...): the prepared data's "
                       "licence column",
            "paper": "Bahdanau et al. 2015; Luong et al. 2015; Vaswani et al. 2017"}
    # Source ids are the German pieces followed by EOS, exactly as prepare encodes them.
    serving = {"source_tokenizer": "spm.de.model", "target_tokenizer": "spm.en.model", "append_eos": True}

    def prepare(self, params: dict, out: Path) -> dict:
        import sentencepiece as spm

        from pipeline.tasks.translation_de_en.corpus import CorpusError
        from pipeline.tasks.translation_de_en.corpus.build import build
        from pipeline.tasks.translation_de_en.corpus.debian import default_cache

        cache = Path(params["cache"]).expanduser() if params.get("cache") else default_cache()
        try:
            split, facts = build(params, cache)
            if params.get("dict_test_size") and not params.get("corpus"):
                split["test_dict"] = held_out_dictionary(params, cache, split)
        except CorpusError as e:  # one sentence naming the fix; earlier prepared data stays (prepare.py)
            raise TaskError(str(e)) from None
        for side, idx in SIDES:
            # From memory, not a file: a model trained from a file records the file's absolute path,
            # so the same data prepared in two clones gave different bytes (and retrained everything).
            model = io.BytesIO()
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sorted({(p.de, p.en)[idx] for p in split["train"]})), model_writer=model,
                vocab_size=params["vocab_size"], model_type="unigram", character_coverage=1.0,
                pad_id=PAD, bos_id=BOS, eos_id=EOS, unk_id=UNK, num_threads=1,
                input_sentence_size=params.get("spm_sentences", 0), shuffle_input_sentence=False,
                byte_fallback=True, hard_vocab_limit=False, minloglevel=2,
            )
            (out / f"spm.{side}.model").write_bytes(model.getvalue())
        sp = {s: spm.SentencePieceProcessor(model_file=str(out / f"spm.{s}.model")) for s, _ in SIDES}
        for name, rows in split.items():
            torch.save({
                "src": _pack([ids + [EOS] for ids in sp["de"].encode([p.de for p in rows])]),
                "tgt": _pack(sp["en"].encode([p.en for p in rows])),
                "src_text": [p.de for p in rows], "tgt_text": [p.en for p in rows],
                "source": [p.source for p in rows], "doc": [p.doc for p in rows], "licence": [p.licence for p in rows],
            }, out / f"{name}.pt")
        facts["pairs"] = {k: len(v) for k, v in split.items()}
        facts.update(vocab_size=params["vocab_size"],
                     # Decoding limit: sentences of up to clean.max_words (40) words reach ~90 pieces.
                     model_defaults={"src_vocab": params["vocab_size"], "tgt_vocab": params["vocab_size"],
                                     "pad_id": PAD, "bos_id": BOS, "eos_id": EOS, "max_len": 100},
                     artifacts=["spm.de.model", "spm.en.model"])
        return facts

    def changes(self, before: dict[str, Path], after: Path) -> list[str]:
        """The sentence pairs added and removed, in all and per split (a pair: its German and English text)."""
        def pairs(path: Path | None) -> set[tuple[str, str]]:
            if path is None or not path.is_file():
                return set()
            rows = torch.load(path)
            return set(zip(rows["src_text"], rows["tgt_text"]))

        splits = sorted({n.removesuffix(".pt") for n in before if n.endswith(".pt")}
                        | {p.stem for p in after.glob("*.pt")})
        per, old_all, new_all = [], set(), set()
        for split in splits:
            old, new = pairs(before.get(f"{split}.pt")), pairs(after / f"{split}.pt")
            per.append(f"{split} +{len(new - old):,} −{len(old - new):,}")
            old_all, new_all = old_all | old, new_all | new
        # In all: a pair the split moved from one set to another is neither added nor removed.
        return [f"pairs: +{len(new_all - old_all):,} added, −{len(old_all - new_all):,} removed; by split, "
                f"moves between them included: {', '.join(per)}"]

    def load(self, data_dir: Path, split: str) -> list[dict]:
        d = torch.load(data_dir / f"{split}.pt")
        return [{"src": s, "tgt": t, "src_text": st, "tgt_text": tt, "source": so}
                for s, t, st, tt, so in zip(_unpack(d["src"]), _unpack(d["tgt"]), d["src_text"], d["tgt_text"],
                                            d["source"])]

    def example_batch(self, cfg: dict, seed: int = 0, batch: int = 3) -> dict:
        """Random ids below the vocabularies: sources of 6, 4 and 2 ids ending in EOS, targets of 5."""
        g = torch.Generator().manual_seed(seed)
        src_len = torch.tensor([6, 4, 2][:batch])
        src = torch.randint(4, cfg["src_vocab"], (batch, 6), generator=g)
        src[:, -1] = EOS
        for b, n in enumerate(src_len):
            src[b, n - 1] = EOS
            src[b, n:] = PAD
        tgt = torch.randint(4, cfg["tgt_vocab"], (batch, 5), generator=g)
        tgt_in = torch.cat([torch.full((batch, 1), BOS), tgt], 1)  # [B,1]+[B,5] -> [B,6]
        tgt_out = torch.cat([tgt, torch.full((batch, 1), EOS)], 1)
        return {"src": src, "src_len": src_len, "tgt_in": tgt_in, "tgt_out": tgt_out}

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
    import sacrebleu
    import sentencepiece as spm

    from pipeline import plots as P

    task = TranslationTask()
    items = task.load(run.data_dir, "test")
    limit = run.evaluate.get("max_sentences")
    items = items[:limit] if limit else items
    sp = {s: spm.SentencePieceProcessor(model_file=str(run.data_dir / f"spm.{s}.model")) for s in ("de", "en")}
    cfg = model.cfg
    hyp_greedy = greedy_translate(model, task, items, sp["en"])
    from serving.decode import BEAM

    beam = run.evaluate.get("beam", BEAM)
    beam_out = beam_translate(model, items, run.evaluate, desc=f"beam {beam} {run.name}")
    refs = [it["tgt_text"] for it in items]
    hyp_beam = [sp["en"].decode(o["tokens"].tolist()) for o in beam_out]
    bleu = sacrebleu.BLEU()
    metrics = {"bleu_greedy": round(bleu.corpus_score(hyp_greedy, [refs]).score, 2),
               **score_beam(items, hyp_beam, beam, run.evaluate.get("min_source", 100))}
    ood = task.load(run.data_dir, "test_dict") if (run.data_dir / "test_dict.pt").exists() else []
    if ood:  # out of domain: everyday dictionary sentences, greedy (a check, not the headline)
        hyp = greedy_translate(model, task, ood, sp["en"])
        metrics["dict_test"] = {"sentences": len(ood),
                                "bleu_greedy": round(bleu.corpus_score(hyp, [[it["tgt_text"] for it in ood]]).score, 2),
                                "bleu_copy_source": round(bleu.corpus_score(
                                    [it["src_text"] for it in ood], [[it["tgt_text"] for it in ood]]).score, 2)}
    buckets = []
    for label, low, high in _buckets(run.evaluate.get("length_buckets", [5, 10, 15])):
        sel = [i for i, it in enumerate(items) if low <= len(it["src_text"].split()) <= high]
        score = sacrebleu.corpus_bleu([hyp_beam[i] for i in sel], [[refs[i] for i in sel]]).score if sel else 0.0
        buckets.append({"bucket": label, "sentences": len(sel), "bleu": round(score, 2)})
    metrics["bleu_by_length"] = buckets
    metrics["examples"] = [{"src": items[i]["src_text"], "ref": refs[i], "beam": hyp_beam[i], "greedy": hyp_greedy[i]}
                           for i in range(min(8, len(items)))]
    if hasattr(model, "decode_uncached"):
        # A correctness check, not a metric: re-running the whole prefix every step costs O(T^2), over
        # 2,500 sentences of up to 40 words longer than the beam search itself, so a sample of them.
        sample = items[:: max(1, len(items) // run.evaluate.get("cache_check_sentences", 256))]
        metrics["cache_check"] = cache_check(model, task, sample)
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
    row = {"headline": {"bleu_beam": metrics["bleu_beam"], "bleu_greedy": metrics["bleu_greedy"],
                        "chrf_beam": metrics["chrf_beam"], "bleu_copy_source": metrics["bleu_copy_source"],
                        **({"bleu_dict_greedy": metrics["dict_test"]["bleu_greedy"]}
                           if "dict_test" in metrics else {})},
           "by_length": {"metric": "BLEU (beam)", "xlabel": "source sentence length (words)",
                         "labels": [b["bucket"] for b in buckets], "values": [b["bleu"] for b in buckets],
                         "counts": [b["sentences"] for b in buckets]},
           "by_group": {"metric": "BLEU (beam)", "title": "corpus source",
                        "note": "Sources with at least 100 test sentences; the floor copies the German source "
                                "unchanged (names, commands and numbers pass through).",
                        "labels": [g["source"] for g in metrics["by_source"]],
                        "values": [g["bleu"] for g in metrics["by_source"]],
                        "floor": [g["bleu_copy_source"] for g in metrics["by_source"]],
                        "counts": [g["sentences"] for g in metrics["by_source"]]}}
    return metrics, row


def score_beam(items: list[dict], hyp_beam: list[str], beam: int, min_source: int) -> dict:
    """The beam metrics of ``hyp_beam`` (one text per test item): BLEU and chrF, the copy floor, by
    corpus source (each with at least ``min_source`` sentences) and the floor as bar metrics
    (overall, and the worst source). Also how ``publish`` scores another serving engine."""
    import sacrebleu

    refs, copy = [it["tgt_text"] for it in items], [it["src_text"] for it in items]
    bleu, chrf = sacrebleu.BLEU(), sacrebleu.CHRF()
    metrics = {
        "bleu_beam": round(bleu.corpus_score(hyp_beam, [refs]).score, 2),
        "chrf_beam": round(chrf.corpus_score(hyp_beam, [refs]).score, 2),
        "bleu_copy_source": round(bleu.corpus_score(copy, [refs]).score, 2),
        "beam": beam, "test_sentences": len(items),
        "signature": {"bleu": str(bleu.get_signature()), "chrf": str(chrf.get_signature())},
    }
    metrics["by_source"] = by_source(items, hyp_beam, refs, copy, min_sentences=min_source)
    metrics["bleu_over_copy"] = round(metrics["bleu_beam"] - metrics["bleu_copy_source"], 2)
    metrics["min_source_over_copy"] = min((round(g["bleu"] - g["bleu_copy_source"], 2) for g in metrics["by_source"]),
                                          default=metrics["bleu_over_copy"])
    return metrics


def beam_translate(model, items: list[dict], options: dict, desc: str = "beam") -> list[dict]:
    """Beam search (``options``: an entry's ``evaluate`` block: beam, length penalty...) of each
    item's source alone, on the model's own export graphs run by PyTorch: the loop the served ONNX
    graphs run. Returns ``serving.decode.beam_search``'s answer per item (tokens, attention...)."""
    from tqdm.auto import tqdm

    from pipeline.graphs import TorchGraph
    from serving.decode import BEAM, beam_search, search_options

    cfg, specs = model.cfg, model.export_graphs()
    enc, step = TorchGraph(specs["encoder"]), TorchGraph(specs["decoder_step"])
    out = []
    for it in tqdm(items, desc=desc, mininterval=5):
        src = np.array([it["src"]], dtype=np.int64)
        out.append(beam_search(enc, step, src, np.array([src.shape[1]]), cfg.bos_id, cfg.eos_id, cfg.max_len,
                               beam=options.get("beam", BEAM), **search_options(options)))
    return out


def greedy_translate(model, task, items: list[dict], sp_en) -> list[str]:
    """Greedy translations (``model.predict``) in batches of 64 similar-length sources."""
    ids = [None] * len(items)
    order = sorted(range(len(items)), key=lambda i: len(items[i]["src"]))
    for start in range(0, len(order), 64):
        idx = order[start : start + 64]
        out = model.predict(task.collate([items[i] for i in idx]))
        for row, i in enumerate(idx):
            ids[i] = out["tokens"][row, : out["lengths"][row]].tolist()
    return [sp_en.decode(x) for x in ids]


def by_source(items: list[dict], hyps: list[str], refs: list[str], copy: list[str], min_sentences: int) -> list[dict]:
    """BLEU and chrF per corpus source (those with at least ``min_sentences`` test sentences), beside
    the copy-the-source floor on the same sentences."""
    import sacrebleu

    rows = []
    for name in sorted({it.get("source", "") for it in items}):
        sel = [i for i, it in enumerate(items) if it.get("source", "") == name]
        if len(sel) < min_sentences:
            continue
        pick = lambda xs, sel=sel: [xs[i] for i in sel]  # noqa: E731 (sel bound now: B023)
        rows.append({"source": name, "sentences": len(sel),
                     "bleu": round(sacrebleu.corpus_bleu(pick(hyps), [pick(refs)]).score, 2),
                     "chrf": round(sacrebleu.corpus_chrf(pick(hyps), [pick(refs)]).score, 2),
                     "bleu_copy_source": round(sacrebleu.corpus_bleu(pick(copy), [pick(refs)]).score, 2)})
    return rows


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
