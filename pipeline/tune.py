"""Stage ``tune@<model>``: Ray Tune search with ASHA early stopping.

Every trial calls the same :func:`pipeline.train.train` with the trial's overrides and a
shortened budget (``params.yaml`` ``tune``); each is an MLflow child run of one tune run. The
best configuration goes to ``runs/<model>/tuned.yaml``, which ``config.resolve`` layers over
``params.yaml``. With ``RAY_ADDRESS`` set, trials run on that cluster (``ray start --head`` /
``ray start --address``); otherwise Ray starts locally.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import yaml

from pipeline import tracking
from pipeline.config import ROOT, UserError, load_params, resolve


def search_space(spec: dict) -> dict:
    """``{lr: {loguniform: [1e-4, 1e-2]}, dropout: {grid: [0.1, 0.3]}}`` -> Ray samplers.

    ``grid`` values are each tried (times ``num_samples``); the other kinds are sampled.
    """
    from ray import tune

    kinds = {"loguniform": tune.loguniform, "uniform": tune.uniform, "choice": tune.choice,
             "randint": tune.randint, "qloguniform": tune.qloguniform, "grid": tune.grid_search}
    space = {}
    for key, dist in spec.items():
        ((kind, args),) = dist.items()
        if kind not in kinds:
            raise UserError(f"search space '{key}': unknown distribution '{kind}' (use {sorted(kinds)})")
        space[key] = kinds[kind](args) if kind in ("choice", "grid") else kinds[kind](*args)
    return space


def _trial(config: dict, name: str, budget: dict, parent_run_id: str, root: str) -> None:
    """One Ray Tune trial: the shared training loop on a shortened budget."""
    from ray import tune

    from pipeline.train import train

    overrides = {**config, "max_steps": budget["max_steps"], "eval_every": budget["eval_every"]}
    run = resolve(name, overrides=overrides, root=Path(root), use_tuned=False)
    out = Path(tempfile.mkdtemp(prefix=f"tune-{name}-"))
    try:
        train(run, out, report=lambda m: tune.report({"val_loss": m["val_loss"], "step": m["step"]}),
              parent_run_id=parent_run_id, progress=False)
    finally:
        shutil.rmtree(out, ignore_errors=True)  # trial weights are not kept: train@ retrains


def tune_model(name: str, root: Path = ROOT) -> dict:
    """Search ``models.<name>.search_space``; write and return the best overrides."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    params = load_params(root)
    run = resolve(name, params, root=root, use_tuned=False)
    budget = {"num_samples": 4, "max_steps": 200, "eval_every": 50, "grace_period": 2, "cpus_per_trial": 1,
              **params.get("tune", {}), **params["models"][name].get("tune", {})}
    out = run.run_dir / "tuned.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not run.search_space or budget["num_samples"] < 1:
        out.write_text(yaml.safe_dump({}))
        return {}
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 configure_logging=False, runtime_env={"env_vars": {"PYTHONPATH": str(root)}})
    storage = Path(tempfile.mkdtemp(prefix=f"ray-{name}-"))
    try:
        with tracking.run(name, "tune", params={"budget": budget, "space": run.search_space}, root=root) as mlflow:
            parent = mlflow.active_run().info.run_id
            trainable = tune.with_parameters(_trial, name=name, budget=budget, parent_run_id=parent,
                                             root=str(root))
            tuner = tune.Tuner(
                tune.with_resources(trainable, {"cpu": budget["cpus_per_trial"]}),
                param_space=search_space(run.search_space),
                tune_config=tune.TuneConfig(
                    metric="val_loss", mode="min", num_samples=budget["num_samples"],
                    scheduler=ASHAScheduler(max_t=max(1, budget["max_steps"] // budget["eval_every"]),
                                            grace_period=budget["grace_period"]),
                ),
                run_config=tune.RunConfig(name=f"tune-{name}", storage_path=str(storage), verbose=1),
            )
            results = tuner.fit()
            best = results.get_best_result(metric="val_loss", mode="min")
            if best.metrics is None or best.error:
                raise UserError(f"tune@{name}: no trial finished; see the Ray log above")
            tuned = {k: (float(v) if isinstance(v, float) else v) for k, v in best.config.items()}
            mlflow.log_params({f"best.{k}": v for k, v in tuned.items()})
            mlflow.log_metric("best_val_loss", best.metrics["val_loss"])
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    out.write_text(yaml.safe_dump(tuned))
    return tuned


def main(argv: list[str] | None = None) -> None:
    from pipeline.cli import run_cli

    ap = argparse.ArgumentParser(description="Hyper-parameter search for one model entry.")
    ap.add_argument("model")
    args = ap.parse_args(argv)
    run_cli(lambda: print(yaml.safe_dump(tune_model(args.model)) or "{}"))


if __name__ == "__main__":
    main()
