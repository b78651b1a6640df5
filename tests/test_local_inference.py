"""Offline inference: ``attnzoo predict --local`` and ``attnzoo translate --local`` answer in
process, from the model repository, exactly what the server answers over HTTP."""

from __future__ import annotations

import numpy as np
import pytest

from serving.client import LocalClient, ServerError
from tests.test_cli import cli
from tests.test_serving import TEXTS, server  # noqa: F401
from tests.test_serving_production import _requests, _same


@pytest.mark.integration
def test_local_answers_equal_the_servers_for_every_kind(server):  # noqa: F811
    local = LocalClient(server.published.repo)
    for name, feeds, params in _requests():
        _same(local.infer(name, feeds, parameters=params), server.client.infer(name, feeds, parameters=params))
    for name in ("bahdanau", "ntm", "act", "pointer"):
        remote = server.client.model_metadata(name)
        remote.pop("parameters")  # the server's extras: version policy, kind, limits
        assert local.model_metadata(name) == remote, name
    # the server's version policy and request checks, as the same errors
    with pytest.raises(ServerError, match="has no version '9'") as err:
        local.infer("ntm", {"x": np.zeros((1, 3, 5), np.float32)}, version="9")
    assert err.value.status == 404
    with pytest.raises(ServerError, match="unknown model 'nope'"):
        local.model_metadata("nope")
    with pytest.raises(ServerError) as err:
        local.infer("ntm", {"x": np.zeros((1, 3, 4), np.float32)})  # 4 bits where the model takes 5
    assert err.value.status == 400


@pytest.mark.integration
def test_predict_and_translate_commands_run_locally_as_on_the_server(server, tmp_path):  # noqa: F811
    repo = str(server.published.repo)
    for mode in ("greedy", "beam"):
        over_http = cli("predict", "bahdanau", TEXTS[0], "--url", server.url, "--decode", mode)
        here = cli("predict", "bahdanau", TEXTS[0], "--local", "--repository", repo, "--decode", mode)
        assert over_http.returncode == here.returncode == 0, here.stderr
        assert here.stdout == over_http.stdout and here.stdout.strip()
    source = tmp_path / "de.txt"
    source.write_text("\n".join([TEXTS[0], "", *TEXTS[1:]]) + "\n", encoding="utf-8")
    outs = {}
    for where in (["--url", server.url], ["--local", "--repository", repo]):
        target = tmp_path / f"en{len(outs)}.txt"
        proc = cli("translate", "-i", str(source), "-o", str(target), "--model", "bahdanau", "--batch", "2", *where)
        assert proc.returncode == 0, proc.stderr
        outs[where[0]] = target.read_text(encoding="utf-8").splitlines()
    assert outs["--url"] == outs["--local"]
    assert len(outs["--local"]) == len(TEXTS) + 1 and outs["--local"][1] == ""  # line for line, blanks kept
    want = [r["translation"] for r in server.client.translate("bahdanau", list(TEXTS))]
    assert [outs["--local"][0], *outs["--local"][2:]] == want


@pytest.mark.integration
def test_predict_answers_several_inputs_in_order_each_after_its_input(server, tmp_path):  # noqa: F811
    repo = str(server.published.repo)
    proc = cli("predict", "bahdanau", *TEXTS[:2], "--local", "--repository", repo, "--decode", "greedy")
    assert proc.returncode == 0, proc.stderr
    want = [r["translation"] for r in server.client.translate("bahdanau", list(TEXTS[:2]), "greedy")]
    assert proc.stdout.splitlines() == [f"{text}\t{answer}" for text, answer in zip(TEXTS[:2], want)]
    shape = tuple(server.client.model_metadata("ram")["inputs"][0]["shape"][1:])
    images = []
    for seed in (0, 1):
        images.append(tmp_path / f"digit{seed}.npy")
        np.save(images[-1], np.random.default_rng(seed).random(shape, dtype=np.float32))
    proc = cli("predict", "ram", *map(str, images), "--url", server.url)
    assert proc.returncode == 0, proc.stderr
    preds = [int(server.client.infer("ram", {"image": np.load(path)[None]})["pred"][0]) for path in images]
    assert proc.stdout.splitlines() == [f"{path}\t{pred}" for path, pred in zip(images, preds)]


@pytest.mark.integration
def test_local_errors_are_one_sentence_and_write_nothing(tmp_path):
    proc = cli("predict", "bahdanau", "Hallo", "--local", "--repository", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: unknown model 'bahdanau'; {tmp_path} holds no models " \
                                  "(run `dvc repro` to publish, or pass --repository DIR)"
    source = tmp_path / "de.txt"
    source.write_text("Hallo\n")
    target = tmp_path / "en.txt"
    proc = cli("translate", "-i", str(source), "-o", str(target), "--local", "--repository", str(tmp_path))
    assert proc.returncode == 2 and "nothing was written" in proc.stderr and "Traceback" not in proc.stderr
    assert not target.exists()
    proc = cli("translate", "-i", str(tmp_path / "missing.txt"), "-o", str(target))
    assert proc.returncode != 0 and proc.stderr.startswith("error: cannot read") and not target.exists()


@pytest.mark.integration
def test_translate_writes_the_n_best_hypotheses_with_their_scores(server, tmp_path):  # noqa: F811
    source = tmp_path / "de.txt"
    source.write_text("\n".join([TEXTS[0], "", TEXTS[1]]) + "\n", encoding="utf-8")
    target = tmp_path / "nbest.txt"
    proc = cli("translate", "-i", str(source), "-o", str(target), "--nbest", "3", "--local", "--repository",
               str(server.published.repo))
    assert proc.returncode == 0, proc.stderr
    want = server.client.translate("bahdanau", [TEXTS[0], TEXTS[1]], nbest=3)
    # Moses' n-best format, lines numbered from 0 (the blank line 1 has none), best first
    assert target.read_text(encoding="utf-8").splitlines() == [
        f"{n} ||| {hyp} ||| {score:.4f}" for n, r in zip((0, 2), want) for hyp, score in r["nbest"]]
    for r in want:
        hyps = [hyp for hyp, _ in r["nbest"]]
        assert 1 < len(hyps) <= 3 and len(set(hyps)) == len(hyps)  # distinct hypotheses, at most the beam
        assert hyps[0] == r["translation"]  # the best hypothesis is the translation
    assert server.client.translate("bahdanau", [TEXTS[0]])[0]["nbest"] == want[0]["nbest"][:1]
    with pytest.raises(ServerError, match="'nbest' above 1 needs decode 'beam'"):
        server.client.infer("bahdanau", {"text": [TEXTS[0]]}, parameters={"decode": "greedy", "nbest": 2})
    with pytest.raises(ServerError, match="'nbest' must be an integer from 1 to the beam size"):
        server.client.infer("bahdanau", {"text": [TEXTS[0]]}, parameters={"nbest": 99})
    proc = cli("translate", "-i", str(source), "-o", str(target), "--nbest", "2", "--decode", "greedy", "--local")
    assert proc.returncode != 0 and proc.stderr.strip() == \
        "error: --nbest must be at least 1, and above 1 only with --decode beam"
