"""How a training step's memory is laid out and kept: ``train.memory_format`` and ``train.cpu_heap``.

``memory_format: channels_last`` stores the convolution weights, and so every image tensor the convolutions
produce, channel-minor ([B,H,W,C] in memory, the same [B,C,H,W] shape): oneDNN's convolutions and PyTorch's
pooling and batch norm have vectorised kernels for that layout, and the channel-major max pooling is slow on a
CPU (a [64,16,84,84] bf16 2 x 2 max pool: 40 ms against 4.4 ms on a Zen 4 core).

``cpu_heap: keep``: glibc serves a block over its mmap threshold (128 kB, raised as such blocks are freed, to
at most 32 MB) from a fresh mapping and unmaps it when freed. A step that allocates the same large tensors every
step then has the kernel zero and map every 4 kB page of them anew, every step (a 34 MB tensor: 15 ms on a Zen 4
core). With the threshold above any tensor and trimming off, freed blocks stay in the process's heap and later
steps reuse them. The process keeps its peak memory until it ends.
"""

from __future__ import annotations

import ctypes
import sys

import torch
from torch import nn

from pipeline.config import switched_on

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_KEEP = 2**31 - 1  # bytes, mallopt's largest (an int): only a block over 2 GB is still unmapped


def keep_freed_memory(setting: str, device_type: str) -> bool:
    """Apply ``train.cpu_heap`` to this process; True where glibc took it (a CPU run on glibc Linux)."""
    keep = switched_on("cpu_heap", setting, "the allocator's defaults", "keep")
    if not keep or device_type != "cpu" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # a C library without mallopt: its defaults stay
        return False
    # a glibc that refuses so high a threshold takes 32 MB, its dynamic threshold's ceiling
    took = mallopt(_M_MMAP_THRESHOLD, _KEEP) or mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    return bool(took) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP))


def lay_out(model: nn.Module, setting: str) -> None:
    """Apply ``train.memory_format`` to ``model``'s 4-D parameters, in place (the same Parameter objects)."""
    if switched_on("memory_format", setting, "PyTorch's default", "channels_last"):
        model.to(memory_format=torch.channels_last)
