"""Tests that kill mutants: behaviour of bob.py's scheduler, LoopGuard, CancelToken, action
parser and session stores that no other test pinned down, found by `bench/mutants.py`."""
from __future__ import annotations
