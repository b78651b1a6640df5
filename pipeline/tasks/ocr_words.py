"""``ocr_words``: text-line images of real English words, rendered in ``prepare``.

Words are the lower-case entries of Debian's ``wamerican`` list (``/usr/share/dict/american-english``)
of ``min_len``-``max_len`` letters. The split is by word: the val and test words never occur in
training, so the test measures reading, not recall. Each image is one word in one of the fonts
of ``params.fonts`` (DejaVu, Liberation and the handwriting-style dkg), at a random size, slant
(shear), blur, noise and background gradient, scaled to ``height`` pixels with its aspect ratio and
its width rounded up to a multiple of ``WIDTH_STEP`` (the model's horizontal stride, so a padded
batch and a single image give the same features), at most ``max_width`` (wider words are squeezed).

Images are kept ragged: all columns side by side in one uint8 [height, total width] array plus
offsets, a third of the size of padding every image to ``max_width``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from pipeline.tasks import Task, TaskError, register_task

PAD, BOS, EOS = 0, 1, 2
LETTERS = "abcdefghijklmnopqrstuvwxyz"
VOCAB = ["<pad>", "<s>", "</s>", *LETTERS]
WORDS_FILE = Path("/usr/share/dict/american-english")
FONT_DIR = Path("/usr/share/fonts/truetype")
WIDTH_STEP = 4  # the attention-OCR CNN halves the width twice


def read_words(path: Path, min_len: int, max_len: int) -> list[str]:
    if not path.exists():
        raise TaskError(f"{path} is missing: install the Debian package `wamerican` (`make setup` does)")
    pattern = re.compile(f"^[a-z]{{{min_len},{max_len}}}$")
    return sorted({w for w in path.read_text(encoding="utf-8", errors="replace").split() if pattern.match(w)})


def load_fonts(names: list[str], sizes: range) -> dict[str, dict]:
    """Font file (relative to /usr/share/fonts/truetype) -> {size: ImageFont}."""
    from PIL import ImageFont

    fonts = {}
    for name in names:
        path = FONT_DIR / name
        if not path.exists():
            raise TaskError(f"font {path} is missing: `make setup` installs fonts-dejavu-core, "
                            "fonts-liberation and fonts-dkg-handwriting")
        fonts[name] = {s: ImageFont.truetype(str(path), s) for s in sizes}
    return fonts


def render(word: str, font, rng: np.random.Generator, height: int, max_width: int, style: dict) -> np.ndarray:
    """One word as uint8 [height, W], W a multiple of WIDTH_STEP in [WIDTH_STEP, max_width]."""
    from PIL import Image, ImageDraw, ImageFilter

    left, top, right, bottom = font.getbbox(word)
    pad = font.size  # room for the shear
    mask = Image.new("L", (right - left + 2 * pad, bottom - top + 2 * pad), 0)
    ImageDraw.Draw(mask).text((pad - left, pad - top), word, fill=255, font=font)
    slant = rng.uniform(-style["slant"], style["slant"])
    # x' = x + slant * (y - centre): italic-like shear about the middle line
    cy = mask.height / 2
    mask = mask.transform(mask.size, Image.AFFINE, (1, slant, -slant * cy, 0, 1, 0), resample=Image.BILINEAR)
    box = mask.getbbox() or (0, 0, mask.width, mask.height)
    margin = rng.integers(1, style["margin"] + 1, size=4)
    box = (max(box[0] - margin[0], 0), max(box[1] - margin[1], 0),
           min(box[2] + margin[2], mask.width), min(box[3] + margin[3], mask.height))
    mask = mask.crop(box)
    width = int(round(mask.width * height / mask.height))
    width = min(max_width, max(WIDTH_STEP, -(-width // WIDTH_STEP) * WIDTH_STEP))
    mask = mask.resize((width, height), Image.BILINEAR)
    blur = rng.uniform(0, style["blur"])
    if blur > 0.05:
        mask = mask.filter(ImageFilter.GaussianBlur(blur))
    alpha = np.asarray(mask, dtype=np.float32) / 255.0  # [H,W]
    # background: a horizontal or vertical gradient between two grey levels; text contrasts by >= 80
    g0, g1 = rng.uniform(style["background"][0], style["background"][1], size=2)
    ramp = np.linspace(0, 1, width if rng.random() < 0.5 else height, dtype=np.float32)
    bg = g0 + (g1 - g0) * (ramp[None, :] if ramp.shape[0] == width else ramp[:, None])
    ink = rng.uniform(0, max(min(g0, g1) - 80, 1))
    if rng.random() < style["inverted"]:  # light text on a dark background
        bg, ink = 255 - bg, 255 - ink
    image = bg * (1 - alpha) + ink * alpha
    image = image + rng.normal(0, rng.uniform(0, style["noise"]), size=image.shape)
    return np.clip(np.round(image), 0, 255).astype(np.uint8)


def split_words(words: list[str], rng: np.random.Generator, val: int, test: int) -> dict[str, list[str]]:
    order = rng.permutation(len(words))
    if len(words) < val + test + 1000:
        raise TaskError(f"only {len(words)} words of the requested lengths: too few for the split")
    pick = lambda idx: sorted(words[i] for i in idx)  # noqa: E731
    return {"test": pick(order[:test]), "val": pick(order[test : test + val]), "train": pick(order[test + val :])}


class OcrWordsTask(Task):
    name = "ocr_words"
    card = {"data": "English words of the Debian word list wamerican rendered with the DejaVu, Liberation and "
                    "dkg-handwriting fonts; test words are unseen in training",
            "licence": "those of the Debian packages wamerican, fonts-dejavu-core, fonts-liberation and "
                       "fonts-dkg-handwriting (/usr/share/doc/<package>/copyright)",
            "paper": "Wojna et al. 2017; Lee & Osindero 2016"}
    serving = {"input": "text_image", "vocabulary": VOCAB, "width_step": WIDTH_STEP}

    def prepare(self, params: dict, out: Path) -> dict:
        from tqdm.auto import tqdm

        rng = np.random.default_rng(params["seed"])
        words = read_words(WORDS_FILE, params["min_len"], params["max_len"])
        split = split_words(words, rng, params["val_words"], params["test_words"])
        sizes = range(params["font_size"][0], params["font_size"][1] + 1)
        fonts = load_fonts(params["fonts"], sizes)
        names = list(fonts)
        counts = {}
        for name in ("train", "val", "test"):
            pool = split[name]
            count = params[f"{name}_size"]
            # every word once before any twice (train: more images than words)
            chosen = np.concatenate([rng.permutation(len(pool)) for _ in range(-(-count // len(pool)))])[:count]
            font_ids = rng.integers(len(names), size=count)
            images, labels = [], []
            for i in tqdm(range(count), desc=f"render {name}", mininterval=5):
                word = pool[chosen[i]]
                font = fonts[names[font_ids[i]]][int(rng.choice(sizes))]
                images.append(render(word, font, rng, params["height"], params["max_width"], params["style"]))
                labels.append(word)
            widths = np.array([im.shape[1] for im in images], dtype=np.int64)
            torch.save({"pixels": torch.from_numpy(np.concatenate(images, axis=1)),  # N x [H,W_i] -> [H,ΣW]
                        "widths": torch.from_numpy(widths), "fonts": torch.from_numpy(font_ids),
                        "words": labels}, out / f"{name}.pt")
            counts[name] = count
        return {"counts": counts, "words": {k: len(v) for k, v in split.items()}, "fonts": names,
                "height": params["height"], "max_width": params["max_width"],
                "model_defaults": {"height": params["height"], "vocab": len(VOCAB), "pad_id": PAD,
                                   "bos_id": BOS, "eos_id": EOS, "max_len": params["max_len"] + 1}}

    def load(self, data_dir: Path, split: str) -> list:
        path = data_dir / f"{split}.pt"
        if not path.exists():
            raise TaskError(f"{path} is missing: run `dvc repro prepare@ocr_words`")
        d = torch.load(path)
        import json

        fonts = json.loads((data_dir / "manifest.json").read_text())["fonts"]
        pixels = d["pixels"].numpy()
        ends = np.cumsum(d["widths"].numpy())
        items = []
        for i, word in enumerate(d["words"]):
            start = ends[i - 1] if i else 0
            items.append({"image": pixels[:, start : ends[i]], "text": word,
                          "tgt": [VOCAB.index(c) for c in word], "font": Path(fonts[int(d["fonts"][i])]).stem})
        return items

    def length(self, item: dict) -> int:
        return item["image"].shape[1]

    def collate(self, items: list[dict]) -> dict:
        """image [B,H,W] float in [0,1], right-padded with zeros; width [B]; tgt_in = BOS + letters,
        tgt_out = letters + EOS (padded)."""
        bsz, height = len(items), items[0]["image"].shape[0]
        widths = [it["image"].shape[1] for it in items]
        image = torch.zeros(bsz, height, max(widths))
        steps = max(len(it["tgt"]) for it in items) + 1
        tgt_in = torch.full((bsz, steps), PAD, dtype=torch.long)
        tgt_out = torch.full((bsz, steps), PAD, dtype=torch.long)
        for b, it in enumerate(items):
            image[b, :, : widths[b]] = torch.from_numpy(it["image"]).float() / 255.0
            y = torch.tensor(it["tgt"], dtype=torch.long)
            tgt_in[b, 0] = BOS
            tgt_in[b, 1 : len(y) + 1] = y
            tgt_out[b, : len(y)] = y
            tgt_out[b, len(y)] = EOS
        return {"image": image, "width": torch.tensor(widths, dtype=torch.long), "tgt_in": tgt_in, "tgt_out": tgt_out}

    def example_batch(self, cfg: dict, seed: int = 0, batch: int = 3) -> dict:
        """Real words rendered in DejaVu Sans at the model's ``height``, three widths."""
        rng = np.random.default_rng(seed)
        font = load_fonts(["dejavu/DejaVuSans.ttf"], range(12, 13))["dejavu/DejaVuSans.ttf"][12]
        style = {"slant": 0.1, "blur": 0.0, "noise": 2, "margin": 2, "background": [200, 255], "inverted": 0.0}
        return self.collate([{"image": render(w, font, rng, cfg["height"], 64, style),
                              "tgt": [VOCAB.index(c) for c in w]} for w in ("attention", "zoo", "model")[:batch]])

    def evaluate(self, model, run, plots: Path) -> tuple[dict, dict]:
        """Sequence accuracy and CER on unseen words (greedy and beam), CER per font, and the
        per-letter attention over the image for a few test words."""
        from pipeline import plots as P
        from pipeline.tasks.common.recognition import score_set
        from serving.decode import BEAM

        items = self.load(run.data_dir, "test")
        limit = run.evaluate.get("max_images")
        items = items[:limit] if limit else items
        beam = run.evaluate.get("beam", BEAM)
        metrics, greedy, maps = score_set(model, run, self, items, VOCAB, "font", beam, "test")
        rows = model.annotation_rows  # attention is over rows × feature columns, row-major
        for n in range(min(6, len(items))):
            letters = (list(greedy[n]) + ["</s>"])[: maps[n].shape[0]]  # no EOS step when max_len ran out
            amap = maps[n].reshape(len(letters), rows, -1)  # [T,L] -> [T,h,w']
            P.caption_attention(items[n]["image"], letters, amap, plots / f"attention_{n}.png",
                                f"{run.name}: '{greedy[n]}' (true '{items[n]['text']}', {items[n]['font']})")
        by_font = metrics["cer_by_font"]
        row = {"headline": {"seq_acc_beam": metrics["seq_acc_beam"], "seq_acc_greedy": metrics["seq_acc_greedy"],
                            "cer_beam": metrics["cer_beam"]},
               "by_length": {"metric": "CER % (beam)", "xlabel": "font",
                             "labels": list(by_font), "values": list(by_font.values())}}
        return metrics, row

    def parity_batches(self, data_dir: Path) -> list[tuple[str, dict]]:
        """Real test images at batch sizes 1, 4 and 16 (widths mixed: padding and masks exercised)."""
        items = self.load(data_dir, "test")
        return [(f"test words × batch {n}", self.collate(items[at : at + n])) for n, at in ((1, 0), (4, 1), (16, 5))]


register_task(OcrWordsTask())
