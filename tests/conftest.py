"""Shared test helpers: `wait_until`, and ports that block until the test lets them go.

    def test_x(hang):
        release = hang()                  # a threading.Event a blocking port waits on
        ...                               # at teardown every release is set, and the test
                                          # waits until bob's abandoned workers have drained
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bob.py etc., uninstalled too

import bob  # noqa: E402


def wait_until(predicate, timeout: float = 3.0) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds pass; return its last value.
    (Imported by the test modules: `from conftest import wait_until`.)"""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return predicate()
        time.sleep(0.002)
    return True


@pytest.fixture
def hang():
    """Factory of release events; all are set at teardown, then abandoned workers must end."""
    before = bob.abandoned_workers()
    events: list[threading.Event] = []

    def make() -> threading.Event:
        ev = threading.Event()
        events.append(ev)
        return ev

    yield make
    for ev in events:
        ev.set()
    assert wait_until(lambda: bob.abandoned_workers() <= before), "blocked workers never ended"
