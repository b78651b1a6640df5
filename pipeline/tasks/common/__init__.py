"""What several tasks build on: the pointer tasks' storage and scoring (``sort``, ``convex_hull``),
the NTM memory-trace evaluation (``repeat_copy``, ``associative_recall``), the MNIST digits
(``mnist_*``), placed-digit canvases (``mnist_translated60``, ``mnist_cluttered60``) and the
recognition metrics (``ocr_words``, ``spoken_digits``). Registers no task: a task's stages depend
on its own module and on this folder (``data/task_code/<task>.json`` lists the files exactly)."""
