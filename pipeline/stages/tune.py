"""Stage ``tune@<model>``: Ray Tune search with ASHA early stopping.

Every trial calls the same :func:`pipeline.training.loop.train` with the trial's overrides and a
shortened budget (``params.yaml`` ``tune``); each is an MLflow child run of one tune run, tagged
with the Ray node it ran on. The best configuration among the trials that finished goes to
``runs/<model>/tuned.yaml``, which ``config.resolve`` layers over ``params.yaml``.

With ``RAY_ADDRESS`` set, trials run on that cluster (``ray start --head`` / ``ray start
--address``, docs/cluster.md); otherwise Ray starts locally. The driver ships its own code
(a ``working_dir`` of its checkout, without data) to the workers and tells them the MLflow store; the
prepared data and ``params.yaml`` are read at the driver's repository path, so on a real cluster
that path must be a shared filesystem mounted at the same place on every node.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import yaml

from pipeline import tracking
from pipeline.cluster import check_address, runtime_env
from pipeline.config import ROOT, UserError, load_params, resolve, tune_budget
from pipeline.entry import exit_after, model_parser, run_cli


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


MISSING_MODULE = re.compile(r"No module named '([^']+)'")


def _trial(config: dict, name: str, budget: dict, parent_run_id: str, root: str, tracking_uri: str) -> None:
    """One Ray Tune trial: the shared training loop on a shortened budget."""
    import ray
    from ray import tune

    from pipeline.training.loop import train

    node = ray.get_runtime_context().get_node_id()
    # The worker's environment is its raylet's, not the driver's: pin the store (runtime_env
    # env_vars does too, but only when this module called ray.init). MLFLOW_RUN_CONTEXT tags every
    # run this process starts, so the child run records its node even if the trial dies early.
    os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
    os.environ["MLFLOW_RUN_CONTEXT"] = json.dumps({"ray.node_id": node,
                                                   "ray.trial_id": tune.get_context().get_trial_id()})
    overrides = {**config, "max_steps": budget["max_steps"], "eval_every": budget["eval_every"]}
    run = resolve(name, overrides=overrides, root=Path(root), use_tuned=False)

    def report(metrics: dict) -> None:
        try:
            tune.report({"val_loss": metrics["val_loss"], "step": metrics["step"], "node_id": node})
        except SystemExit:  # how Ray stops a trial that ASHA cut: end its MLflow run as KILLED, not FAILED
            import mlflow

            if mlflow.active_run():
                mlflow.end_run("KILLED")
            raise

    out = Path(tempfile.mkdtemp(prefix=f"tune-{name}-"))
    try:
        train(run, out, report=report, parent_run_id=parent_run_id, progress=False)
    finally:
        shutil.rmtree(out, ignore_errors=True)  # trial weights are not kept: train@ retrains


def describe_error(err: BaseException) -> str:
    """``FloatingPointError: ntm: loss became nan at step 3`` from a trial's (Ray-wrapped) error."""
    cause = getattr(err, "cause", None) or err  # RayTaskError/RayActorError wrap the trial's exception
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    text = lines[-1].strip() if lines else ""
    kind = type(cause).__name__
    return f"{kind}: {text}" if text and not text.startswith(kind) else (text or kind)


def missing_module(err: BaseException) -> str | None:
    """The top-level package a trial could not import, if that is why it failed."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, ImportError) and cause.name:
        return cause.name.split(".")[0]
    found = MISSING_MODULE.search(str(err))  # the text survives where the exception class does not
    return found.group(1).split(".")[0] if found else None


def pick_best(name: str, results) -> tuple[dict, float]:
    """The config and last ``val_loss`` of the best trial that finished with a finite loss.

    Errored trials (a crash, a non-finite loss) and NaN losses are skipped rather than letting
    ``ResultGrid.get_best_result`` return one of them. A trial that could not import a package
    fails the stage even if others finished: that node cannot run this search.
    """
    finished, errors = [], []
    for result in results:
        if result.error is not None:
            errors.append(result.error)
            continue
        loss = (result.metrics or {}).get("val_loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            finished.append((float(loss), result.config))
    for err in errors:
        if package := missing_module(err):
            raise UserError(f"tune@{name}: a Ray worker cannot import '{package}'; install attnzoo's "
                            "training extra on every Ray node (pip install -e \".[train,cpu]\", or "
                            "\".[train,gpu]\" on GPU nodes)")
    if not finished:
        why = f"the first error: {describe_error(errors[0])}" if errors else "no finite val_loss was reported"
        raise UserError(f"tune@{name}: no trial finished ({len(errors)} of {len(results)} failed); {why}")
    loss, config = min(finished, key=lambda item: item[0])
    return config, loss


def end_stopped_runs(experiment_id: str, parent: str) -> None:
    """End as KILLED the trials' MLflow runs still open once the search is over. A trial that ASHA cut ends its
    own run in ``report``; one that Ray stopped before it reached ``report`` again (its worker killed between two
    validations) leaves it RUNNING, though nothing runs it any more."""
    from mlflow import MlflowClient

    client = MlflowClient()
    for child in client.search_runs([experiment_id], f"tags.mlflow.parentRunId = '{parent}' and "
                                                     "attributes.status = 'RUNNING'"):
        client.set_terminated(child.info.run_id, "KILLED")


def tune_model(name: str, root: Path = ROOT) -> dict:
    """Search ``models.<name>.search_space``; write and return the best overrides."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    params = load_params(root)
    run = resolve(name, params, root=root, use_tuned=False)
    budget = dataclasses.asdict(tune_budget(name, params))
    out = run.run_dir / "tuned.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not run.search_space or budget["num_samples"] < 1:
        out.write_text(yaml.safe_dump({}))
        return {}
    uri = tracking.tracking_uri(root)
    started = not ray.is_initialized()
    if started:
        address = os.environ.get("RAY_ADDRESS")
        check_address(address)
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, runtime_env=runtime_env(uri))
        except ConnectionError as err:  # RAY_ADDRESS=auto with no cluster on this machine
            raise UserError(f"RAY_ADDRESS={address}: {err}; start the head with `ray start --head` "
                            "or unset RAY_ADDRESS to run locally") from None
        except ray.exceptions.AuthenticationError:
            raise UserError(f"the Ray cluster at RAY_ADDRESS={address} wants a token: set RAY_AUTH_MODE=token and "
                            "RAY_AUTH_TOKEN (or ~/.ray/auth_token) to the cluster's token (docs/cluster.md)") from None
    storage = Path(tempfile.mkdtemp(prefix=f"ray-{name}-"))
    try:
        with tracking.run(name, "tune", params={"budget": budget, "space": run.search_space}, root=root) as mlflow:
            parent = mlflow.active_run().info.run_id
            trainable = tune.with_parameters(_trial, name=name, budget=budget, parent_run_id=parent,
                                             root=str(Path(root).resolve()), tracking_uri=uri)
            tuner = tune.Tuner(
                tune.with_resources(trainable, {"cpu": budget["cpus_per_trial"]}),
                param_space=search_space(run.search_space),
                tune_config=tune.TuneConfig(
                    metric="val_loss", mode="min", num_samples=budget["num_samples"],
                    # stop_last_trials=False: a trial that reaches max_t returns by itself, so its
                    # MLflow run ends FINISHED with its summary instead of being cut off at the last report.
                    scheduler=ASHAScheduler(max_t=max(1, budget["max_steps"] // budget["eval_every"]),
                                            grace_period=budget["grace_period"], stop_last_trials=False),
                ),
                # A failed trial (a crash, a non-finite loss) is reported, not retried: it would fail again.
                # Trials save no checkpoints, so a storage path local to the driver is enough.
                run_config=tune.RunConfig(name=f"tune-{name}", storage_path=str(storage), verbose=1,
                                          failure_config=tune.FailureConfig(max_failures=0)),
            )
            results = tuner.fit()
            end_stopped_runs(mlflow.active_run().info.experiment_id, parent)
            best, best_loss = pick_best(name, results)
            tuned = {k: (float(v) if isinstance(v, float) else v) for k, v in best.items()}
            nodes = {r.metrics.get("node_id") for r in results if r.metrics and r.metrics.get("node_id")}
            mlflow.log_params({f"best.{k}": v for k, v in tuned.items()})
            mlflow.log_metrics({"best_val_loss": best_loss, "trials": len(results),
                                "trials_failed": results.num_errors, "ray_nodes": len(nodes)})
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        if started:
            ray.shutdown()
    out.write_text(yaml.safe_dump(tuned))
    return tuned


def main(argv: list[str] | None = None) -> None:
    ap = model_parser("Hyper-parameter search for one model entry (its search_space and tune budget).")
    args = ap.parse_args(argv)
    run_cli(lambda: print(yaml.safe_dump(tune_model(args.model)) or "{}"))


if __name__ == "__main__":
    exit_after(main)
