"""What one test leaves in the test process must not reach the next one on the same worker."""

from __future__ import annotations

# Imported once, here: pytester forgets the modules an inner run imports, and a second import of MLflow in one
# process made the next inner session fail to start (no package metadata found for pluggy).
import mlflow  # noqa: F401

pytest_plugins = ["pytester"]

INNER = '''
import mlflow


def test_points_mlflow_at_its_server(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    mlflow.set_tracking_uri("http://127.0.0.1:9")  # as pipeline.tracking.setup does, never undone


def test_a_later_test_follows_its_own_variable(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///later.db")
    assert mlflow.get_tracking_uri() == "sqlite:///later.db"


def test_and_without_one_the_variable_is_as_the_session_had_it():
    import os

    assert os.environ.get("MLFLOW_TRACKING_URI") == "sqlite:///outer.db"
'''


def test_a_tracking_uri_one_test_set_does_not_outrank_the_next_tests_variable(pytester, monkeypatch):
    # The failure this guards against: a module's test ran tracking.setup against its own MLflow server; a test of
    # another module on the same worker then reached that server, stopped by then, through MlflowClient().
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///outer.db")
    pytester.makeconftest("from tests.conftest import _no_tracking_uri_left_behind  # noqa: F401\n")
    pytester.makepyfile(INNER)
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=3)


def test_without_the_fixture_the_uri_leaks_so_the_check_above_can_fail(pytester, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///outer.db")
    pytester.makepyfile(INNER)
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=2, failed=1)
