"""The plots people read: what each figure shows (axes, colour scale, reference, time axis), read back
from the figure that would be saved."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure

from pipeline import plots as P


@pytest.fixture
def saved(monkeypatch):
    """The figures the plot functions save, kept open for inspection instead of written."""
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    return figures


def test_alignment_has_axis_labels_tokens_a_colour_scale_and_the_reference(saved, tmp_path):
    weights = np.array([[0.9, 0.1, 0.0], [0.2, 0.7, 0.1]])
    P.alignment(weights, ["Guten", "Morgen", "</s>"], ["Good", "morning"], tmp_path / "a.png", "bahdanau: Good morning",
                "German source piece", "English output piece (beam)", reference="Good morning")
    (fig,) = saved
    ax, bar = fig.axes
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("German source piece", "English output piece (beam)")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["Guten", "Morgen", "</s>"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["Good", "morning"]
    assert bar.get_ylabel() == "attention weight" and bar.get_ylim() == (0.0, 1.0)
    assert ax.get_title() == "bahdanau: Good morning\nreference: Good morning"
    np.testing.assert_array_equal(ax.images[0].get_array(), weights)


def test_speech_alignment_spans_the_utterance_not_the_padded_batch(saved, tmp_path):
    frames, stack = 30, 3  # this utterance: 10 encoder steps; its batch was padded to 16
    alignment = np.zeros((4, 16))
    alignment[np.arange(4), [1, 4, 7, 9]] = 1.0
    P.speech_alignment(np.zeros((frames, 40)), alignment, list("12") + ["3", "</s>"], stack, tmp_path / "s.png", "x")
    (fig,) = saved
    top, bottom = fig.axes[:2]
    assert bottom.images[0].get_array().shape == (4, 10)
    assert bottom.images[0].get_extent()[:2] == [0, frames] and top.images[0].get_extent()[:2] == [0, frames]
