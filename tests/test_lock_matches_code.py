"""The committed ``dvc.lock`` records the code and params in the tree, so its metrics are the code's.

A stage whose recorded dependency hash differs from the file in the tree (a ``models/*.py`` edited
after the model was trained, a params value changed, a committed metrics file rewritten) means
the committed numbers were made by other code. DVC reports it in ``dvc status`` as a *modified*
dependency; a dependency that is only *deleted* (an output the fresh clone's empty cache lacks) is
not staleness. Fix a stage listed here by re-running it (``attnzoo repro STAGE``) or, when the
change provably cannot alter its result, by ``dvc commit STAGE`` with the reason in the commit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

def stale_stages(root: Path = ROOT) -> dict[str, list[str]]:
    """``{stage: [what differs]}`` for every stage whose recorded command, code or params differ."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        status = repo.status()
    # A stage dvc.lock has no entry for was never run (a new stage kind, say): it records nothing,
    # so nothing it records can be stale; DVC calls its present dependencies "modified" all the same.
    recorded = set((yaml.safe_load((root / "dvc.lock").read_text()) or {}).get("stages", {}))
    stale: dict[str, list[str]] = {}
    for stage, entries in status.items():
        if stage not in recorded:
            continue
        for entry in entries:
            if entry == "changed command":
                stale.setdefault(stage, []).append("command")
            if not isinstance(entry, dict):
                continue
            for path, state in entry.get("changed deps", {}).items():
                if isinstance(state, dict):  # params.yaml: {key: "modified" | "new" | "deleted"}
                    stale.setdefault(stage, []).extend(f"{path}:{key}" for key in state)
                elif state == "modified":  # "deleted" is an output the empty cache lacks
                    stale.setdefault(stage, []).append(path)
    return stale


@pytest.mark.slow
def test_dvc_lock_records_the_code_and_params_in_the_tree():
    stale = stale_stages()
    assert not stale, ("dvc.lock records other code or params than the tree for: "
                       + "; ".join(f"{s} ({', '.join(sorted(w))})" for s, w in sorted(stale.items()))
                       + ". Re-run them (attnzoo repro STAGE), or dvc commit STAGE where the change "
                         "provably cannot alter the result")
