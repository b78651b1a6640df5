"""The load and fault test (scripts/load_test.py), scaled down: a real server process on loopback
over the tiny repository of every model kind (tests/conftest.py `published`), with a small
admission queue so that 503s happen, under concurrent clients mixing valid requests to three
kinds with oversized, malformed and over-limit ones."""

from __future__ import annotations

import threading

import pytest

from tests.test_serving_production import start_server

pytestmark = pytest.mark.integration  # starts servers or processes

RSS_GROWTH_MIB = 200  # the server's RSS after the load may be at most this much above its RSS before


def _load_test_module():
    import load_test  # scripts/ (on sys.path: pyproject.toml `pythonpath`)

    return load_test


def test_mixed_load_with_bad_requests_never_gets_500_and_the_server_survives(published):
    load_test = _load_test_module()
    srv = start_server(published.repo, "--running", "4", "--max-queue", "4", "--max-body-mb", "0.5")
    # The server writes an access-log line per request to its stdout pipe: read it while the load
    # runs, or the pipe fills up and the server blocks (tests.test_serving_production.stop reads it
    # only at the end).
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(srv.proc.stdout), daemon=True)
    reader.start()
    try:
        summary = load_test.run_load(srv.url, clients=16, seconds=8, max_requests=20_000, seed=0, pid=srv.proc.pid,
                                     max_body_mb=0.5, grace_s=30, rss_growth_mib=RSS_GROWTH_MIB)
    finally:
        srv.proc.terminate()
        srv.proc.wait(timeout=30)
        reader.join(timeout=30)
    log = "".join(lines)
    report = load_test.markdown(summary)
    print(report)  # pytest -s: the numbers
    assert "Traceback" not in log, log[-3000:]

    cats = summary["categories"]
    assert summary["models"] == {"translation": "bahdanau", "recurrent": "ntm", "other": "act"}
    assert summary["requests"] <= 20_000 and summary["duration_s"] < 8 + 30 + 5, report
    assert summary["statuses"].get("500", 0) == 0 and summary["server_500s"] == 0, report
    for kind in ("translation", "recurrent", "other"):
        statuses = cats[f"valid:{kind}"]["statuses"]
        assert set(statuses) <= {"200", "503"}, (kind, statuses)
        assert statuses.get("200", 0) > 0, (kind, statuses)  # every kind really served
    assert sum(cats[f"valid:{k}"]["statuses"].get("503", 0) for k in ("translation", "recurrent", "other")) > 0, \
        report  # admission engaged
    assert all(c["503_without_retry_after"] == 0 and c["odd_bodies"] == 0 for c in cats.values()), report
    for cat, status in load_test.BAD_EXPECTED.items():
        # A body waits for the codec threads like any other: with their queue full it is 503 + Retry-After
        # (checked above) before anything could know it is malformed. Every other answer is the expected one.
        statuses = cats[cat]["statuses"]
        assert cats[cat]["requests"] > 0 and statuses.get(str(status), 0) > 0, (cat, cats[cat])
        assert set(statuses) <= {str(status), "503"}, (cat, cats[cat])
    accepted = summary["accepted"]
    assert accepted["count"] > 0 and 0 < accepted["p50_ms"] <= accepted["p99_ms"]
    assert summary["live_after"]
    rss = summary["rss_mib"]
    assert rss["before"] > 0 and rss["peak"] >= rss["before"] and rss["after"] - rss["before"] < RSS_GROWTH_MIB, rss
    assert summary["failures"] == [], summary["failures"]
