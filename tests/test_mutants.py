"""Tests that kill mutants: behaviour of bob.py's CancelToken, LoopGuard, scheduler, action
parser and session stores that no other test pinned down, each found by `bench/mutants.py`
(a change to one line of bob.py that the rest of the suite did not notice).

Real parts only: AgentRuntime with ScriptedLlm and FunctionTools, real stores on tmp_path.
The helpers come from test_core.

Sections: 1. CancelToken  2. Guards  3. Scheduler  4. Actions  5. Stores and sinks
"""
from __future__ import annotations

import logging

from bob import AgentRequest, CancelToken, FinishReason, GuardReason
from test_core import Counter, agent, assert_tripped, batch


# ---- 1. CancelToken -----------------------------------------------------------------------------

def test_on_cancel_on_a_cancelled_token_runs_the_callback_at_once():
    token, called = CancelToken(), []
    token.cancel()
    remove = token.on_cancel(lambda: called.append("now"))
    remove()                                   # nothing left to remove, and no error
    assert called == ["now"]


def test_a_removed_callback_is_not_run_at_cancel_and_the_others_are():
    token, called = CancelToken(), []
    remove = token.on_cancel(lambda: called.append("removed"))
    token.on_cancel(lambda: called.append("kept"))
    remove()
    token.cancel()
    remove()                                   # after cancel too: a no-op, not an error
    assert called == ["kept"]


def test_wait_says_whether_the_token_was_cancelled():
    token = CancelToken()
    assert token.wait(0) is False
    token.cancel()
    assert token.wait(0) is True and token.wait() is True


# ---- 2. Guards ----------------------------------------------------------------------------------

def test_refused_oversized_batches_count_toward_max_consecutive_errors():
    c = Counter()
    two = [("a", "echo", {"x": 1}), ("b", "echo", {"x": 2})]
    rt = agent([batch(*two), batch(*two), "never asked"], mode="native", tools=c.tools(),
               max_parallel_tools=1, max_consecutive_errors=2)
    r = rt.run(AgentRequest("go"))
    assert_tripped(r, GuardReason.MAX_CONSECUTIVE_ERRORS, "max_consecutive_errors=2")
    assert (r.steps, c.calls) == (2, [])
