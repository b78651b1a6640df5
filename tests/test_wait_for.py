"""tests.conftest.wait_for, the one polling loop the process tests share."""

from __future__ import annotations

from tests.conftest import wait_for


def counting(answers):
    """A check that returns ``answers`` in turn (the last one from then on) and counts its calls."""
    calls = []

    def check():
        calls.append(1)
        return answers[min(len(calls), len(answers)) - 1]

    return check, calls


def test_a_timeout_of_zero_still_looks_once():
    check, calls = counting([["Traceback"]])
    assert wait_for(check, 0) == ["Traceback"]
    assert len(calls) == 1
    check, calls = counting([[]])
    assert wait_for(check, 0) is None
    assert len(calls) == 1


def test_the_first_truthy_answer_is_returned_and_nothing_after_it_runs():
    check, calls = counting([None, 0, "", "pid 7,", "never asked"])
    assert wait_for(check, 5, every_s=0.001) == "pid 7,"
    assert len(calls) == 4


def test_a_check_that_never_holds_is_asked_until_the_deadline_then_once_more():
    check, calls = counting([False])
    assert wait_for(check, 0.05, every_s=0.01) is None
    # one call before each of the ~5 sleeps and one after the last: never fewer than two
    assert 2 <= len(calls) <= 7
