"""Profiles: ``params.yaml`` changed by ``profiles/<name>.yaml`` and run in a scratch copy of the repository.

``attnzoo repro --profile smoke`` copies the checkout's files (what git tracks, and untracked files it
does not ignore) to a work folder, writes the profile's ``params.yaml`` there and runs ``attnzoo
repro`` in it. The checkout's ``dvc.lock``, ``runs/``, ``model_repository/`` and MLflow store are
never written; a second run in the same folder brings the copy's code up to date and goes on from
what the first one finished, as any ``attnzoo repro`` does.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "profiles"


def own_outputs(root: Path) -> tuple[str, ...]:
    """``dvc.lock`` and the folder of every output ``dvc.yaml`` declares (an output's path up to its first
    ``${``; a path without one, itself): a new work folder starts without the checkout's results, since
    its own pipeline makes its own (``data/provenance`` describes the full data, which a profile's
    ``prepare@`` replaces). Read from ``dvc.yaml``, so a stage's new output is never copied over a profile's."""
    stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages") or {}
    found = {"dvc.lock"}
    for stage in stages.values():
        body = stage.get("do", stage)  # foreach stages keep their definition under do:
        for kind in ("outs", "metrics", "plots"):
            for out in body.get(kind) or []:
                path = next(iter(out)) if isinstance(out, dict) else out  # {path: {cache: false}} or path
                found.add(path.split("${")[0].rsplit("/", 1)[0] if "${" in path else path.rstrip("/"))
    return tuple(sorted(found))


class ProfileError(RuntimeError):
    """A profile that does not exist or cannot be laid out; its message names the fix."""


def names() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.yaml"))


def load(name: str) -> dict:
    path = PROFILES / f"{name}.yaml"
    if not path.is_file():
        raise ProfileError(f"no profile '{name}' (profiles/{name}.yaml); the profiles are: {', '.join(names())}")
    return yaml.safe_load(path.read_text())


def apply(params: dict, profile: dict, keep: list[str] | None = None) -> dict:
    """``params`` (params.yaml, parsed) with the profile's tasks, tune budget, entries and sizes, and its
    per-entry blocks (``models.<name>.train`` ...: merged into the entry's own).

    ``keep`` narrows the profile's entries (tests run a few; default: the profile's ``keep``, else every
    entry); tasks no kept entry uses are dropped.
    """
    params = copy.deepcopy(params)
    keep = list(profile.get("keep") or params["models"]) if keep is None else list(keep)
    for task, sizes in (profile.get("tasks") or {}).items():
        params["tasks"][task].update(sizes)
    params["tune"].update(profile.get("tune") or {})
    params["models"] = {name: params["models"][name] for name in keep}
    used = {entry["task"] for entry in params["models"].values()}
    params["tasks"] = {task: spec for task, spec in params["tasks"].items() if task in used}
    for name, entry in params["models"].items():
        if "archs" in profile:
            _shrink(name, entry, profile)
        for block, values in ((profile.get("models") or {}).get(name) or {}).items():
            entry[block] = {**(entry.get(block) or {}), **values}
    return params


def _shrink(name: str, entry: dict, profile: dict) -> None:
    """A profile of tiny sizes (smoke): the entry's model at its architecture's size, its budgets the profile's."""
    if name not in profile["tuned"]:
        entry["search_space"] = {}
    tiny = {k: v for k, v in profile["archs"][entry["arch"]].items() if k not in profile["data_keys"]}
    model = {k: v for k, v in {**entry.get("model", {}), **tiny}.items()
             if k not in profile["data_keys"] and k not in profile["drop_model_keys"]}
    entry["model"] = model
    # An entry's own tune budget would override the profile's; the key stays (empty) because
    # tune@ lists models.<name>.tune among its params and DVC needs it present.
    entry["tune"] = {}
    entry["train"] = {**entry.get("train", {}), **profile["train"]}
    entry["evaluate"] = {**entry.get("evaluate", {}), **profile["evaluate"]}


def default_workdir(name: str) -> Path:
    """``$ATTNZOO_CACHE/profiles/NAME`` (``~/.cache/attnzoo/profiles/NAME``): beside the corpus downloads."""
    from pipeline.tasks.translation_de_en.corpus.debian import default_cache

    return default_cache() / "profiles" / name


def _checkout_files(root: Path) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        raise ProfileError(f"{root} is not a git checkout of attnzoo; a profile copies a checkout "
                           "(git clone the repository and run it there)") from None
    return [f for f in out.split("\0") if f]


def lay_out(root: Path, workdir: Path, name: str, keep: list[str] | None = None) -> Path:
    """The work folder for profile ``name``: the checkout's files (its own outputs left out), the
    profile's ``params.yaml``, and a git repository of its own for DVC. Returns ``workdir``."""
    profile = load(name)
    workdir = workdir.resolve()
    if workdir == root.resolve() or root.resolve() in workdir.parents:
        raise ProfileError(f"--workdir {workdir} is inside the checkout; give a folder outside it")
    workdir.mkdir(parents=True, exist_ok=True)
    own = own_outputs(root)
    for rel in _checkout_files(root):
        if any(rel == out or rel.startswith(out + "/") for out in own) or not (root / rel).is_file():
            continue
        dest = workdir / rel
        if dest.is_file() and dest.read_bytes() == (root / rel).read_bytes():
            continue  # unchanged: its time stamp stays, and DVC has nothing to re-hash
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest)
    params = apply(yaml.safe_load((root / "params.yaml").read_text()), profile, keep)
    text = f"# params.yaml with profiles/{name}.yaml applied (pipeline/profiles.py)\n" \
           + yaml.safe_dump(params, sort_keys=False)
    target = workdir / "params.yaml"
    if not target.is_file() or target.read_text() != text:
        target.write_text(text)
    if not (workdir / ".git").exists():
        subprocess.run(["git", "init", "-q"], cwd=workdir, check=True)
    return workdir


def env_for(workdir: Path) -> dict[str, str]:
    """The environment of a run in ``workdir``: its own code, its own MLflow store, local Ray."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(workdir)
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{workdir / 'mlflow.db'}"
    env.pop("RAY_ADDRESS", None)
    return env


def repro_in(workdir: Path, targets: list[str], jobs: int, env: dict[str, str]) -> int:
    """``attnzoo repro --jobs JOBS TARGETS`` run in ``workdir`` (its own code, ``env``); its exit code."""
    return subprocess.run([sys.executable, "-m", "pipeline.runner.cli", "repro", "--jobs", str(jobs), *targets],
                          cwd=workdir, env=env).returncode


def run(name: str, targets: list[str], jobs: int, workdir: Path | None = None, root: Path = ROOT) -> int:
    """``attnzoo repro --jobs JOBS TARGETS`` in the profile's work folder; returns its exit code."""
    workdir = lay_out(root, workdir or default_workdir(name), name)
    print(f"profile {name}: params.yaml with profiles/{name}.yaml applied, in {workdir}", flush=True)
    code = repro_in(workdir, targets, jobs, env_for(workdir))
    if code == 0:
        print(f"profile {name}: done; its models are in {workdir / 'model_repository'} "
              f"(attnzoo serve --repository {workdir / 'model_repository'}), its metrics in {workdir / 'runs'}")
    return code
