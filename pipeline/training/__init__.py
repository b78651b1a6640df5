"""The one training loop every model shares (stage ``train@<model>``, and every Ray Tune trial):
``loop`` runs it, ``batches`` cuts the global batches, ``precision`` picks fp32 or bf16 for this
machine, ``resume`` makes a killed run resumable, ``validation`` scores and averages checkpoints.

The loop only sees ``Accelerator``: one process by default, many under ``accelerate launch`` or
``torchrun`` (docs/cluster.md). Each model supplies ``loss(batch)``; the loop
handles batching, schedule, clipping, validation, MLflow logging (main process only) and
checkpoints: ``<out>/checkpoint/last`` (weights, optimizer, schedule, every rank's RNG and the
data position, for resuming after a kill) and ``<out>/checkpoint/best`` (weights + resolved
config, lowest validation loss).

Scale-independent semantics: ``batch_size`` is the *global* batch. Every process builds the same
global batches and takes its contiguous slice of each, so an optimizer step sees the same items,
the step count and the learning-rate schedule are the same on 1 or N processes, and (without
dropout, equal-sized slices) the averaged gradient equals the full-batch gradient.
"""
