"""Sixth round: a turn whose time ran out replays the same, wherever the time ran out.

A recorded turn ran out of time while it waited (for the model, a tool, the approver) or between
two port calls (a check before an LLM call or a batch found the deadline passed). A replay
answers at once, so it must end the turn's time where the recording did: the replay fires the
turn's own token there, and a turn whose own token fires (not the caller's) is out of time.
Sections: 1. Helpers  2. Where the time ran out  3. The turn's own token
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import bob
from bob import (AgentRequest, AgentRuntime, Approval, FinishReason, FunctionTools, GuardReason,
                 ScriptedLlm, ToolResult, TurnPolicy)
from test_replay import record
from test_trace import add, calls


# ---- 1. Helpers ---------------------------------------------------------------------------------

def held_at(kind: str, timeout_ms: int):
    """A cancel_on for test_replay.record that never cancels: it holds the loop's thread at the
    first event of `kind` until the turn's deadline has passed (a slow sink, a slow machine)."""
    started = []

    def hold(event) -> bool:
        if event.kind == "turn_started":
            started.append(time.monotonic())
        elif event.kind == kind and started:
            left = started[0] + timeout_ms / 1000 - time.monotonic()
            threading.Event().wait(max(0.0, left) + 0.05)   # past the deadline, whatever it is
            started.clear()
        return False
    return hold


def replayed_at_once(trace, bound_s: float = 0.5, **kw) -> bob.ReplayReport:
    """The report of replay(trace), which must come before bound_s (not waiting out a recorded
    deadline)."""
    t0 = time.monotonic()
    report = bob.replay(trace, **kw)
    assert time.monotonic() - t0 < bound_s, f"replay took {time.monotonic() - t0:.2f} s"
    return report


def replays_at_once(path, bound_s: float = 0.25) -> bob.ReplayReport:
    """replayed_at_once, and the same as recorded."""
    report = replayed_at_once(path, bound_s)
    assert report.ok, str(report)
    return report


class GivingUp(FunctionTools):
    """Tools whose call fires the token it was given (gives the turn up), then answers."""

    def call_tool(self, call, timeout_s, cancel=None):
        cancel.cancel()
        return ToolResult(call.id, call.name, "gave up")


def ran_out_of_time(rt: AgentRuntime, request: AgentRequest, within_s: float):
    """rt.run(request), which must end TURN_TIMEOUT within `within_s` (not at turn_timeout_ms)."""
    t0 = time.monotonic()
    r = rt.run(request)
    assert time.monotonic() - t0 < within_s
    assert (r.finish_reason, r.guard_reason) == (FinishReason.GUARD_EXCEEDED,
                                                 GuardReason.TURN_TIMEOUT)
    return r


# ---- 2. Where the time ran out ------------------------------------------------------------------

NOT_RUN = "not run: the turn took longer than"
HELD = ["action_parsed", "approval_decided", "tool_call_completed"]


def held_between_port_calls(path, held: str) -> list:
    approving = held == "approval_decided"
    asking = {"ask_tools": ["add"], "approver": lambda call: Approval(True)} if approving else {}
    return record(path, [calls(("c1", "add", {"a": 1, "b": 2})), "3"], ["sum"],
                  policy=TurnPolicy(turn_timeout_ms=300), cancel_on=held_at(held, 300), **asking)


@pytest.fixture(scope="module")
def held_recordings(tmp_path_factory):
    """The three recordings below, each held (idle) until its 300 ms deadline had passed, run
    side by side in threads, all ended before any test goes on (nothing runs behind a replay's
    time bound); a test takes its own: path, results = held_recordings(held)."""
    paths = {held: tmp_path_factory.mktemp("held") / "t.jsonl" for held in HELD}
    with ThreadPoolExecutor(len(HELD)) as pool:
        done = {held: pool.submit(held_between_port_calls, paths[held], held) for held in HELD}
    return lambda held: (paths[held], done[held].result())


@pytest.mark.parametrize("held, last", [
    ("action_parsed", NOT_RUN),             # the batch's check found the time passed
    ("approval_decided", NOT_RUN),          # so, after the approver answered
    ("tool_call_completed", "3"),           # the check before the next LLM call
], ids=["before a batch", "after the approver answered", "after a tool answered"])
def test_time_that_ran_out_between_port_calls_replays_the_same(held_recordings, held, last):
    path, [r] = held_recordings(held)
    assert r.guard_reason is GuardReason.TURN_TIMEOUT
    assert r.history[-1].content.startswith(last)   # "3": the next LLM call never came
    replays_at_once(path)


def test_a_resumed_turn_whose_approver_never_answered_replays_the_same(tmp_path, hang):
    """No request comes before the approver in a resumed turn: the replay still ends the
    turn's time at once (replay()'s sink reaches the turn through its runtime)."""
    path, release = tmp_path / "t.jsonl", hang()
    [paused] = record(path, [calls(("c1", "add", {"a": 1, "b": 2}))], ["sum"],
                      ask_tools=["add"])
    assert paused.finish_reason is FinishReason.NEEDS_APPROVAL
    rt = AgentRuntime(ScriptedLlm(["3"]), FunctionTools([add]), ask_tools=["add"],
                      approver=lambda call: release.wait(10) and Approval(True),
                      policy=TurnPolicy(turn_timeout_ms=300),
                      events=bob.JsonlEventSink(path),
                      store=bob.InMemorySessionStore())
    rt.store.save("s1", bob.SessionState(paused.history, version=1, paused={
        "guard": {}, "input_index": 0, "approvals": {}}))
    r = rt.run(AgentRequest(None, "s1"))
    assert r.guard_reason is GuardReason.TURN_TIMEOUT
    replays_at_once(path)


def test_the_two_turn_timeouts_recorded_while_waiting_still_replay(tmp_path, hang):
    """While the model answered (the recorded request has no reply) and, unchanged, a guard
    other than the deadline: replayed as recorded."""
    path, release = tmp_path / "t.jsonl", hang()

    def slow(req, cancel):
        release.wait(10)
        return "late"

    record(path, [slow], ["sum"], policy=TurnPolicy(turn_timeout_ms=200))
    report = replays_at_once(path)
    assert "the model did not answer" in (tmp_path / "t.jsonl").read_text()
    steps = tmp_path / "s.jsonl"
    [r] = record(steps, [calls(("c1", "add", {"a": 1, "b": 2}))] * 3, ["sum"],
                 policy=TurnPolicy(max_steps=2, max_repeated_batches=5))
    assert r.guard_reason is GuardReason.MAX_STEPS
    assert bob.replay(steps).ok and report.ok


# ---- 3. The turn's own token --------------------------------------------------------------------

def test_a_port_that_fires_the_token_it_was_given_ends_the_turns_time():
    """The token a port gets is the turn's own: a port that fires it gives the turn up, as a
    replay does where the recorded time ran out; the caller's cancel stays CANCELLED."""

    rt = AgentRuntime(ScriptedLlm([calls(("c1", "add", {"a": 1, "b": 2})), "never asked"]),
                      GivingUp([add]), policy=TurnPolicy(turn_timeout_ms=60_000),
                      action_mode="native")
    r = ran_out_of_time(rt, AgentRequest("sum", "s1"), 1.0)
    assert r.content == "Stopped: the turn took longer than turn_timeout_ms=60000."
    assert r.history[-1].content == "gave up" and r.steps == 1


def test_a_model_error_that_comes_as_the_turns_time_runs_out_is_the_turns_timeout():
    """The adapter's own clock ends a request at the turn's deadline too ("no answer in time"):
    whichever sees the deadline first, the turn ends TURN_TIMEOUT, not with the adapter's error
    (tests/test_cli.py's exit-3 test saw exit 1 in about one full run of eleven). Deterministic
    here: an inline port fails only once the deadline has passed."""

    class LateFailure:
        _answers_inline = True   # on the loop's thread: the wait cannot see the deadline first

        def complete(self, req, cancel, on_delta=None):
            threading.Event().wait(max(0.0, req.deadline - time.monotonic()) + 0.05)
            raise bob.LlmError("http://127.0.0.1:9/v1 gave no answer in time")

    rt = AgentRuntime(LateFailure(), policy=TurnPolicy(turn_timeout_ms=200))
    r = ran_out_of_time(rt, AgentRequest("hi", "s1"), 2.0)
    assert r.content == "Stopped: the model did not answer within turn_timeout_ms=200."


# ---- 4. The CLI's streamed answer ----------------------------------------------------------------

def test_a_streamed_json_answer_prints_exactly_its_content_however_it_is_cut(capsys):
    """bob_cli's view decodes a json-mode final as it streams in. Each piece now decodes only
    what it adds (decoding all so far at each piece took 39 s of CPU for a 100 KB answer in
    4-char pieces, on the model's thread); cut anywhere (inside an escape, between the two
    escapes of a surrogate pair, next to a literal one) it prints the content once, in order."""
    import random

    import bob_cli
    content = 'a "quoted" \\ line\nnext\t\u00e9 \U0001F600 end ' * 40   # (a pair in escapes)
    raws = [json.dumps({"type": "final", "content": content}),                  # \\u escapes
            json.dumps({"type": "final", "content": content}, ensure_ascii=False),
            '```json\n{"type": "final", "content": "' + '\\ud83d\\ude00 x' * 50 + '"}```']
    rng = random.Random(7)
    for raw in raws:
        want = json.loads(raw.strip("`").removeprefix("json\n"))["content"]
        for _ in range(5):
            view = bob_cli._TurnView()
            view.begin()
            at = 0
            while at < len(raw):
                n = rng.choice([1, 2, 3, 4, 7, 40])
                view.emit(bob.AgentEvent("text_delta", "s1", 1, {"text": raw[at:at + n]}, 0.0))
                at += n
            assert capsys.readouterr().out == want and view.shown == want
