"""Stage ``publish@<model>``: a versioned, deployable artifact + an MLflow model version.

Layout (Triton-style: one folder per model, integer versions)::

    model_repository/<model>/
        config.pbtxt                 # Triton config (python backend) + per-graph I/O as comments
        <version>/                   # serving/version.py: the folder's files and metadata.json, and its check

Lineage: git commit and the DVC hashes (``dvc.lock``) of the data, checkpoint and ONNX graphs.
The MLflow version gets alias ``production`` only if parity passed and the quality bar was met.
A new version is written only when the graphs, the serving block or the bundled serving code changed;
re-publishing an unchanged model is a no-op.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import yaml

import models
from pipeline import tracking
from pipeline.bars import check_bar
from pipeline.config import ROOT, RunConfig, UserError, read_manifest, trained
from pipeline.entry import RUN_HELP, exit_after, model_parser, run_cli
from pipeline.files import clear_dead, scratch_beside, sync_folder, write_atomic
from pipeline.serving_meta import serving_block
from serving.version import SERVING_DIR, digest, versions_in, write

DTYPES = {"tensor(float)": "TYPE_FP32", "tensor(int64)": "TYPE_INT64", "tensor(bool)": "TYPE_BOOL",
          "tensor(int32)": "TYPE_INT32"}


def dvc_hashes(root: Path, name: str) -> dict[str, str]:
    """md5s DVC recorded for this model's stages (empty outside a DVC run)."""
    lock = root / "dvc.lock"
    if not lock.exists():
        return {}
    stages = yaml.safe_load(lock.read_text()).get("stages", {})
    out = {}
    for stage in (f"train@{name}", f"export@{name}"):
        for entry in stages.get(stage, {}).get("deps", []) + stages.get(stage, {}).get("outs", []):
            if "md5" in entry:
                out[entry["path"]] = entry["md5"]
    return out


TRITON_TYPES = {"BYTES": "TYPE_STRING"}  # every other v2 datatype X is TYPE_X


def config_pbtxt(name: str, repo: Path, onnx_dir: Path, graphs: list[str],
                 newest: tuple[int, dict | None] = (0, None)) -> str:
    """Triton model configuration: the whole model as a python-backend model over the versions
    that bundle ``model.py``; each graph's own I/O follows as comments, for humans. ``newest``: the
    version just written and what the server answers for it (loaded once, by ``write_version``)."""
    import onnxruntime as ort

    from serving.kinds import load_version

    versions = [v for v in versions_in(repo) if (repo / str(v) / "model.py").exists()]
    lines = [f'name: "{name}"']
    if graphs == ["model"]:  # one graph: Triton's own ONNX Runtime backend serves it as it is
        sess = ort.InferenceSession(str(onnx_dir / "model.onnx"), providers=["CPUExecutionProvider"])
        ios = (("input", sess.get_inputs()), ("output", sess.get_outputs()))
        # A free axis 0 on every input and output is the batch axis: Triton batches requests itself
        # (dynamic batching, up to the rows of `attnzoo serve --max-batch`) and, by its convention for
        # max_batch_size > 0, leaves that axis out of dims. Otherwise the shapes stay as exported.
        batched = all(io.shape and not isinstance(io.shape[0], int) for _, items in ios for io in items)
        lines += ['platform: "onnxruntime_onnx"', f"max_batch_size: {64 if batched else 0}"]
        for kind, items in ios:
            entries = []
            for io in items:
                dims = ["-1" if not isinstance(d, int) else str(d) for d in io.shape][1 if batched else 0:]
                # Triton wants one dim at least: a tensor that is only the batch axis is [1] reshaped to [].
                dims_text = (f"dims: [ {', '.join(dims)} ]" if dims or not batched
                             else "dims: [ 1 ] reshape: { shape: [ ] }")
                entries.append(f'  {{ name: "{io.name}" data_type: {DTYPES.get(io.type, io.type)} {dims_text} }}')
            lines.append(f"{kind} [\n" + ",\n".join(entries) + "\n]")
        if batched:  # a tenth of a millisecond for concurrent requests to meet (the server waits none on CPU)
            lines.append("dynamic_batching { max_queue_delay_microseconds: 100 }")
        return "\n".join(lines) + "\n"
    if versions:
        served = newest[1] if newest[0] == versions[-1] else None
        if served is None:
            whole, _, _ = load_version(name, versions[-1], repo / str(versions[-1]), "cpu")
            served = whole.metadata([versions[-1]])
        lines += ['backend: "python"', "max_batch_size: 0",
                  f"version_policy: {{ specific: {{ versions: [ {', '.join(map(str, versions))} ] }} }}"]
        for kind in ("input", "output"):
            entries = [f'  {{ name: "{s["name"]}" '
                       f'data_type: {TRITON_TYPES.get(s["datatype"], "TYPE_" + s["datatype"])} '
                       f'dims: [ {", ".join(map(str, s["shape"]))} ]{" optional: true" if s.get("optional") else ""} }}'
                       for s in served[f"{kind}s"]]
            lines.append(f"{kind} [\n" + ",\n".join(entries) + "\n]")
    lines.append("# Exported graphs (the loop between them runs in serving/ or model.py):")
    for graph in graphs:
        sess = ort.InferenceSession(str(onnx_dir / f"{graph}.onnx"), providers=["CPUExecutionProvider"])
        lines.append(f'# graph "{graph}"')
        for kind, items in (("input", sess.get_inputs()), ("output", sess.get_outputs())):
            for io in items:
                dims = ", ".join("-1" if not isinstance(d, int) else str(d) for d in io.shape)
                dtype = DTYPES.get(io.type, io.type)
                lines.append(f'# {kind} {{ name: "{io.name}" data_type: {dtype} dims: [ {dims} ] }}')
    return "\n".join(lines) + "\n"


def write_version(repo: Path, name: str, onnx_dir: Path, serving: dict, meta: dict,
                  artifacts: list[Path], engine: Path | None = None) -> tuple[dict, bool]:
    """Write ``repo/<version>/`` atomically (a temp folder renamed into place); ``engine``: a folder
    copied into it under its own name (an engine's converted model, which the serving block names).

    Returns (metadata, created, what the server answers for the new version: None when unchanged); an
    unchanged model returns the latest version's metadata.
    """
    repo.mkdir(parents=True, exist_ok=True)
    clear_dead(repo)  # what a killed publish left: never a version, but part of the DVC output
    versions, identity = versions_in(repo), digest(onnx_dir, serving, engine)
    if versions:
        latest = json.loads((repo / str(versions[-1]) / "metadata.json").read_text())
        if latest.get("graph_sha256") == identity:
            return latest, False, None
    version = (versions[-1] + 1) if versions else 1
    tmp = scratch_beside(repo / str(version))  # not a version name: the server never reads it
    meta = write(tmp, name, version, onnx_dir, serving, meta, artifacts, engine, identity)
    served = served_metadata(name, version, tmp)  # loaded once: the card, Triton's config and the registry use it
    (tmp / "MODEL_CARD.md").write_text(model_card(meta, served))
    sync_folder(tmp)  # on disk before the rename makes it a version
    tmp.rename(repo / str(version))
    write_atomic(repo / "config.pbtxt", config_pbtxt(name, repo, onnx_dir, meta["graphs"], (version, served)))
    return meta, True, served


def served_metadata(name: str, version: int, folder: Path) -> dict | None:
    """What the server answers for ``GET /v2/models/<name>`` (inputs, outputs), or None for a version
    without a serving loop."""
    from serving.kinds import load_version

    whole, _, _ = load_version(name, version, folder, "cpu")
    return whole.metadata([version]) if whole is not None else None


def model_card(meta: dict, served: dict | None) -> str:
    """``MODEL_CARD.md`` of a published version: what it is, its data and licence, its quality against
    the bar, parity, limits, intended use and how to call it; from the version's own metadata."""
    from pipeline.tasks import Task, TaskError, get_task
    from serving.pyfunc import input_example

    name, version = meta["model"], meta["version"]
    try:
        task = get_task(meta["task"])
    except TaskError:  # a version made outside the pipeline (tests, hand-made graphs): the card says so
        task = Task()
    int8 = meta.get("precision") == "int8"
    lines = [f"# {name}, version {version}", "",
             f"`{meta['arch']}` on `{meta['task']}`, after {task.card.get('paper', 'no paper named')}. Published by "
             f"attnzoo from commit `{meta.get('git_commit', 'unknown')}`. Precision: "
             + (f"int8 ({'the engine below with int8 weights; the graphs: ' if meta.get('engine') else ''}"
                f"onnxruntime dynamic quantisation of `{meta['fp32_model']}` version {meta['fp32_version']})."
                if int8 else "fp32."),
             "", "## Intended use", "",
             "A reproduction of a classic attention model, for study, comparison and as a reference deployment. It "
             "knows only the distribution of its training data (below): not a general-purpose system for its "
             "input kind, and not for decisions about people.",
             "", "## Data and licence", "", f"- Data: {task.card['data']}.", f"- Licence: {task.card['licence']}.",
             "", "## Quality", "", "| metric | bar | measured | met |", "|---|---|---|---|"]
    bar = meta.get("bar") or {}
    for c in bar.get("conditions", []):
        lines.append(f"| {c['metric']} | {c['op']} {c['value']} | {c['measured']} | {'yes' if c['passed'] else 'no'} |")
    if not bar.get("conditions"):
        lines.append("| (no quality bar in params.yaml) | | | |")
    lines += ["", f"Promoted to production: {'yes' if meta.get('production') else 'no'} (that takes parity and "
              "every bar met). "
              f"ONNX vs PyTorch parity of the fp32 graphs: {'passed' if meta.get('parity_passed') else 'FAILED'}."]
    engine = meta.get("engine")
    if engine:  # served by another engine than the graphs: its own parity (int8: its gate) and scores
        p, m = engine.get("parity"), engine["metrics"]
        check = (f"parity with PyTorch {'passed' if p['passed'] else 'FAILED'} on {p['items']} test sentences "
                 f"(log-probabilities within {p['max_logp_diff']:.1e}, greedy tokens identical on "
                 f"{p['greedy_identical']})" if p else
                 f"int8 weights ({engine['serving']['compute_type']}), gate against fp32 "
                 f"{'passed' if engine['gate']['passed'] else 'NOT passed'}")
        lines.append(f"Served by {engine['name']} (the model converted from the same checkpoint): {check}; what it "
                     f"answers scores BLEU {m['bleu_beam']} (beam {m['beam']}), bar "
                     f"{'met' if engine['bar']['passed'] else 'NOT met'}.")
    if int8:
        gates = [("the graphs'", meta["int8_gate"])] + ([(f"{engine['name']}'s", engine["gate"])]
                                                       if engine and "gate" in engine else [])
        for whose, g in gates:
            rows = ", ".join(f"{c['metric']} {c['fp32']} → {c['int8']}" for c in g["conditions"]) or g.get("note", "")
            lines.append(f"int8 gate of {whose} variant (worse than fp32 by at most {g['tolerance']}): "
                         f"passed ({rows}).")
    limits = meta.get("serving", {}).get("limits") or {}
    lines += ["", "## Limits", "", "A request over one of these is refused with HTTP 413: "
              + ", ".join(f"{k} {v}" for k, v in sorted(limits.items())) + "." if limits else "Server defaults."]
    if served is not None:
        lines += ["", "## How to call it", "", "| | name | datatype | shape |", "|---|---|---|---|"]
        lines += [f"| {side} | `{s['name']}` | {s['datatype']} | {s['shape']} |"
                  for side in ("input", "output") for s in served[f"{side}s"]]
        example = input_example(served)
        if example is not None:
            body = {"inputs": [{"name": k, "shape": list(v.shape), "datatype": next(
                s["datatype"] for s in served["inputs"] if s["name"] == k), "data": v.ravel().tolist()}
                for k, v in example.items()]}
            lines += ["", "Open Inference Protocol (KServe v2) over HTTP, e.g. against `attnzoo serve`:", "",
                      "```bash", f"curl -s localhost:8000/v2/models/{name}/versions/{version}/infer \\",
                      f"  -H 'Content-Type: application/json' -d '{json.dumps(body)}'", "```"]
        lines += ["", f"Without a server: `attnzoo predict {name} ... --local`; as an MLflow model: "
                  f"`mlflow.pyfunc.load_model(\"models:/{name}@production\")`. Inputs of each kind: docs/serving.md."]
    return "\n".join(lines) + "\n"


def register(name: str, version_dir: Path, meta: dict, promote: bool, description: str,
             served: dict | None = None) -> str:
    """Log a published version as an MLflow model in the active run (models-from-code:
    ``serving/pyfunc_model.py``, the version's folder, the serving code, a signature from the served
    metadata; no pickle) and register it as a
    version of registered model ``name``, aliased ``production`` when ``promote``. Returns the
    registered version. ``served``: the version's served metadata, when the caller has it loaded."""
    import tempfile
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    import mlflow

    from serving.client import LocalClient
    from serving.kinds import kind_of
    from serving.pyfunc import input_example, signature

    requirements = []
    engine = meta["serving"].get("engine", "onnxruntime")
    for package in ("numpy", "onnxruntime", "sentencepiece", "mlflow") + ((engine,) if engine != "onnxruntime" else ()):
        try:
            requirements.append(f"{package}=={installed(package)}")
        except PackageNotFoundError:  # e.g. onnxruntime-gpu instead of onnxruntime
            pass
    version = int(meta["version"])
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "repository"
        shutil.copytree(version_dir, staged / name / str(version))  # LocalClient's layout: <name>/<version>/
        if served is None:  # a version written by an earlier, killed publish
            served = LocalClient(staged).model_metadata(name, version)
        info = mlflow.pyfunc.log_model(
            # models-from-code: the model is serving/pyfunc_model.py plus this config, never a pickle
            name="model", python_model=str(SERVING_DIR / "pyfunc_model.py"),
            model_config={"name": name, "version": version}, artifacts={"repository": str(staged)},
            code_paths=[str(SERVING_DIR)], pip_requirements=requirements, input_example=input_example(served),
            signature=signature(served, kind_of(meta["serving"], meta["graphs"]), meta["serving"]))
    client = mlflow.MlflowClient()
    try:
        client.get_registered_model(name)
    except mlflow.exceptions.MlflowException:
        client.create_registered_model(name, description=description)
    mv = mlflow.register_model(info.model_uri, name, tags={
        "repository_version": str(version), tracking.GIT_COMMIT_TAG: meta.get("git_commit", "")})
    if promote:
        client.set_registered_model_alias(name, "production", mv.version)
    return mv.version


def publish(run: RunConfig, root: Path = ROOT, repository: Path | None = None) -> dict:
    """Publish ``run``'s exported graphs (and its int8 variant) as versions of the model repository
    ``root/model_repository``, registered in MLflow. ``repository``: another model repository, for
    an ad-hoc run (``train --out DIR``): its versions are written there and registered nowhere, so
    the registry and its production alias keep to the pipeline's models."""
    adhoc = repository is not None
    repository = Path(repository) if adhoc else root / "model_repository"
    # Before a version is written: a re-run finds it unchanged and would never register it in MLflow.
    tracking.ensure_reachable(root)
    onnx_dir = run.run_dir / "onnx"
    parity_path, metrics_path = run.run_dir / "parity.json", run.run_dir / "metrics.json"
    if not parity_path.exists() or not metrics_path.exists():
        raise UserError(f"{run.name}: run `dvc repro export@{run.name}` and `evaluate@{run.name}` first")
    parity, metrics = json.loads(parity_path.read_text()), json.loads(metrics_path.read_text())
    if not parity["passed"]:  # a graph that does not compute what PyTorch computes is never deployable
        raise UserError(f"{run.name}: ONNX parity failed ({parity_path}); nothing was published. Fix the export "
                        f"and run `dvc repro export@{run.name}`")
    if not (run.run_dir / "int8_metrics.json").exists():  # before anything is written: publish carries int8 too
        raise UserError(f"{run.name}: run `dvc repro quantize@{run.name}` first (publish carries its int8 variant)")
    graphs = sorted(p.stem for p in onnx_dir.glob("*.onnx"))
    manifest = read_manifest(run.data_dir)
    promote = bool(parity["passed"] and metrics["bar"]["passed"])
    serving = serving_block(models.make_config(run.arch, run.model), graphs, run)
    lineage = {"arch": run.arch, "task": run.task, "config": run.model, "parity_passed": parity["passed"],
               "git_commit": tracking.git_commit(root),
               **({"run_dir": str(run.run_dir.resolve())} if adhoc else {"dvc": dvc_hashes(root, run.name)})}
    artifacts = [run.data_dir / a for a in manifest.get("artifacts", [])]
    with tempfile.TemporaryDirectory() as scratch:
        fp32_serving, engine, engine_dir = serving, {}, None
        if run.engine == "ctranslate2":
            from pipeline import ctranslate2_engine

            fp32_serving, record = ctranslate2_engine.build(run, serving, artifacts, Path(scratch))
            engine, engine_dir = {"engine": record}, Path(scratch) / ctranslate2_engine.ENGINE_DIR
            promote = promote and record["bar"]["passed"]  # what it serves meets the bar too
        meta, created, served = write_version(
            repository / run.name, run.name, onnx_dir, fp32_serving,
            {**lineage, "metrics": scalars(metrics), "bar": metrics["bar"], **engine, "production": promote},
            artifacts, engine_dir)
    # Also a version written by a run killed before it registered it (its metadata has no MLflow version).
    if not adhoc and (created or "mlflow_version" not in meta):
        _register(run, root, meta, promote, served)
    meta["int8"] = publish_int8(run, root, serving, lineage, artifacts, meta["version"], promote,
                                repository=repository, register=not adhoc)
    return meta


def scalars(metrics: dict) -> dict:
    """The metrics a version's metadata carries: the scalar ones (not per-length tables)."""
    return {k: v for k, v in metrics.items() if not isinstance(v, (list, dict))}


def _register(run: RunConfig, root: Path, meta: dict, promote: bool, served: dict | None) -> None:
    """Register a newly written version in MLflow and record the MLflow version in its metadata."""
    name = meta["model"]
    version_dir = root / "model_repository" / name / str(meta["version"])
    with tracking.run(name, "publish", root=root) as mlflow:
        meta["mlflow_version"] = register(name, version_dir, meta, promote,
                                          f"attnzoo {run.arch} on {run.task}"
                                          + (f" (int8 variant of {run.name})" if name != run.name else ""), served)
        mlflow.log_artifact(str(version_dir / "MODEL_CARD.md"))
    write_atomic(version_dir / "metadata.json", json.dumps(meta, indent=1))


# The int8 variant of model X is its own model, X-int8 (model_repository/X-int8/<version>/, MLflow model
# X-int8): any KServe v2 or Triton client selects it by name, with versions and a default of its own.
INT8_SUFFIX = "-int8"


def publish_int8(run: RunConfig, root: Path, serving: dict, lineage: dict, artifacts: list[Path],
                 fp32_version: int, promote: bool, *, repository: Path, register: bool) -> dict:
    """Publish ``quantize@``'s int8 graphs as model ``<name>-int8`` of ``repository`` when their
    quality gate passed (``runs/<name>/int8_metrics.json``); its metadata carries the int8 metrics,
    the gate, the bar checked on the int8 metrics, and the fp32 version it was made beside.
    Production only when the fp32 model is and the int8 metrics meet the bar too. ``repository`` and
    ``register`` are ``publish``'s decisions for the fp32 model, passed on so the two cannot differ.
    Returns what happened (``main`` prints it)."""

    name = run.name + INT8_SUFFIX
    repo = repository / name
    repo.mkdir(parents=True, exist_ok=True)  # the stage's output also when nothing is published
    report_path = run.run_dir / "int8_metrics.json"
    report = json.loads(report_path.read_text())
    if not report["gate"]["passed"]:
        why = report["gate"].get("note") or "int8 is worse than fp32 by more than the gate allows"
        shown = report_path.relative_to(root) if report_path.is_relative_to(root) else report_path
        return {"model": name, "published": False, "reason": f"{why} ({shown})"}
    bar = check_bar(report["metrics"], run.bar or [])
    served, engine, engine_dir = serving, {}, None
    record = report.get("engine")
    if record and record["gate"]["passed"]:  # served by the engine's own int8 model (quantize@ scored it)
        served = {**serving, "engine": record["name"], record["name"]: record["serving"]}
        engine = {"engine": {**record, "bar": check_bar(record["metrics"], run.bar or [])}}
        engine_dir = run.run_dir / "int8" / record["serving"]["folder"]
        promote = promote and engine["engine"]["bar"]["passed"]
    meta, created, loaded = write_version(
        repo, name, run.run_dir / "int8", served,
        {**lineage, "precision": "int8", "fp32_model": run.name, "fp32_version": fp32_version,
         "metrics": scalars(report["metrics"]), "bar": bar, "int8_gate": report["gate"], **engine,
         "quantization": report["quantization"], "production": bool(promote and bar["passed"])},
        artifacts, engine_dir)
    if register and (created or "mlflow_version" not in meta):
        _register(run, root, meta, meta["production"], loaded)
    return {"model": name, "published": True, "version": meta["version"], "production": meta["production"]}


def main(argv: list[str] | None = None) -> None:
    ap = model_parser("Publish an exported model to model_repository/ and MLflow.",
                      f"{RUN_HELP} and evaluate, export and quantize --run DIR filled; its versions then go to "
                      "DIR/model_repository/ (attnzoo serve --repository DIR/model_repository), not to MLflow")
    args = ap.parse_args(argv)

    def body():
        repository = args.run / "model_repository" if args.run else None
        meta = publish(trained(args.model, args.run), repository=repository)
        where = repository or Path("model_repository")
        print(f"{args.model}: version {meta['version']} in {where / args.model} "
              f"({'production' if meta['production'] else 'not promoted: bar or parity not met'})")
        int8 = meta["int8"]
        print(f"{int8['model']}: version {int8['version']} in {where / int8['model']} "
              f"({'production' if int8['production'] else 'not promoted: bar or parity not met'})"
              if int8["published"] else f"{int8['model']}: not published: {int8['reason']}")

    run_cli(body)


if __name__ == "__main__":
    exit_after(main)
