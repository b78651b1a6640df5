"""``mnist_translated60``: one real MNIST digit at a random position of a 60 × 60 canvas (Mnih et
al. 2014, §4.1). The code (``common/placed_digits.py``) is shared with ``mnist_cluttered60``; the
``clutter`` parameter makes the difference."""

from pipeline.tasks import register_task
from pipeline.tasks.common.placed_digits import PlacedDigitsTask

register_task(PlacedDigitsTask("mnist_translated60"))
