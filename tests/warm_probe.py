"""Run by tests/test_warm_start.py in a forked stage: reports what a stage sees of its process, then exits."""

import json
import os
import sys
import time

import torch

mode = sys.argv[1]
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "stage": os.environ.get("DVC_STAGE"),
                  "threads": torch.get_num_threads(), "session_leader": os.getsid(0) == os.getpid(),
                  "main": __name__, "stdin": sys.stdin.read(), "pid": os.getpid(),
                  "sum": float(torch.arange(1000, dtype=torch.float32).sin().sum())}), flush=True)
if mode == "sleep":
    time.sleep(60)
elif mode == "raise":
    raise ValueError("the probe's own error")
sys.exit(int(mode))
