"""Stage ``prepare@<task>``: raw data (packages, seeds) → ``data/prepared/<task>/`` + manifest.

Writes into a scratch folder (named after the process) renamed into place on success, so a failure (say, a missing
Debian package) leaves any earlier prepared data untouched. Where the data came from (package versions, downloaded
bytes) goes to ``data/provenance/<task>.json``, which no stage depends on: a package update that leaves the data as
it was changes nothing downstream. When the data differs from what ``dvc.lock`` records, the stage says what changed:
the packages, and (from the recorded files, where the local DVC cache holds them) what the task reports, such as the
translation pairs added and removed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

import yaml

from pipeline import tracking
from pipeline.config import ROOT
from pipeline.entry import exit_after, run_cli, task_entry
from pipeline.files import scratch_beside, write_atomic
from pipeline.tasks import get_task


def checksums(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def prepare(task_name: str, params: dict, out: Path, provenance: Path | None = None) -> dict:
    """Prepare ``task_name`` with its ``params.yaml`` section into ``out`` (its provenance into the file
    ``provenance``, when given); returns the manifest."""
    task = get_task(task_name)
    out = Path(out)
    tmp = scratch_beside(out)
    try:
        facts = task.prepare(params, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # No run time and no package version in the manifest: it must be a function of the data alone, or
    # re-running an unchanged prepare would change its output's hash and retrain every model downstream.
    # The stage logs its duration to MLflow and the versions to the provenance file instead.
    origin = facts.pop("provenance", {})
    manifest = {"task": task_name, "params": params, **facts, "files": checksums(tmp)}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    if provenance is not None:
        provenance.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(provenance, json.dumps(origin, indent=2, sort_keys=True) + "\n")
    return manifest


def recorded_files(root: Path, task: str) -> dict[str, Path] | None:
    """The prepared files ``dvc.lock`` records for ``task``, by name, in the local DVC cache; None where the
    lock records none or the cache lacks them (a fresh clone without a remote)."""
    lock = root / "dvc.lock"
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}) if lock.exists() else {}
    stage = stages.get(f"prepare@{task}", {})
    md5 = next((o.get("md5") for o in stage.get("outs", []) if o.get("path") == f"data/prepared/{task}"), None)
    if not md5:
        return None
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    try:
        repo = Repo(str(root))
    except DvcException:  # a copy of the files outside a git and DVC repository: no cache to compare with
        return None
    with repo:
        odb = repo.cache.local
        listing = Path(odb.oid_to_path(md5))
        if not listing.is_file():
            return None
        files = {e["relpath"]: Path(odb.oid_to_path(e["md5"])) for e in json.loads(listing.read_text())}
    return files if all(p.is_file() for p in files.values()) else None


def package_changes(before: dict, after: dict) -> list[str]:
    """``name old → new`` for every package whose version differs between two provenance records (added and
    removed ones too)."""
    def versions(record: dict) -> dict[str, str]:
        sources = (record.get("sources") or {}).values()
        return {n: v for source in sources for n, v in source.get("packages", {}).items()}

    old, new = versions(before), versions(after)
    return [f"{n} {old.get(n, '(none)')} → {new.get(n, '(none)')}" for n in sorted(old.keys() | new.keys())
            if old.get(n) != new.get(n)]


def changes(task_name: str, manifest: dict, before: dict[str, Path] | None, out: Path,
            origin_before: dict, origin_after: dict) -> list[str]:
    """What prepare tells a user whose data is not the one dvc.lock records (nothing when it is)."""
    packages = package_changes(origin_before, origin_after)
    if origin_before or not packages:
        moved = [f"packages: {', '.join(packages)}"] if packages else []
    else:  # the first record: every package is new, so their count, not their names
        moved = [f"packages: {len(packages)} recorded in data/provenance/{task_name}.json, none before to compare with"]
    if before is None or "manifest.json" not in before:
        return moved and [f"{task_name}: the data dvc.lock records is not in this DVC cache to compare with", *moved]
    if json.loads(before["manifest.json"].read_text()).get("files") == manifest["files"]:
        return moved and [f"{task_name}: the same data as dvc.lock records; nothing downstream retrains", *moved]
    return [f"{task_name}: the prepared data differs from what dvc.lock records, so its models retrain "
            "(docs/troubleshooting.md)", *moved, *get_task(task_name).changes(before, out)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Prepare one task's data.")
    ap.add_argument("task", help="a params.yaml task, e.g. copy")
    args = ap.parse_args(argv)

    def body():
        params = task_entry(args.task)
        tracking.ensure_reachable()  # before the work, not after it: a dead server fails in seconds
        provenance = ROOT / "data" / "provenance" / f"{args.task}.json"
        origin_before = json.loads(provenance.read_text()) if provenance.is_file() else {}
        started = time.time()
        out = ROOT / "data" / "prepared" / args.task
        manifest = prepare(args.task, params, out, provenance)
        seconds = time.time() - started
        print(f"prepared {args.task} in {seconds:.1f} s")
        for line in changes(args.task, manifest, recorded_files(ROOT, args.task), out, origin_before,
                            json.loads(provenance.read_text())):
            print(line)
        with tracking.run(args.task, "prepare", params={"task": params}) as mlflow:
            mlflow.log_dict(manifest, "manifest.json")
            mlflow.log_metric("prepare_seconds", round(seconds, 1))
        print(json.dumps({k: v for k, v in manifest.items() if k != "files"}, indent=1))

    run_cli(body)


if __name__ == "__main__":
    exit_after(main)
