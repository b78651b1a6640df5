"""``attnzoo quickstart``: three real models trained, checked, published and answering, in minutes.

It runs the real pipeline (``attnzoo repro``: prepare, tune, train, evaluate, export with parity,
int8 quantize with its gate, publish) for the entries that meet their bars fastest, on the
repository's own ``params.yaml``, then asks each published model about the sample input of its task
in ``examples/`` with the same code ``attnzoo predict --local`` runs, and says where the attention
plots are and how to serve the models. ``--profile smoke`` does the same with tiny models in a scratch
copy (minutes less, answers of untrained quality).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]  # the checkout: pipeline/runner/ is two levels down
# entry -> its task's sample input (examples/README.md): the entries whose whole pipeline is fastest
ENTRIES = {"neural_programmer": "examples/table_qa.json", "pointer_sort": "examples/sort.json",
           "act_parity": "examples/parity.json"}


def _bar(workdir: Path, name: str) -> str:
    """``accuracy 1.0 >= 0.95: met`` from the entry's runs/<name>/metrics.json."""
    bar = json.loads((workdir / "runs" / name / "metrics.json").read_text())["bar"]
    conds = ", ".join(f"{c['metric']} {c['measured']} {c['op']} {c['value']}" for c in bar["conditions"])
    return f"{conds}: {'met' if bar['passed'] else 'NOT met'}"


def _answer(name: str, inputs: dict, outs: dict) -> list[str]:
    """A person's reading of one answer (the JSON that ``attnzoo predict`` prints holds the same)."""
    if name == "neural_programmer":
        cells = np.argwhere(outs["cells"][0])
        answer = (f"the cells at (row, column) {[tuple(map(int, c)) for c in cells]}" if outs["is_lookup"][0]
                  else f"{float(outs['answer'][0]):g}")
        columns = inputs["columns"][0]
        steps = [f"step {t + 1}: operation '{op}', column '{columns[int(c.argmax())]}'"
                 for t, (op, c) in enumerate(zip(outs["operations"][0], outs["col_weights"][0]))]
        return [f"question: {inputs['question'][0]}", f"answer:   {answer}", *steps]
    if name == "pointer_sort":
        points = [round(float(p[0]), 3) for p in inputs["points"][0]]
        order = [int(i) for i in outs["pointers"][0] if i >= 0]
        return [f"numbers:  {points}", f"pointers: {order}",
                f"sorted:   {[points[i] for i in order]} (right: {[points[i] for i in order] == sorted(points)})"]
    if name == "act_parity":
        bits = [int(b) for b in inputs["x"][0]]
        parity = int(outs["bits"][0][0])
        return [f"inputs:  {bits} ({bits.count(1)} of them +1)",
                f"parity:  {parity} (right: {parity == bits.count(1) % 2}), after {int(outs['steps'][0])} "
                "ponder steps"]
    return [json.dumps({k: v.tolist() for k, v in outs.items()})]


def answer_all(workdir: Path, entries: dict[str, str]) -> None:
    """Each entry's published model answering its sample input, with ONNX Runtime in this process."""
    from serving.client import DATATYPES, LocalClient, LocalError

    client = LocalClient(workdir / "model_repository")
    for name, example in entries.items():
        version, note = None, ""
        try:
            meta = client.model_metadata(name)
        except LocalError as err:  # not promoted (the smoke profile's tiny models miss their bars): the newest
            if err.status != 409:
                raise
            version = max(int(p.name) for p in (workdir / "model_repository" / name).iterdir() if p.name.isdigit())
            meta, note = client.model_metadata(name, version), ", not promoted to production"
        declared = {i["name"]: i["datatype"] for i in meta["inputs"]}
        raw = json.loads((ROOT / example).read_text())
        inputs = {k: np.asarray(v, dtype=DATATYPES[declared[k]]) for k, v in raw.items()}
        outs = client.infer(name, inputs, version)
        shown = version or max(map(int, meta.get("versions") or [0]))
        print(f"\n{name} (version {shown}{note}; bar: {_bar(workdir, name)})")
        print(f"  $ attnzoo predict {name} {example} --local --attention"
              + (f" --repository {workdir / 'model_repository'}" if workdir != ROOT else "")
              + (f" --version {version}" if version else ""))
        for line in _answer(name, raw, outs):
            print(f"  {line}")
        plots = sorted(p for p in (workdir / "runs" / name / "plots").glob("*.png") if p.name != "by_length.png")
        print(f"  attention plots: {', '.join(str(p.relative_to(workdir)) for p in plots[:2])}"
              + (f" and {len(plots) - 2} more in runs/{name}/plots/" if len(plots) > 2 else ""))


def quickstart(jobs: int, profile: str | None = None, workdir: Path | None = None,
               entries: dict[str, str] | None = None) -> int:
    entries = entries or ENTRIES
    targets = [f"publish@{name}" for name in entries]
    from pipeline import profiles

    if profile:
        workdir = profiles.lay_out(ROOT, workdir or profiles.default_workdir(profile), profile)
        env = profiles.env_for(workdir)
    else:
        workdir, env = ROOT, dict(os.environ)
    print(f"attnzoo quickstart: the whole pipeline for {', '.join(entries)} ({jobs} stages at a time), in {workdir}",
          flush=True)
    code = profiles.repro_in(workdir, targets, jobs, env)
    if code != 0:
        print("error: the pipeline stopped (above: the stage and its log); fix it and run `attnzoo quickstart` "
              "again, it goes on from what finished", file=sys.stderr)
        return code
    print("\nThe published models answer the sample inputs in examples/:")
    answer_all(workdir, entries)
    repo = workdir / "model_repository"
    print(f"\nServe them: attnzoo serve --repository {os.path.relpath(repo)}   "
          "(then: attnzoo predict neural_programmer examples/table_qa.json)")
    print("Every entry's figures: docs/results.md; the whole pipeline: make repro")
    return 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="Train, check, publish and ask three real models (neural_programmer, pointer_sort, act_parity): "
                    "the real pipeline, about 8 minutes on 2 cores.")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                    help="stages at once (default: the number of cores, %(default)s)")
    ap.add_argument("--profile", metavar="NAME",
                    help="a profile of profiles/ (e.g. smoke: tiny models, minutes), run in a scratch copy")
    ap.add_argument("--workdir", type=Path, metavar="DIR", help="with --profile: the scratch copy")
    args = ap.parse_args(argv)
    if args.workdir and not args.profile:
        ap.error("--workdir goes with --profile")
    from pipeline.profiles import ProfileError

    try:
        raise SystemExit(quickstart(max(1, args.jobs), args.profile, args.workdir))
    except ProfileError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
