"""task_code@<task>: the files a task's code is made of, the list its models' stages depend on."""

from __future__ import annotations

import shutil

from pipeline.config import ROOT
from pipeline.stages.task_code import task_code
from pipeline.tasks import task_names


def test_a_task_lists_its_module_what_it_builds_on_and_what_its_imports_reach():
    runs, prepare_only = task_code("convex_hull", "convex_hull")
    files = set(runs["files"])
    assert {"pipeline/tasks/convex_hull.py", "pipeline/tasks/common/pointer.py", "pipeline/tasks/__init__.py",
            "pipeline/plots.py", "pipeline/graphs.py", "serving/decode.py"} <= files
    assert "pipeline/tasks/sort.py" not in files and prepare_only["files"] == {}  # a sibling is not its code
    assert "pipeline/config.py" not in files  # the registry's like-lookup is not the task's code
    # A folder's subfolders are prepare's: the corpus builder retrains nothing unless the data changes.
    runs, prepare_only = task_code("translation_de_en", "translation_de_en")
    assert "pipeline/tasks/translation_de_en/__init__.py" in runs["files"]
    assert not any("/corpus/" in f for f in runs["files"])
    assert {"pipeline/tasks/translation_de_en/corpus/build.py", "pipeline/files.py"} <= set(prepare_only["files"])
    assert not set(runs["files"]) & set(prepare_only["files"])
    # A `like:` task lists the code it runs, under its own name.
    like, _ = task_code("fr_en", "translation_de_en")
    assert (like["task"], like["code"], like["files"]) == ("fr_en", "translation_de_en", runs["files"])


def test_an_edit_to_one_task_changes_its_list_alone(tmp_path):
    for package in ("models", "pipeline", "serving"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    before = {t: task_code(t, t, tmp_path) for t in task_names()}
    with (tmp_path / "pipeline/tasks/sort.py").open("a") as f:
        f.write("# a comment\n")
    after = {t: task_code(t, t, tmp_path) for t in task_names()}
    assert sorted(t for t in before if before[t] != after[t]) == ["sort"]
    with (tmp_path / "pipeline/tasks/common/pointer.py").open("a") as f:
        f.write("# a comment\n")
    assert sorted(t for t in after if after[t] != task_code(t, t, tmp_path)) == ["convex_hull", "sort"]

