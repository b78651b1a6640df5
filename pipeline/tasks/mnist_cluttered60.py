"""``mnist_cluttered60``: ``mnist_translated60`` plus 8 × 8 pieces of other digits scattered over
the canvas (Mnih et al. 2014, §4.1: "Cluttered Translated MNIST"). The code is shared; the
``clutter`` parameter makes the difference."""

from pipeline.tasks import register_task
from pipeline.tasks.common.placed_digits import PlacedDigitsTask

register_task(PlacedDigitsTask("mnist_cluttered60"))
