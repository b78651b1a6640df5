"""The scripts in scripts/ end a mistake their user can fix with one line ``error: ...`` naming the fix and
exit status 2 (scripts/cli_errors.py), as the stages do: an unknown entry, a run or report that is not
there, arguments that cannot go together, a server that does not answer, a missing optional package."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import cli_errors
import pytest

from tests.conftest import ROOT
from tests.ports import free_port


def one_line_error(capsys, main, *args, progress: str = "") -> str:
    """What ``cli_errors.run`` prints for ``main(*args)``, asserting it is one ``error:`` line (after the
    ``progress`` lines starting so, if any) and exit 2."""
    with pytest.raises(SystemExit) as stop:
        cli_errors.run(lambda: main(*args))
    assert stop.value.code == 2
    *before, last = capsys.readouterr().err.splitlines() or [""]
    assert last.startswith("error: ") and all(progress and line.startswith(progress) for line in before), before
    return last[len("error: "):]


def with_argv(monkeypatch, module, *argv):
    """``module.main`` for a script whose main reads sys.argv."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    return module.main


def test_run_passes_a_number_on_as_the_exit_status_and_fixable_errors_as_one_line(capsys):
    from pipeline.config import UserError

    for returned, code in ((None, 0), (0, 0), (1, 1), ({"rows": 3}, 0)):
        with pytest.raises(SystemExit) as stop:
            cli_errors.run(lambda r=returned: r)
        assert stop.value.code == code
    assert one_line_error(capsys, lambda: (_ for _ in ()).throw(UserError("run `dvc repro prepare@x` first"))) \
        == "run `dvc repro prepare@x` first"

    def interrupted():
        raise KeyboardInterrupt
    with pytest.raises(SystemExit) as stop:
        cli_errors.run(interrupted)
    assert stop.value.code == 130 and capsys.readouterr().err == "interrupted\n"
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        cli_errors.run(lambda: 1 / 0)


def test_every_script_ends_through_cli_errors():
    """Each script's ``if __name__ == "__main__":`` block is ``cli_errors.run(main)`` and nothing else."""
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        tree = ast.parse(path.read_text())
        blocks = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        if path.name == "cli_errors.py":
            assert not blocks
            continue
        assert [ast.unparse(b) for b in blocks] == ["if __name__ == '__main__':\n    cli_errors.run(main)"], path


# What a message of ``raise SystemExit("...")`` (exit 1) may report: a run the script started that failed,
# with its output, not a mistake its user can fix (those are ``ScriptError``, exit 2, docs/troubleshooting.md).
RUN_FAILED = ("did not become ready", "failed", "exited with", "the server's error", "the generated block differs")


def exit_1_messages(source: str) -> list[str]:
    """The literal text of each ``raise SystemExit(<string>)`` or ``sys.exit(<string>)`` in ``source`` (an
    f-string's fixed parts)."""
    found = []
    for call in ast.walk(ast.parse(source)):
        if not (isinstance(call, ast.Call) and ast.unparse(call.func) in ("SystemExit", "sys.exit") and call.args):
            continue
        parts = call.args[0].values if isinstance(call.args[0], ast.JoinedStr) else [call.args[0]]
        if all(isinstance(p, ast.Constant | ast.FormattedValue) for p in parts) and \
                any(isinstance(p, ast.Constant) and isinstance(p.value, str) for p in parts):
            found.append("".join(p.value for p in parts if isinstance(p, ast.Constant)))
    return found


def test_a_script_exits_1_only_for_a_run_that_failed():
    """A user's mistake in a script is a ``ScriptError`` (exit 2); ``SystemExit`` with a message is left for a
    run the script started that failed. A planted mistake of the old form is found."""
    assert exit_1_messages('raise SystemExit(f"error: no peak figures at {p}")') == ["error: no peak figures at "]
    assert exit_1_messages('sys.exit(f"no data in {d}")') == ["no data in "]
    assert exit_1_messages('raise SystemExit(1)\nraise ScriptError("x")\nraise SystemExit(code)') == []
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        for message in exit_1_messages(path.read_text()):
            assert any(r in message for r in RUN_FAILED), f"{path.name}: {message!r} is a ScriptError"


def test_an_unknown_entry_is_named_with_where_to_find_the_entries(capsys, monkeypatch):
    import bench_inference
    import bench_train
    import length_gap
    import loop_steps
    import train_efficiency

    want = "not params.yaml entries: nosuch (`attnzoo list` shows them)"
    assert one_line_error(capsys, with_argv(monkeypatch, bench_train, "--model", "nosuch")) == want
    assert one_line_error(capsys, train_efficiency.main, ["--entries", "ntm", "nosuch"]) == want
    assert one_line_error(capsys, loop_steps.main, ["nosuch"]) == want
    assert one_line_error(capsys, bench_inference.main, ["act_parity", "nosuch"]) == want
    assert one_line_error(capsys, with_argv(monkeypatch, length_gap, "bahdanau", "nosuch")) == want


def test_train_efficiency_refuses_arguments_that_cannot_work_before_preparing_anything(capsys, tmp_path):
    import train_efficiency

    assert one_line_error(capsys, train_efficiency.main, ["--learn-steps", "20"]) == \
        "--learn-steps updates the entries it is given: add --entries NAME ..."
    assert one_line_error(capsys, train_efficiency.main, ["--baseline-code", str(tmp_path)]) == \
        f"--baseline-code {tmp_path} is not a checkout (no params.yaml); make one with `git worktree add DIR COMMIT`"
    out = tmp_path / "figures.json"
    out.write_text(json.dumps({"entries": {"ntm": {}}}))
    assert one_line_error(capsys, train_efficiency.main, ["--budget-run", str(tmp_path), "--entries", "ntm_recall",
                                                          "--out", str(out)]) == \
        f"ntm_recall: not in {out}; measure first with `python scripts/train_efficiency.py --entries ntm_recall`"
    assert not (tmp_path / "data").exists()
    # --learn-steps: both refused before the entry's task is prepared in --work
    least = 1 + train_efficiency.warm_up_steps(1)
    work = ["--work", str(tmp_path / "work"), "--out", str(out)]
    assert one_line_error(capsys, train_efficiency.main, ["--learn-steps", str(least - 1), "--entries", "ntm",
                                                          *work]) == \
        f"--learn-steps counts the warm-up too: give at least {least}"
    assert one_line_error(capsys, train_efficiency.main, ["--learn-steps", "20", "--entries", "ntm_recall", *work]) \
        == f"ntm_recall: not in {out}; measure first with `python scripts/train_efficiency.py --entries ntm_recall`"
    assert not (tmp_path / "work").exists()
    base = tmp_path / "base"  # a checkout whose ntm was never trained
    base.mkdir()
    (base / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    assert one_line_error(capsys, train_efficiency.main, ["--baseline-code", str(base), "--entries", "ntm", "--work",
                                                          str(tmp_path / "work"), "--out", str(out)],
                          progress="preparing copy (small)") == \
        f"the baseline's runs are not there: {base / 'runs' / 'ntm'}; train them in that checkout first " \
        "(`attnzoo repro train@NAME`)"


def test_a_server_script_names_the_url_nobody_answers_on_and_its_option_forms(capsys, monkeypatch):
    import bench_serving
    import load_test

    url = f"http://127.0.0.1:{free_port()}"
    said = one_line_error(capsys, load_test.main, ["--url", url])
    assert said.startswith(f"no server answers at {url} (") and said.endswith(
        "start one (`attnzoo serve`), or pass --repository DIR for this script to start it"), said
    assert one_line_error(capsys, load_test.main, ["--url", url, "--models", "translation"]) == \
        "--models 'translation': give kind=model,... with kinds translation, recurrent, other"
    assert load_test.parse_models("translation=luong_dot,other=act") == {"translation": "luong_dot", "other": "act"}
    main = with_argv(monkeypatch, bench_serving, "--models", "bahdanau,pointer_sort", "--skip-inprocess")
    assert one_line_error(capsys, main) == "--models pointer_sort: the rows are bahdanau.encoder, bahdanau"


def test_serving_parity_names_models_it_cannot_check_and_never_passes_on_nothing(capsys, monkeypatch, tmp_path):
    import serving_parity

    monkeypatch.setattr(serving_parity, "ROOT", tmp_path)
    assert one_line_error(capsys, serving_parity.chosen, ["ntm", "act_parity"]) == \
        f"--models act_parity: this script checks {', '.join(serving_parity.CHECKED)}"
    assert one_line_error(capsys, serving_parity.chosen, ["ntm"]) == \
        "not in model_repository/: ntm; publish them first (`attnzoo repro publish@ntm`)"
    assert one_line_error(capsys, serving_parity.chosen, None).startswith("none of bahdanau, ")
    (tmp_path / "model_repository" / "ntm").mkdir(parents=True)
    assert serving_parity.chosen(None) == ["ntm"] and serving_parity.chosen(["ntm"]) == ["ntm"]
    assert "bahdanau: skipped (not in model_repository/)" in capsys.readouterr().out


def test_the_peer_scripts_name_the_file_a_subcommand_needs(capsys, tmp_path):
    """scripts/peers: a subcommand whose input is not there names it and what makes it (was a traceback)."""
    import export_data
    import peers

    gone = tmp_path / "gone"
    assert one_line_error(capsys, peers.main, ["onmt-pick", str(gone), "20"]) == \
        f"{gone}/train.log is not there: run scripts/peers/opennmt.sh first"
    assert one_line_error(capsys, peers.main, ["score", str(gone)]) == \
        f"{gone} is not there: give a file of translations, a line each"
    assert one_line_error(capsys, peers.main, ["attnzoo-progress", str(gone)]) == \
        f"{gone}/trainer.pt is not there: give a run's checkpoint/last (scripts/peers/attnzoo.sh's " \
        "WORKDIR/at_<MINUTES>min)"
    assert one_line_error(capsys, peers.main, ["ct2-bleu", str(gone)]).startswith(f"{gone}/model.bin is not there")
    assert one_line_error(capsys, export_data.main, [str(tmp_path / "out"), "--data", str(gone)]) == \
        f"no prepared data in {gone}: run `dvc repro prepare@translation_de_en` first"
    (tmp_path / "train.log").write_text("no step reports yet\n")
    assert one_line_error(capsys, peers.main, ["onmt-pick", str(tmp_path), "20"]) == \
        f"no training steps in {tmp_path}/train.log: run scripts/peers/opennmt.sh first"


def test_missing_inputs_name_what_makes_them(capsys, monkeypatch, tmp_path):
    import gpu_check
    import grpc_parity
    import playground_shot
    import readme_tables
    import transformer_recipe

    gone = tmp_path / "gone.json"
    assert one_line_error(capsys, gpu_check.main, ["--recount", str(gone)]) == \
        f"--recount {gone}: no such report (docs/gpu_check/*.json are)"
    assert one_line_error(capsys, readme_tables.run_file, tmp_path, "ntm", "metrics.json") == \
        "runs/ntm/metrics.json is missing: run `attnzoo repro evaluate@ntm` first"
    assert one_line_error(capsys, transformer_recipe.main, ["--work", str(tmp_path), "--recipe-run", str(tmp_path)]) \
        == f"--recipe-run {tmp_path} holds no train_summary.json: give a finished run (attnzoo train transformer " \
           "--out DIR)"
    assert one_line_error(capsys, transformer_recipe.main, ["--work", str(tmp_path), "--only", "dropout 0.1",
                                                            "--json", str(gone)]) == \
        "--json keeps a comparison against the recipe's row: add recipe to --only"
    assert one_line_error(capsys, playground_shot.main, ["--input", str(gone), "--out", str(tmp_path / "a.png")]) == \
        f"--input {gone}: no such file"
    copy = ROOT / "examples" / "copy.json"
    assert one_line_error(capsys, playground_shot.main, ["--input", str(copy), "--out", "a.png"]) == \
        f"--input {copy}: the page is filled from examples/table_qa.json or a text file of one sentence, not this " \
        "example"
    assert one_line_error(capsys, playground_shot.main, ["--repository", str(tmp_path), "--out", "a.png"]) == \
        f"{tmp_path / 'neural_programmer'}: neural_programmer is not published there; run " \
        "`attnzoo repro publish@neural_programmer` or pass --repository DIR"
    main = with_argv(monkeypatch, grpc_parity, "--repository", str(tmp_path / "none"))
    assert one_line_error(capsys, main) == \
        f"--repository {tmp_path / 'none'}: no such folder; publish first (`attnzoo repro publish@NAME`)"


def test_a_missing_optional_package_names_its_install(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("psutil") else real(name))
    assert one_line_error(capsys, cli_errors.need_module, "psutil") == \
        "this script needs psutil: pip install 'psutil' (or the dev extra: pip install -e '.[dev]')"
    cli_errors.need_module("tritonclient.grpc")  # installed by the dev extra: no error


@pytest.mark.integration  # a process per script, as a user runs it
@pytest.mark.parametrize("argv, said", [
    (["scripts/bench_train.py", "--model", "nosuch"], "not params.yaml entries: nosuch"),
    (["scripts/loop_steps.py", "nosuch"], "not params.yaml entries: nosuch"),
    (["scripts/load_test.py", "--url", "http://127.0.0.1:9", "--models", "x"], "--models 'x': give kind=model"),
])
def test_a_script_run_as_a_user_runs_it_prints_one_line_and_exits_2(argv, said):
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.startswith(f"error: {said}") and done.stderr.count("\n") == 1, done.stderr
