"""Where each entry's training step goes, and how much faster the speed settings make it.

For every params.yaml entry, at its committed sizes and training recipe (``runs/<name>/tuned.yaml``
included), the real training step of ``pipeline.training.loop`` (forward, backward, gradient clipping,
AdamW, the schedule) is timed on the entry's own batches, in a fresh process per measurement:

- ``gflop_per_step``: forward + backward FLOPs of one step (``torch.utils.flop_counter``; the optimizer's
  elementwise work is not counted), the median over the measured batches;
- ``steps_per_s`` on 1 and on 2 threads, and the achieved GFLOP/s as a share of this machine's measured
  matrix-multiply peak (``scripts/bench_peak.py``) in the precision the entry trains in;
- ``outside_ops``: the share of a step's wall time spent outside PyTorch operators (Python, the autograd
  engine's bookkeeping, the optimizer's loop), from ``torch.profiler`` over a few steps: 1 minus the summed
  self time of every ``aten::`` operator, divided by the profiled wall time;
- the same step with the entry's recipe in this tree's params.yaml where it differs from the baseline's
  params.yaml (bf16 autocast, ``torch.compile``, fused AdamW ...; ``fast_settings``): ``steps``,
  ``steps_per_s`` and ``compile_s`` (the warm-up's time beyond its steps' steady cost), measured alternately
  with the baseline (``--repeats``, medians). The baseline is a checkout of the recipe before them
  (``--baseline-code``: its code and its params.yaml).

The data is the entry's task prepared small (2,000 training items, seeded as in params.yaml) under
``--work``; the translation corpus, built from Debian packages by ``prepare@translation_de_en``, is stood in for
by seeded token ids whose length distribution gives the committed corpus's token batches per pass (2,197 of
2,048 tokens for 205,412 pairs). Writes ``docs/train_efficiency.json``; ``scripts/results_table.py``-style
rendering into docs/benchmarks.md is ``--render-docs``.

    python scripts/bench_peak.py --out docs/peak.json
    python scripts/train_efficiency.py --out docs/train_efficiency.json          # every entry, ~40 min on 2 cores
    python scripts/train_efficiency.py --entries transformer ntm --repeats 1    # a few
    # a shorter budget (a max_steps below the baseline's): its own run, trained and evaluated in a scratch
    # checkout SCRATCH (`python -m pipeline.stages.train NAME`, then `... evaluate NAME`), recorded
    python scripts/train_efficiency.py --budget-run SCRATCH --entries ntm_recall
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cli_errors
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Small splits: step time depends on the items' sizes, not on how many there are.
SMALL = {"train_size": 2000, "val_size": 64, "test_size": 8, "test_long_size": 8, "val_words": 200, "test_words": 200}
CORPUS_PAIRS, CORPUS_TOKEN_BATCHES = 205_412, 2_197  # the committed corpus: pairs, 2,048-token batches a pass
FLAT = 0.01  # a validation curve that fell less than this over its last quarter is flat
SECONDS = 6.0  # timed seconds a measurement aims at (the step count is fixed per entry from the committed runs)


# ---- the data ---------------------------------------------------------------------------------------
def synthetic_translation(out: Path, vocab: int, n: int = 6000, seed: int = 0) -> None:
    """Token ids standing in for the corpus: target lengths log-normal around a median of 16 pieces
    (3-80), sources 1.1x as long, so 2,048-token batches cut it like the corpus (items per batch)."""
    import numpy as np
    import torch

    from pipeline.tasks.translation_de_en import EOS, _pack

    g = np.random.default_rng(seed)
    tgt_len = np.clip(np.round(np.exp(g.normal(np.log(16), 0.55, n))), 3, 80).astype(int)
    src_len = np.clip(np.round(tgt_len * np.exp(g.normal(np.log(1.1), 0.2, n))), 3, 90).astype(int)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", range(n)), ("val", range(min(256, n)))):
        src = [list(g.integers(4, vocab, src_len[i] - 1)) + [EOS] for i in rows]
        tgt = [list(g.integers(4, vocab, tgt_len[i])) for i in rows]
        blank = [""] * len(src)
        torch.save({"src": _pack(src), "tgt": _pack(tgt), "src_text": blank, "tgt_text": blank, "source": blank,
                    "doc": blank, "licence": blank}, out / f"{split}.pt")
    manifest = {"task": "translation_de_en", "synthetic": True, "files": {},
                "model_defaults": {"src_vocab": vocab, "tgt_vocab": vocab, "pad_id": 0, "bos_id": 1, "eos_id": 2,
                                   "max_len": 100}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))


def make_work(work: Path, entries: list[str]) -> Path:
    """A repository root under ``work``: params.yaml (the entries as committed), their tuned values, each
    task's data prepared small (once)."""
    from pipeline.config import load_params
    from pipeline.stages.prepare import prepare

    params = load_params(ROOT)
    for task in sorted({params["models"][e]["task"] for e in entries}):
        data = work / "data" / "prepared" / task
        if (data / "manifest.json").exists():
            continue
        print(f"preparing {task} (small) under {data}", file=sys.stderr, flush=True)
        if task == "translation_de_en":
            synthetic_translation(data, params["tasks"][task]["vocab_size"])
            continue
        spec = params["tasks"][task]
        prepare(task, {**spec, **{k: v for k, v in SMALL.items() if k in spec}}, data)
    for name in entries:
        tuned = ROOT / "runs" / name / "tuned.yaml"
        if tuned.exists():
            (work / "runs" / name).mkdir(parents=True, exist_ok=True)
            shutil.copy(tuned, work / "runs" / name / "tuned.yaml")
    # Both variants read the baseline's params.yaml; the fast one overrides it with fast_settings.
    (work / "params.yaml").write_text(yaml.safe_dump(baseline_params(), sort_keys=False))
    return work


def _params(variable: str, default: Path) -> dict:
    return yaml.safe_load(Path(os.environ.get(variable) or default).read_text())


def baseline_params() -> dict:
    """The params.yaml the baseline trains with: $BASELINE_PARAMS, else the baseline checkout's
    ($BASELINE_CODE), else this tree's (then there is nothing to compare)."""
    return _params("BASELINE_PARAMS", Path(os.environ.get("BASELINE_CODE") or ROOT) / "params.yaml")


def fast_settings(name: str) -> dict:
    """What this tree's params.yaml ($FAST_PARAMS in place of it) trains ``name`` with beyond the baseline's:
    each train key whose value differs, and each model key as ``model.<key>``, a side that leaves a key out
    taking the loop's or the model's default."""
    import dataclasses

    import models
    from pipeline.config import TrainConfig

    fast, base = _params("FAST_PARAMS", ROOT / "params.yaml"), baseline_params()
    if name not in base["models"]:
        raise cli_errors.ScriptError(f"the baseline's params.yaml has no entry {name}")
    arch = fast["models"][name]["arch"]
    loop = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    model = {f.name: f.default for f in dataclasses.fields(models.REGISTRY[arch].config_cls)}

    def recipe(params: dict) -> tuple[dict, dict]:
        entry = params["models"][name]
        return ({**loop, **(params.get("train") or {}), **(entry.get("train") or {})},
                {**model, **(entry.get("model") or {})})

    (train, net), (train0, net0) = recipe(fast), recipe(base)
    return {**{k: v for k, v in train.items() if train0.get(k) != v},
            **{f"model.{k}": v for k, v in net.items() if net0.get(k) != v}}


def step_count(name: str) -> int:
    """Timed steps for ``name``: about SECONDS of its committed step time (5-400), the same for every variant."""
    summary = baseline_run(name) / "train_summary.json"
    s = json.loads(summary.read_text()) if summary.exists() else {"train_seconds": 1.0, "steps": 10}
    return max(5, min(400, round(SECONDS * s["steps"] / max(s["train_seconds"], 1e-3))))


# ---- one measurement, in its own process ------------------------------------------------------------
def _trainer(work: Path, name: str, overrides: dict, out: Path):
    """The real training loop's ``_Trainer`` for ``name`` (what ``train()`` builds), MLflow off."""
    from accelerate.utils import set_seed

    from pipeline.config import resolve
    from pipeline.tasks import get_task
    from pipeline.training.loop import _load_data, _Trainer
    from pipeline.training.precision import make_accelerator

    run = resolve(name, root=work, overrides=overrides)
    accelerator, precision = make_accelerator(run)
    set_seed(run.train.seed)
    trainer = _Trainer(run, accelerator, _load_data(run, get_task(run.task), accelerator), out)
    return trainer, precision


def _batches(trainer, count: int) -> list:
    """The first ``count`` training batches of the run's schedule (epochs after the first as needed)."""
    out, epoch = [], 0
    while len(out) < count:
        out += list(trainer._epoch(epoch, 0))[: count - len(out)]
        epoch += 1
    return out


def _flops(trainer, batches: list) -> float:
    """Median forward + backward GFLOP of a step over ``batches`` (no optimizer step: weights unchanged)."""
    from accelerate.utils import send_to_device
    from torch.utils.flop_counter import FlopCounterMode

    counts = []
    for batch in batches:
        with FlopCounterMode(display=False) as counter:
            with trainer.acc.autocast():
                loss, _ = trainer.wrapped(send_to_device(batch, trainer.acc.device))
            loss.backward()
        trainer.optimizer.zero_grad(set_to_none=True)
        counts.append(counter.get_total_flops() / 1e9)
    return statistics.median(counts)


def _outside_ops(trainer, batches: list) -> float:
    """Share of the profiled steps' wall time outside ``aten::`` operators' self time."""
    from torch.profiler import ProfilerActivity, profile
    from tqdm import tqdm

    bar = tqdm(disable=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for batch in batches:
            trainer._step(batch, None, bar)
        wall = time.perf_counter() - started
    inside = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("aten::")) / 1e6
    return max(0.0, 1 - inside / wall)


def warm_up_steps(timed: int) -> int:
    """Untimed steps before ``timed`` timed ones (oneDNN primitives, the allocator, compilation)."""
    return max(3, min(20, timed // 5))


def measure_child(work: Path, name: str, variant: str, steps: int, extras: bool) -> dict:
    """Time ``steps`` real training steps of ``name`` (``variant``: baseline or fast) after a warm-up."""

    import torch
    from tqdm import tqdm

    overrides = fast_settings(name) if variant == "fast" else {}
    with tempfile.TemporaryDirectory(dir=work) as out:
        trainer, precision = _trainer(work, name, overrides, Path(out))
        warm = warm_up_steps(steps)
        batches = _batches(trainer, warm + steps)
        bar, losses = tqdm(disable=True), []
        started = time.perf_counter()
        for batch in batches[:warm]:  # oneDNN primitives, allocator, compilation
            losses.append(trainer._step(batch, None, bar)[0])
        warm_s = time.perf_counter() - started
        started, cpu = time.perf_counter(), time.process_time()
        for batch in batches[warm:]:
            losses.append(trainer._step(batch, None, bar)[0])  # kept as tensors: no extra sync in the timing
        step_s = (time.perf_counter() - started) / steps
        # CPU seconds a step: on one thread, the wall time a step would take on a core of its own
        cpu_step_s = (time.process_time() - cpu) / steps
        result = {"steps_per_s": 1 / step_s, "cpu_steps_per_s": 1 / cpu_step_s,
                  "compile_s": max(0.0, warm_s - warm * step_s), "precision": precision,
                  "threads": torch.get_num_threads(), "steps_per_epoch": trainer.data.steps_per_epoch,
                  "total_steps": trainer.data.total, "settings": overrides,
                  "losses": [float(v) for v in losses]}
        if extras:  # after the timing: neither the counter nor the profiler slows the timed steps
            result["gflop_per_step"] = _flops(trainer, batches[warm : warm + 5])
            result["outside_ops"] = _outside_ops(trainer, batches[warm : warm + max(3, min(20, steps // 4))])
    return result


def measure(work: Path, name: str, variant: str, threads: int, steps: int, extras: bool) -> dict:
    """One measurement in a fresh process with ``threads`` threads (nothing inherited from another). The
    baseline runs the code of $BASELINE_CODE (another checkout: today's code before a change) when set."""
    code = os.environ.get("BASELINE_CODE", "") if variant == "baseline" else ""
    env = {**os.environ, "PYTHONPATH": code or str(ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}",
           **{v: str(threads) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, variant, str(steps), str(int(extras)),
           "--work", str(work), *(["--code", code] if code else [])]

    with tempfile.TemporaryDirectory(dir=work) as cache:  # compile from cold, as a user's first run does
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{name} ({variant}, {threads} thread(s)) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the table in docs/benchmarks.md ----------------------------------------------------------------
START, END = "<!-- train_efficiency: start -->", "<!-- train_efficiency: end -->"
JSON_OUT = ROOT / "docs" / "train_efficiency.json"


def _settings(settings: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in settings.items()) or "—"


def rendered(path: Path = JSON_OUT) -> str:
    """The "Training efficiency" block of docs/benchmarks.md for the figures in ``path``, measuring nothing."""
    kept = json.loads(path.read_text())
    cpu, peak, proj = kept["cpu"], kept["peak"], kept["projected"]
    lines = [START, "", f"`{kept['command']}` on an {cpu['model_name']} (family {cpu['family']}, model "
             f"{cpu['model']}; {', '.join(cpu['flags'])}), PyTorch {kept['torch']}. "
             "Peak (`python scripts/bench_peak.py`, "
             f"GEMMs of 2048²): fp32 {peak['fp32']['1']['gflops']:,.0f} / {peak['fp32']['2']['gflops']:,.0f} GFLOP/s, "
             f"bf16 {peak['bf16']['1']['gflops']:,.0f} / {peak['bf16']['2']['gflops']:,.0f} on 1 / 2 threads. "
             "GFLOP a step: forward + backward; % of peak in the precision the entry trains in; outside ops: the "
             "share of a step outside PyTorch operators; steps/s on 1 thread (the zoo's placement: two stages "
             "at once, a core each), median of alternate runs; *fast*: the entry's speed settings (what params.yaml "
             "sets beyond the baseline's) on this tree's code, against the baseline on the code and params.yaml of "
             f"commit {kept['baseline_code']} (BASE: its `git worktree`), "
             "compile seconds added once. Projected time: steps ÷ steps/s (+ compile). Loss Δ: the largest "
             "relative difference between the two variants' training losses on the same batches from the same "
             "initial weights, step by step over the steps compared (the speed runs', or `--learn-steps N`). "
             "Val ¼: how much the baseline's run's validation loss still fell over its last quarter of steps "
             "(BASE's `runs/<entry>/learning_curves/val_loss.csv`: the best before 75 % of the steps against the "
             "best). "
             "GEMM time (`python scripts/gemm_ceiling.py`, 5 fast steps on 1 thread, profiled): the share of a step "
             "in its matrix products; bound: the % of peak the step would reach with its products at the peak and "
             "everything else as it is.", "",
             "| entry | GFLOP/step | steps/s 1 thr | % peak | outside ops | steps/s 2 thr | % peak | fast settings "
             "| fast steps/s | compile s | projected × | loss Δ (steps) | val ¼ | GEMM time | bound % |",
             "|---|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|"]
    for name, e in kept["entries"].items():
        lines.append(f"| {name} | {e['gflop_per_step']:.2f} | {e['baseline_steps_per_s']:.2f} | {e['pct_of_peak']:.1f} "
                     f"| {e['outside_ops']:.0%} | {e['baseline_steps_per_s_2_threads']:.2f} "
                     f"| {e['pct_of_peak_2_threads']:.1f} | {_settings(e['fast_settings'])} | {e['steps_per_s']:.2f} "
                     f"| {e['compile_s']:.0f} | {e['ratio']:.2f} | {_same(e)} | {last_quarter_fall(e):.1%} "
                     f"| {_ceiling(e)} |")
    again = f" (`--entries {' '.join(kept['measured_again'])}` measured again)" if kept.get("measured_again") else ""
    lines += ["", f"Projected training time of these entries{again}: {proj['baseline_s']:,} s with the baseline's "
              f"recipe, {proj['fast_s']:,} s with the speed settings: **{proj['ratio']:.2f}×**."
              f"{_budgets(kept)}{_ceilings(kept)}",
              "", END]
    return "\n".join(lines)


def last_quarter_fall(entry: dict) -> float:
    """How much the baseline's committed run's validation loss fell over its last quarter of steps: 1 - best /
    (the best up to 75 % of the steps); 0 where the curve was flat."""
    curve = entry["baseline_val_curve"]
    early = min(loss for step, loss in curve if step <= 0.75 * curve[-1][0])
    return 1 - min(loss for _, loss in curve) / early if early > 0 else 0.0


def _budgets(kept: dict) -> str:
    """One sentence on the budgets: the entries the speed settings stop sooner (a shorter budget or patience), and
    of the rest, those whose validation still fell late (they keep their steps) and those flat."""
    entries = kept["entries"]
    shorter = {n: e for n, e in entries.items() if e["steps"] < e["baseline_steps"]}
    falls = {n: last_quarter_fall(e) for n, e in entries.items() if n not in shorter}
    flat = [f"{n} ({v:.1%})" for n, v in falls.items() if v < FLAT]
    climbing = [v for v in falls.values() if v >= FLAT]
    cut = "; ".join(f"{n} ({e['baseline_steps']:,} → {e['steps']:,}{_budget_evidence(e)})" for n, e in shorter.items())
    many = f"{len(shorter)} entries train" if len(shorter) != 1 else "1 entry trains"
    return (f" Budgets: {many} fewer steps with the speed settings: {cut or 'none'}. Of the "
            f"rest, {len(climbing)} entries' validation loss still fell by {min(climbing):.1%}–{max(climbing):.0%}"
            f" over their last quarter of steps, so they keep their steps (a longer budget could buy quality); flat "
            f"(under {FLAT:.0%}): {', '.join(flat) or 'none'}.")


def _budget_evidence(entry: dict) -> str:
    """What a shorter budget's own run measured (``--budget-run``), against the committed run at equal wall time."""
    check = entry.get("budget_check")
    if not check:  # patience: where it stops the committed run's own curve
        patience = entry["fast_settings"].get("patience")
        return f": patience {patience} on the baseline's validation curve" if patience else ""
    then = check["committed_at_equal_time"]
    bars = ", ".join(f"{c['metric']} {c['measured']:g} (bar {c['op']} {c['value']:g})" for c in check["bar"])
    return (f": best validation loss {check['best_val_loss']:.3g}, the baseline's run's {then['best_val_loss']:.3g} in "
            f"the same wall time (by step {then['step']:,}); {bars}")


def _ceilings(kept: dict) -> str:
    """One sentence on the entries with GEMM figures: what holds them below the peak, in ranges."""
    found = {n: e["ceiling"] for n, e in kept["entries"].items() if e.get("ceiling")}
    if not found:
        return ""

    def span(values, fmt="{:.0f}") -> str:
        low, high = min(values), max(values)
        return fmt.format(low) if fmt.format(low) == fmt.format(high) else f"{fmt.format(low)}–{fmt.format(high)}"

    worst: dict[str, float] = {}
    for c in found.values():
        for o in c["outside"]:
            worst[o["op"]] = max(worst.get(o["op"], 0.0), o["share"])
    ops = ", ".join(f"`{op}` up to {share:.0%}" for op, share in sorted(worst.items(), key=lambda kv: -kv[1])[:3])
    pct = {n: kept["entries"][n]["fast_pct_of_peak"] for n in found}
    now, bound = [c["peak_gflops_now"] for c in found.values()], span([c["bound_pct"] for c in found.values()])
    share = span([100 * c["gemm_time_share"] for c in found.values()])
    alone = span([c["ceiling_pct"] for c in found.values()])
    # Below 50 %: with a bound over 50 % the products are what is slow (slower in the step than alone);
    # with a bound under it, only cutting the other work can get there.
    slow = [n for n, p in pct.items() if p < 50 and found[n]["bound_pct"] >= 50]
    cut = [n for n, p in pct.items() if p < 50 and found[n]["bound_pct"] < 50]
    parts = [f"{len(found) - len(slow) - len(cut)} of them at 50 % or more" if slow or cut else
             "all of them at 50 % or more"]
    if slow:
        parts.append(f"{', '.join(slow)} below it with a bound of {span([found[n]['bound_pct'] for n in slow])} %: "
                     "their products run slower within the step than alone at the same shapes")
    if cut:
        parts.append(f"for {', '.join(cut)} 50 % needs that work cut, not faster products")
    half = "; ".join(parts)
    return (f" The {len(found)} entries with GEMM figures ({', '.join(found)}) train at {span(pct.values())} % of peak "
            f"with their fast settings (counting the FLOPs their fast steps do). Their products take {share} % of "
            f"a step and run at {alone} % of the peak alone at their shapes; with them at the peak and everything "
            f"else as profiled, the bound is {bound} %. The rest is operators that do no counted FLOPs ({ops} of a "
            f"step): {half}. (The 2048² bf16 product on one thread, "
            f"timed again beside each entry's GEMM figures, ran at {span(now, '{:,.0f}')} GFLOP/s on this machine: "
            "the peak itself moves by that much.)")


def _ceiling(entry: dict) -> str:
    """scripts/gemm_ceiling.py's columns: the products' share of the step, the bound."""
    c = entry.get("ceiling")
    return f"{c['gemm_time_share']:.0%} | {c['bound_pct']:.0f}" if c else "— | —"


def _same(entry: dict) -> str:
    """The fast settings' largest relative loss difference from the baseline and over how many steps."""
    same = entry["learns_the_same"]
    return f"{same['max_rel_diff']:.4f} ({same['steps']})" if entry["fast_settings"] else "—"


def with_table(text: str, table: str) -> str:
    """``text`` (docs/benchmarks.md) with its generated block replaced by ``table``."""
    import re

    return re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: table, text, flags=re.S)


# ---- the zoo ----------------------------------------------------------------------------------------
def baseline_run(name: str) -> Path:
    """The baseline recipe's committed run of ``name``: ``runs/<name>`` of its checkout ($BASELINE_CODE, else
    this tree's). Measuring records what it needs of it in the figures (``baseline_steps``,
    ``baseline_val_curve``), so the figures stay readable after this tree's runs are retrained."""
    return Path(os.environ.get("BASELINE_CODE") or ROOT) / "runs" / name


def committed_steps(name: str) -> int:
    return json.loads((baseline_run(name) / "train_summary.json").read_text())["steps"]


def val_curve(name: str) -> list[list]:
    """The baseline's committed validation curve: [step, val_loss] at each validation."""
    import csv

    with open(baseline_run(name) / "learning_curves" / "val_loss.csv") as f:
        return [[int(r["step"]), float(r["val_loss"])] for r in csv.DictReader(f)]


def fast_steps(settings: dict, baseline_steps: int, curve: list[list]) -> int:
    """The fast recipe's step count: its ``max_steps``, or where ``patience`` stops the baseline's own validation
    ``curve`` (the same curve when nothing else changed), else the baseline's count."""
    if settings.get("max_steps"):
        return int(settings["max_steps"])
    if not settings.get("patience"):
        return baseline_steps
    best, best_at = float("inf"), 0
    for i, (step, loss) in enumerate(curve):
        if loss < best:
            best, best_at = loss, i
        if i - best_at >= settings["patience"]:
            return step
    return baseline_steps


def entry_figures(work: Path, name: str, repeats: int, peak: dict) -> dict:
    """Baseline and fast, alternately ``repeats`` times on 1 thread; the baseline once more on 2 threads."""
    steps = step_count(name)
    runs: dict[str, list[dict]] = {"baseline": [], "fast": []}
    for r in range(repeats):
        for variant in ("baseline", "fast"):
            runs[variant].append(measure(work, name, variant, 1, steps, extras=r == 0))
    two = measure(work, name, "baseline", 2, steps, extras=True)
    base, fast = runs["baseline"][0], runs["fast"][0]
    sps = {v: statistics.median(m["steps_per_s"] for m in ms) for v, ms in runs.items()}
    settings = fast["settings"]
    gflop = base["gflop_per_step"]
    limit = peak["peak"][base["precision"]]
    baseline_steps, curve = committed_steps(name), val_curve(name)
    out = {"baseline_steps": baseline_steps, "baseline_val_curve": curve,
           "baseline_steps_per_s": round(sps["baseline"], 3),
           "baseline_steps_per_s_2_threads": round(two["steps_per_s"], 3),
           "steps": fast_steps(settings, baseline_steps, curve), "steps_per_s": round(sps["fast"], 3),
           "compile_s": round(statistics.median(m["compile_s"] for m in runs["fast"]), 1),
           "gflop_per_step": round(gflop, 3), "precision": base["precision"], "fast_precision": fast["precision"],
           "peak_gflops": limit["1"]["gflops"], "peak_gflops_2_threads": limit["2"]["gflops"],
           "pct_of_peak": round(100 * gflop * sps["baseline"] / limit["1"]["gflops"], 1),
           "pct_of_peak_2_threads": round(100 * gflop * two["steps_per_s"] / limit["2"]["gflops"], 1),
           # the FLOPs the fast step does: fewer where it skips work (deferred: padding's vocabulary rows)
           "fast_gflop_per_step": round(fast["gflop_per_step"], 3),
           "fast_pct_of_peak": round(100 * fast["gflop_per_step"] * sps["fast"]
                                     / peak["peak"][fast["precision"]]["1"]["gflops"], 1),
           "outside_ops": round(base["outside_ops"], 3), "outside_ops_2_threads": round(two["outside_ops"], 3),
           "timed_steps": steps, "repeats": repeats, "fast_settings": settings,
           "steps_per_s_each": {v: [round(m["steps_per_s"], 3) for m in ms] for v, ms in runs.items()},
           "learns_the_same": learns_the_same(base["losses"], fast["losses"])}
    out["ratio"] = ratio(out)
    return out


def ratio(entry: dict) -> float:
    """The entry's projected speed-up: the committed recipe's time over the fast one's (compile included)."""
    return round((entry["baseline_steps"] / entry["baseline_steps_per_s"])
                 / (entry["steps"] / entry["steps_per_s"] + entry["compile_s"]), 2)


def learns_the_same(base: list[float], fast: list[float]) -> dict:
    """The two runs' training losses on the same batches from the same initial weights, step by step: the
    largest relative difference, and the mean loss of each over the last quarter of the steps."""
    n = min(len(base), len(fast))
    tail = slice(n - max(1, n // 4), n)
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(base[:n], fast[:n]))
    return {"steps": n, "max_rel_diff": round(worst, 5),
            "last_quarter_mean": [round(statistics.fmean(base[tail]), 5), round(statistics.fmean(fast[tail]), 5)]}


def budget_check(name: str, entry: dict, run_root: Path) -> dict:
    """A shorter budget's evidence from a fast-profile run of ``name`` trained and evaluated under ``run_root``
    (``runs/<name>``): its steps, best validation loss and bar, and the committed run's best validation loss by the
    step the default recipe reaches in the same wall time on this machine (steps x the fast / baseline step rates)."""
    run = run_root / "runs" / name
    summary = json.loads((run / "train_summary.json").read_text())
    bar = json.loads((run / "metrics.json").read_text())["bar"]
    same_time = summary["steps"] * entry["baseline_steps_per_s"] / entry["steps_per_s"]
    curve = [(step, loss) for step, loss in entry["baseline_val_curve"] if step <= same_time]
    return {"steps": summary["steps"], "best_val_loss": summary["best_val_loss"], "best_step": summary["best_step"],
            "bar": [{k: c[k] for k in ("metric", "op", "value", "measured", "passed")} for c in bar["conditions"]],
            "committed_at_equal_time": {"step": curve[-1][0] if curve else 0,
                                        "best_val_loss": min((v for _, v in curve), default=None)}}


def learning_check(work: Path, name: str, steps: int) -> dict:
    """Baseline and fast for ``steps`` steps each, from the same weights on the same batches (1 thread)."""
    base, fast = (measure(work, name, variant, 1, steps, extras=False) for variant in ("baseline", "fast"))
    return learns_the_same(base["losses"], fast["losses"])


def projected(entries: dict) -> dict:
    """Σ baseline time / Σ fast time (compile included) over the measured entries, in seconds."""
    base = sum(e["baseline_steps"] / e["baseline_steps_per_s"] for e in entries.values())
    fast = sum(e["steps"] / e["steps_per_s"] + e["compile_s"] for e in entries.values())
    return {"baseline_s": round(base), "fast_s": round(fast), "ratio": round(base / fast, 2)}


def _commit(checkout: Path) -> str:
    out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", nargs="+", help="params.yaml entries (default: all)")
    ap.add_argument("--repeats", type=int, default=2, help="alternate baseline/fast runs on 1 thread (medians)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/attnzoo-train-efficiency"))
    ap.add_argument("--peak", type=Path, default=ROOT / "docs" / "peak.json", help="scripts/bench_peak.py's output")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "train_efficiency.json")
    ap.add_argument("--render-docs", action="store_true", help="only rewrite docs/benchmarks.md's block from --out")
    ap.add_argument("--baseline-code", type=Path,
                    help="a checkout whose code runs the baseline (git worktree add DIR COMMIT); default: this one")
    ap.add_argument("--learn-steps", type=int, default=0,
                    help="with --entries: only compare the two variants' losses over this many steps (warm-up "
                         "included) and record that as the entries' learns_the_same, measuring no speed")
    ap.add_argument("--budget-run", type=Path, metavar="ROOT",
                    help="record the named entries' shorter budgets from a checkout whose runs/<entry> were trained "
                         "and evaluated with this tree's params.yaml (its max_steps) into --out")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--code", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        if args.code:  # the baseline's checkout, ahead of this one
            sys.path.insert(0, args.code)
        name, variant, steps, extras = args.child
        print(json.dumps(measure_child(args.work, name, variant, int(steps), extras == "1")))
        return 0
    if args.render_docs:
        doc = ROOT / "docs" / "benchmarks.md"
        doc.write_text(with_table(doc.read_text(), rendered(args.out)))
        return 0
    from pipeline.config import load_params

    _check_arguments(args)
    if args.baseline_code:
        os.environ["BASELINE_CODE"] = str(args.baseline_code.resolve())
    if not args.peak.exists():
        raise cli_errors.ScriptError(f"no peak figures at {args.peak}; run: python scripts/bench_peak.py "
                                     f"--out {args.peak}")
    peak = json.loads(args.peak.read_text())
    names = args.entries or list(load_params(ROOT)["models"])
    if args.budget_run:  # reads two runs' files: no data to prepare
        return _budget_runs_only(args, names, measured(args.out, names))
    kept = measured(args.out, names) if args.learn_steps else None  # before any task is prepared
    args.work.mkdir(parents=True, exist_ok=True)
    make_work(args.work, names)
    if args.learn_steps:
        return _learning_only(args, names, kept)
    old = json.loads(args.out.read_text()).get("entries", {}) if args.out.exists() else {}
    curves = [baseline_run(n) / "learning_curves" / "val_loss.csv" for n in names]
    if untrained := [str(c.parent.parent) for c in curves if not c.exists()]:  # read after the measuring
        raise cli_errors.ScriptError(f"the baseline's runs are not there: {', '.join(untrained)}; train them in "
                                     "that checkout first (`attnzoo repro train@NAME`)")
    entries = {}
    for name in names:
        entries[name] = entry_figures(args.work, name, args.repeats, peak)
        e = entries[name]
        print(f"{name}: {e['gflop_per_step']:.2f} GFLOP/step, {e['baseline_steps_per_s']:.2f} -> "
              f"{e['steps_per_s']:.2f} "
              f"steps/s ({e['pct_of_peak']}% of peak, outside ops {e['outside_ops']:.0%}); ratio {e['ratio']}x",
              flush=True)
    for name, e in entries.items():  # a shorter budget's evidence outlives a speed run
        if "budget_check" in old.get(name, {}) and e["steps"] == old[name]["budget_check"]["steps"]:
            e["budget_check"] = old[name]["budget_check"]
    entries = {**old, **entries} if args.entries else entries
    # The zoo's command; entries measured again later by --entries are listed as such.
    command = "python scripts/train_efficiency.py" + (" --baseline-code BASE" if args.baseline_code else "")
    again = sorted(set(json.loads(args.out.read_text()).get("measured_again", []) if args.out.exists() else [])
                   | set(names if args.entries else []))
    result = {"command": command, "baseline_code": _commit(args.baseline_code or ROOT), "measured_again": again,
              "cpu": peak["cpu"], "torch": peak["torch"], "peak": peak["peak"], "entries": entries,
              "projected": projected(entries)}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"projected zoo training time: {result['projected']}")
    return 0


def _check_arguments(args) -> None:
    """The mistakes found before anything is prepared or measured, each in one sentence."""
    if args.entries:
        cli_errors.entries(args.entries)
    if args.baseline_code and not (args.baseline_code / "params.yaml").exists():
        raise cli_errors.ScriptError(f"--baseline-code {args.baseline_code} is not a checkout (no params.yaml); "
                                     "make one with `git worktree add DIR COMMIT`")
    if args.learn_steps and not args.entries:  # before every task is prepared for nothing
        raise cli_errors.ScriptError("--learn-steps updates the entries it is given: add --entries NAME ...")
    if args.learn_steps and args.learn_steps < 1 + warm_up_steps(1):
        raise cli_errors.ScriptError(f"--learn-steps counts the warm-up too: give at least {1 + warm_up_steps(1)}")


def measured(out: Path, names: list[str]) -> dict:
    """``out``'s figures (``--out``), holding each of ``names``, or one sentence naming what to measure first."""
    kept = json.loads(out.read_text()) if out.exists() else {"entries": {}}
    if missing := [n for n in names if n not in kept["entries"]]:
        raise cli_errors.ScriptError(f"{', '.join(missing)}: not in {out}; measure first with "
                                     f"`python scripts/train_efficiency.py --entries {' '.join(missing)}`")
    return kept


def _learning_only(args, names: list[str], kept: dict) -> int:
    """``--learn-steps``: each named entry's learns_the_same over that many steps, written into ``--out``
    (``kept``, read from it)."""
    for name in names:
        # the timed steps' warm-up comes first: the count is warm-up + timed, as in the speed runs
        timed = max(t for t in range(1, args.learn_steps + 1) if t + warm_up_steps(t) <= args.learn_steps)
        kept["entries"][name]["learns_the_same"] = check = learning_check(args.work, name, timed)
        print(f"{name}: {check}", flush=True)
    args.out.write_text(json.dumps(kept, indent=2) + "\n")
    return 0


def _budget_runs_only(args, names: list[str], kept: dict) -> int:
    """``--budget-run``: each named entry's budget_check from the runs under that checkout, written into ``--out``.
    A budget changed in params.yaml since the speed run is taken as it is: ``max_steps`` leaves the step
    time alone, so the entry's steps, ratio and the projection follow it; any other change needs a speed run.
    ``kept``: ``--out``'s figures."""
    settings = {name: fast_settings(name) for name in names}
    runs = [args.budget_run / "runs" / n / f for n, now in settings.items() if "max_steps" in now
            for f in ("train_summary.json", "metrics.json")]
    if missing := [str(r) for r in runs if not r.exists()]:  # before any entry is recounted
        raise cli_errors.ScriptError(f"--budget-run {args.budget_run} lacks {', '.join(missing)}: train and "
                                     "evaluate there first (`attnzoo repro evaluate@NAME`)")
    for name in names:
        entry = kept["entries"][name]
        now = settings[name]
        if _without_budget(now) != _without_budget(entry["fast_settings"]):
            raise cli_errors.ScriptError(f"{name}'s settings in params.yaml differ from those measured by "
                                         f"more than max_steps; measure it again with --entries {name}")
        entry.update(fast_settings=now, steps=fast_steps(now, entry["baseline_steps"], entry["baseline_val_curve"]))
        entry["ratio"] = ratio(entry)
        if "max_steps" not in now:  # the baseline's budget again: no shorter budget to give evidence for
            entry.pop("budget_check", None)
            print(f"{name}: the baseline's budget, {entry['steps']:,} steps", flush=True)
            continue
        entry["budget_check"] = check = budget_check(name, entry, args.budget_run)
        print(f"{name}: {check}", flush=True)
    kept["projected"] = projected(kept["entries"])
    args.out.write_text(json.dumps(kept, indent=2) + "\n")
    print(f"projected zoo training time: {kept['projected']}")
    return 0


def _without_budget(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k != "max_steps"}


if __name__ == "__main__":
    cli_errors.run(main)
