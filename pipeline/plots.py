"""Plots written by evaluate/report stages (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def alignment(matrix: np.ndarray, src: list[str], tgt: list[str], path: Path, title: str,
              xlabel: str = "source token", ylabel: str = "output token", reference: str | None = None) -> None:
    """Attention heatmap: rows = emitted target tokens, columns = source tokens (Bahdanau Fig. 3),
    with its colour scale and, for a translation, the reference below the title."""
    fig, ax = plt.subplots(figsize=(max(4.5, 0.45 * len(src) + 2.8), max(3, 0.4 * len(tgt) + 1.8)))
    image = ax.imshow(matrix, cmap="gray", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(src)), src, rotation=70, fontsize=8)
    ax.set_yticks(range(len(tgt)), tgt, fontsize=8)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03).set_label("attention weight", fontsize=8)
    ax.set_title(title + (f"\nreference: {reference}" if reference else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def head_grid(heads: np.ndarray, src: list[str], tgt: list[str], path: Path, title: str) -> None:
    """Encoder-decoder attention of every layer (rows) and head (columns), plus their mean (last
    column): heads [T,L,H,S], rows of each panel = target tokens, columns = source tokens."""
    steps, layers, n_heads, _ = heads.shape
    cols = n_heads + 1
    fig, axes = plt.subplots(layers, cols, squeeze=False,
                             figsize=(cols * max(2.2, 0.22 * len(src) + 1), layers * max(2.0, 0.2 * steps + 1)))
    for layer in range(layers):
        panels = [heads[:, layer, h] for h in range(n_heads)] + [heads[:, layer].mean(1)]  # [T,S] each
        for h, (ax, img) in enumerate(zip(axes[layer], panels)):
            ax.imshow(img, cmap="gray", vmin=0, vmax=1, aspect="auto")
            ax.set_title(f"layer {layer + 1} " + (f"head {h + 1}" if h < n_heads else "mean"), fontsize=8)
            ax.set_xticks(range(len(src)), src if layer == layers - 1 else [], rotation=70, fontsize=6)
            ax.set_yticks(range(len(tgt)), tgt if h == 0 else [], fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def by_length(series: dict[str, list[float]], labels: list[str], path: Path, xlabel: str,
              ylabel: str, title: str) -> None:
    """One line per model over length buckets (Bahdanau Fig. 2 / NTM error vs length)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in series.items():
        ax.plot(labels, values, marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory_trace(inputs: np.ndarray, target: np.ndarray, output: np.ndarray, write_w: np.ndarray,
                 read_w: np.ndarray, path: Path, title: str) -> None:
    """NTM copy trace (Graves 2014 Fig. 6): inputs/outputs over time and head weightings."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), gridspec_kw={"height_ratios": [1, 2]})
    panels = [(inputs.T, "inputs"), (np.vstack([target.T, output.T]), "target (top) / output (bottom)"),
              (write_w.T, "write weighting (slot × time)"), (read_w.T, "read weighting (slot × time)")]
    for ax, (img, name) in zip(axes.flat, panels):
        ax.imshow(img, cmap="gray_r" if "weighting" in name else "gray", aspect="auto", interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("time")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def hull(points: np.ndarray, target: list[int], pred: list[int], path: Path, title: str) -> None:
    """Convex hull example: the points, the true hull and the predicted pointer sequence."""
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.scatter(points[:, 0], points[:, 1], c="k", s=14)
    for i, (x, y) in enumerate(points):
        ax.annotate(str(i + 1), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for seq, style, label in ((target, "-", "true hull"), (pred, "--", "predicted")):
        if seq:
            ring = points[seq + seq[:1]]
            ax.plot(ring[:, 0], ring[:, 1], style, lw=1.5, label=label)
    ax.set_aspect("equal")
    ax.legend(fontsize=8)
    ax.set_title(title + (" (exact)" if pred == target else " (wrong)"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def caption_attention(image: np.ndarray, words: list[str], maps: np.ndarray, path: Path, title: str) -> None:
    """Show-Attend-Tell Fig. 2/3: the image, then one panel per emitted word (or letter) with its
    attention map (maps [T,h,w] over the feature grid) stretched over the image. Wide images (text
    lines) stack the panels vertically."""
    height, width = image.shape
    wide = width >= 2 * height
    panels = len(words) + 1
    if wide:
        shape, size = (panels, 1), (1.2 + 2.2 * width / height, 0.75 * panels)
    else:
        shape, size = (1, panels), (1.8 * panels, 2.2)
    fig, axes = plt.subplots(*shape, figsize=size, squeeze=False)
    axes = axes.reshape(-1)  # [rows,cols] -> [panels]
    axes[0].imshow(image, cmap="gray")
    axes[0].set_title("input", fontsize=8)
    for ax, word, amap in zip(axes[1:], words, maps):
        ax.imshow(image, cmap="gray")
        # extent maps the h×w grid onto the pixels, each cell covering its receptive-field centre area
        ax.imshow(amap, cmap="magma", alpha=0.6, extent=(0, width, height, 0), interpolation="bilinear",
                  vmin=0, vmax=max(float(amap.max()), 1e-6), aspect="auto" if wide else None)
        if wide:
            ax.set_ylabel(word, fontsize=9, rotation=0, labelpad=12, va="center")
            ax.set_xticks([])
            ax.set_yticks([])
        else:
            ax.set_title(word, fontsize=9)
    for ax in axes if not wide else axes[:1]:
        ax.set_axis_off()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def glimpse_paths(images: np.ndarray, centres: np.ndarray, widths: list[int], titles: list[str], path: Path,
                  title: str) -> None:
    """Recurrent-attention glimpses (Mnih 2014 Fig. 3): per image [H,W] the path of glimpse
    centres [G,(x,y)] in pixels, numbered, and the retina's boxes (``widths`` pixels) at the last."""
    from matplotlib.patches import Rectangle

    cols = min(4, len(images))
    rows = -(-len(images) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 3.0 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, path_xy, name in zip(axes.flat, images, centres, titles):
        ax.imshow(image, cmap="gray", vmin=0, vmax=255, extent=(0, image.shape[1], image.shape[0], 0))
        ax.plot(path_xy[:, 0], path_xy[:, 1], "-", color="tab:orange", lw=1)
        for t, (x, y) in enumerate(path_xy):
            ax.text(x, y, str(t + 1), color="yellow", fontsize=7, ha="center", va="center")
        x, y = path_xy[-1]
        for w, colour in zip(widths, ("tab:red", "tab:green", "tab:blue", "tab:purple")):
            ax.add_patch(Rectangle((x - w / 2, y - w / 2), w, w, fill=False, ec=colour, lw=1))
        ax.set_xlim(0, image.shape[1])
        ax.set_ylim(image.shape[0], 0)
        ax.set_title(name, fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_sequence(canvases: np.ndarray, read: np.ndarray | None, write: np.ndarray | None, path: Path,
                  title: str, columns: int = 8) -> None:
    """DRAW's canvas over time (Gregor 2015 Fig. 4/7): rows = images, columns = steps (evenly
    spaced, the last included). canvases [B,T,H,W] in [0,1]; read / write windows [B,T,3] as
    (gX, gY, N·δ) in 1-based pixels, drawn as boxes (red: read, green: write)."""
    from matplotlib.patches import Rectangle

    rows, steps = canvases.shape[:2]
    picks = sorted({int(round(x)) for x in np.linspace(0, steps - 1, min(columns, steps))})
    fig, axes = plt.subplots(rows, len(picks), figsize=(1.3 * len(picks), 1.4 * rows), squeeze=False)
    for r in range(rows):
        for ax, t in zip(axes[r], picks):
            ax.imshow(canvases[r, t], cmap="gray", vmin=0, vmax=1, extent=(0, canvases.shape[3], canvases.shape[2], 0))
            for window, colour in ((read, "tab:red"), (write, "tab:green")):
                if window is not None:
                    gx, gy, width = window[r, t]
                    # pixel a (1-based) spans [a-1, a) in the image extent: its centre is a - 0.5
                    ax.add_patch(Rectangle((gx - 0.5 - width / 2, gy - 0.5 - width / 2), width, width,
                                           fill=False, ec=colour, lw=1))
            ax.set_xlim(0, canvases.shape[3])
            ax.set_ylim(canvases.shape[2], 0)
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"t={t + 1}", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def speech_alignment(features: np.ndarray, alignment: np.ndarray, letters: list[str], stack: int, path: Path,
                     title: str) -> None:
    """Chorowski 2015 Fig. 2: the log-mel spectrogram (features [T,M]) above the alignment
    (alignment [letters, S] over the encoder steps of ``stack`` frames), on one time axis."""
    frames = features.shape[0]
    # The alignment comes from a padded batch: only this utterance's encoder steps belong on its time axis.
    alignment = alignment[:, : -(-frames // stack)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(5, frames / 45), 1.6 + 0.25 * len(letters)), sharex=True,
                                      gridspec_kw={"height_ratios": [1, max(1, len(letters) / 8)]})
    top.imshow(np.asarray(features, dtype=np.float32).T, origin="lower", aspect="auto", cmap="viridis",
               extent=(0, frames, 0, features.shape[1]))
    top.set_ylabel("mel bin", fontsize=8)
    bottom.imshow(alignment, aspect="auto", cmap="gray_r", vmin=0, vmax=1, interpolation="nearest",
                  extent=(0, alignment.shape[1] * stack, len(letters), 0))
    bottom.set_yticks(np.arange(len(letters)) + 0.5, letters, fontsize=8)
    bottom.set_xlabel("frame (10 ms)", fontsize=8)
    top.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
