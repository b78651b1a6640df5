"""Run by tests/test_warm_start.py in a forked stage: reports what a stage sees of its process, then exits."""

import atexit
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

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
elif mode == "interrupt":
    raise KeyboardInterrupt
elif mode == "exit-work":  # what an exit must still do: join a thread, run atexit handlers, flush output
    threading.Thread(target=lambda: (time.sleep(0.3), print("the thread's last line"))).start()
    # A pool held to the end, as a library's module-level one is: its idle worker waits for work until
    # the exit wakes it.
    sys.probe_pool = ThreadPoolExecutor(1)
    sys.probe_pool.submit(int)
    atexit.register(print, "an atexit handler ran")
    print("buffered, not flushed", end=" ")
    sys.exit("the probe's exit message")
sys.exit(int(mode))
