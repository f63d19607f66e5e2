"""Attacks on replay ports that answer on the loop's thread (bob.py section 9 `_Worker(fn, wake,
port)`, section 12 `_Replay`): _NoAnswer waited on like a hung port, the interrupted call that
fires the cancel at once, the digest the runtime told the port (`_Replay.told`), new events made
JSON only when they differ.

A test marked xfail(strict=True) shows a break still open: the lead flips it with the fix.
Sections: 1. Helpers  2. Breaks  3. Promises that hold
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import bob
from bob import (AgentRequest, AgentRuntime, Approval, CancelToken, FinishReason,
                 FunctionTools, GuardReason, JsonlEventSink, ReplayLlm, ReplayTools,
                 ScriptedLlm, TraceError, TurnPolicy)
from conftest import REPO, cancel_once_entered
from test_replay import record
from test_replay_record import record_a_turn_timeout
from test_trace import add, calls


# ---- 1. Helpers ---------------------------------------------------------------------------------

def summed(path: Path) -> list:
    """One turn: a tool call, then the answer."""
    return record(path, [calls(("c1", "add", {"a": 1, "b": 2})), "3"], ["sum"])


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines()


def write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")


def kinds(lines: list[str]) -> list[str]:
    return [json.loads(line)["kind"] for line in lines]


# ---- 2. Breaks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("stop", ["cancel", "tool_timeout"])
def test_a_replay_port_subclass_that_blocks_still_gets_cancel_and_deadlines(tmp_path, hang, stop):
    """A subclass that blocks (a live fallback for calls not recorded, latency simulated for a UI
    test) is a port like any other: the turn must not wait for it past a cancel or a timeout."""
    path, release, entered = tmp_path / "t.jsonl", hang(), threading.Event()
    summed(path)

    class Slow(ReplayTools):
        def call_tool(self, call, timeout_s, cancel=None):
            entered.set()
            release.wait(2)
            return super().call_tool(call, timeout_s, cancel)

    token = CancelToken()
    stamp = cancel_once_entered(entered, token) if stop == "cancel" else {}
    results = []

    class Results:
        def emit(self, event):
            if event.kind == "tool_call_completed":
                results.append(event.data["content"])

    rt = AgentRuntime(ReplayLlm(path), Slow(path), action_mode="native", events=Results(),
                      policy=TurnPolicy(tool_timeout_ms=200))
    t0 = time.monotonic()
    if stop == "cancel":
        r = rt.run(AgentRequest("sum", "s1"), token)
        assert r.finish_reason is FinishReason.CANCELLED
        assert time.monotonic() - stamp["t"] < 0.1
    else:   # the timed-out result makes request 2 differ from the recorded one
        with pytest.raises(bob.LlmError, match="LLM request 2 differs"):
            rt.run(AgentRequest("sum", "s1"), token)
        assert results == ["tool 'add' timed out after 200 ms"]
        assert time.monotonic() - t0 < 1.0


def test_a_turn_timeout_recorded_while_a_tool_ran_replays_the_same(tmp_path, hang):
    path, release = tmp_path / "t.jsonl", hang()

    def slow(a: int) -> int:
        """Slow: outlasts the turn."""
        release.wait(10)
        return a

    [r] = record(path, [calls(("c1", "slow", {"a": 1})), "never"], ["go"],
                 tools_port=FunctionTools([add, slow]),
                 policy=TurnPolicy(turn_timeout_ms=300, tool_timeout_ms=10_000))
    assert r.guard_reason is GuardReason.TURN_TIMEOUT
    assert r.history[2].content.startswith("tool 'slow' timed out after")   # the turn's 300 ms
    t0 = time.monotonic()
    report = bob.replay(path)
    assert time.monotonic() - t0 < 0.3   # at once, not the recorded 300 ms
    assert report.ok, str(report)


def test_a_turn_timeout_recorded_while_the_approver_was_asked_replays_the_same(tmp_path, hang):
    path, release = tmp_path / "t.jsonl", hang()

    def approver(call):
        release.wait(10)
        return Approval(True)

    [r] = record(path, [calls(("c1", "add", {"a": 1, "b": 2})), "3"], ["go"],
                 ask_tools=["add"], approver=approver, policy=TurnPolicy(turn_timeout_ms=300))
    assert r.guard_reason is GuardReason.TURN_TIMEOUT
    report = bob.replay(path)
    assert report.ok, str(report)


def test_a_hand_wired_replay_llm_ends_a_recorded_cancel_at_once(tmp_path, hang):
    path, release = tmp_path / "t.jsonl", hang()

    def slow(req, cancel):
        release.wait(10)
        return "never"

    [r] = record(path, [slow], ["go"], cancel_on=lambda e: e.kind == "llm_call_started")
    assert r.finish_reason is FinishReason.CANCELLED
    assert bob.replay(path).ok   # replay() fires the cancel itself (_Recorder)
    token = CancelToken()
    rt = AgentRuntime(ReplayLlm(path, on_interrupt=token.cancel), ReplayTools(path),
                      action_mode="native", policy=TurnPolicy(turn_timeout_ms=1000))
    t0 = time.monotonic()
    r = rt.run(AgentRequest("go", "s1"), token)
    assert r.finish_reason is FinishReason.CANCELLED
    assert time.monotonic() - t0 < 0.5


def test_hung_live_workers_elsewhere_do_not_stop_a_replay(tmp_path, hang):
    path, release = tmp_path / "t.jsonl", hang()
    summed(path)

    def hung(i: int) -> int:
        """Hangs."""
        release.wait(30)
        return i

    n = bob._MAX_ABANDONED - bob.abandoned_workers()
    live = AgentRuntime(ScriptedLlm([calls(*[(f"h{i}", "hung", {"i": i}) for i in range(n)]),
                                     "ok"]), FunctionTools([hung]), action_mode="native",
                        policy=TurnPolicy(max_parallel_tools=n, max_tool_calls=n,
                                          tool_timeout_ms=50))
    live.run(AgentRequest("hang"))
    assert bob.abandoned_workers() >= bob._MAX_ABANDONED
    report = bob.replay(path)   # nothing in it needs a thread
    assert report.ok, str(report)
    r = AgentRuntime(ReplayLlm(path), ReplayTools(path), action_mode="native").run(
        AgentRequest("sum", "s1"))
    assert r.content == "3"


_LATE_SPY = """
import threading, sys
import bob
from bob import *
path = sys.argv[1]
inner = ReplayLlm(path)
turn_over = threading.Event()

class Late:
    '''A spy around ReplayLlm that answers after the turn gave it up.'''
    def complete(self, req, cancel, on_delta=None):
        turn_over.wait(5)
        return inner.complete(req, cancel, on_delta)

token = CancelToken()

class CancelAtCall:
    def emit(self, e):
        if e.kind == "llm_call_started":
            token.cancel()

r = AgentRuntime(Late(), ReplayTools(path), events=CancelAtCall(), action_mode="native").run(
    AgentRequest("go", "s1"), token)
assert r.finish_reason is FinishReason.CANCELLED
turn_over.set()
for _ in range(100):   # the spy's thread returns at once: _NoAnswer
    if inner.requests and bob.abandoned_workers() == 0:
        break
    threading.Event().wait(0.05)
print(len(inner.requests), inner.divergence, bob.abandoned_workers())
"""


def test_a_port_wrapping_replay_llm_that_answers_late_leaks_no_abandoned_worker(tmp_path, hang):
    """Run in a child process: the leak would stay in this one's count for good."""
    path, release = tmp_path / "t.jsonl", hang()

    def slow(req, cancel):
        release.wait(10)
        return "never"

    record(path, [slow], ["go"], cancel_on=lambda e: e.kind == "llm_call_started")
    out = subprocess.run([sys.executable, "-c", _LATE_SPY, str(path)], cwd=REPO, timeout=60,
                         capture_output=True, text=True, env={"PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    # the request was asked and matched; no worker is left counted
    assert out.stdout.split() == ["1", "None", "0"]


@pytest.mark.parametrize("content", [None, "4"])
def test_a_reply_that_answers_no_request_is_a_trace_error_naming_its_line(tmp_path, content):
    """The mirror of a request with no reply (a TraceError naming the line, at once)."""
    path = tmp_path / "t.jsonl"
    summed(path)
    lines = lines_of(path)
    i = [n for n, k in enumerate(kinds(lines)) if k == "llm_call_completed"][1]
    added = json.loads(lines[i])
    if content is not None:
        added["data"]["content"] = content
    write_lines(path, lines[:i + 1] + [json.dumps(added)] + lines[i + 1:])
    with pytest.raises(TraceError, match=f"line {i + 2}: "):
        bob.replay(path)


# ---- 3. Promises that hold ----------------------------------------------------------------------

def test_a_hand_wired_replay_llm_replays_a_recorded_timeout_at_once(tmp_path, hang):
    """Under the caller's own policy (90 s), not only replay()'s recorded one."""
    path = tmp_path / "t.jsonl"
    record_a_turn_timeout(path, hang, 300)
    t0 = time.monotonic()
    r = AgentRuntime(ReplayLlm(path), ReplayTools(path), action_mode="native").run(
        AgentRequest("sum", "s1"))
    assert time.monotonic() - t0 < 0.3
    assert r.guard_reason is GuardReason.TURN_TIMEOUT and r.steps == 2
    assert "the model did not answer within turn_timeout_ms=90000" in r.content


def test_replies_swapped_between_requests_diverge_at_the_first_step(tmp_path):
    path = tmp_path / "t.jsonl"
    summed(path)
    lines = lines_of(path)
    i, j = [n for n, k in enumerate(kinds(lines)) if k == "llm_call_completed"]
    lines[i], lines[j] = lines[j], lines[i]
    write_lines(path, lines)
    t0 = time.monotonic()
    report = bob.replay(path)
    assert time.monotonic() - t0 < 1.0
    assert not report.ok and (report.turn, report.step) == (1, 1)
    assert report.what == "action_parsed type"
    assert (report.recorded, report.new) == ("tool_call", "final")


def test_a_deleted_tool_result_is_a_divergence_at_once(tmp_path):
    path = tmp_path / "t.jsonl"
    summed(path)
    lines = lines_of(path)
    write_lines(path, [line for line, k in zip(lines, kinds(lines))
                       if k != "tool_call_completed"])
    t0 = time.monotonic()
    report = bob.replay(path)
    assert time.monotonic() - t0 < 1.0
    assert not report.ok and report.step == 1 and report.what == "a different event"
    assert report.new["kind"] == "tool_call_completed"
    assert report.new["content"].startswith("replay: tool call c1 add(")




def test_calls_of_a_parallel_batch_reordered_in_the_trace_are_a_divergence(tmp_path):
    path = tmp_path / "t.jsonl"
    record(path, [calls(("c1", "add", {"a": 1, "b": 2}), ("c2", "shout", {"text": "x"})),
                  "3 X"], ["go"])
    lines = lines_of(path)
    for kind in ("tool_call_started", "tool_call_completed"):
        i, j = [n for n, k in enumerate(kinds(lines)) if k == kind]
        lines[i], lines[j] = lines[j], lines[i]
    write_lines(path, lines)
    report = bob.replay(path)
    assert not report.ok and report.what == "tool_call_started call_id"
    assert (report.recorded, report.new) == ("c2", "c1")


def test_a_batch_of_many_parallel_calls_replays_the_same(tmp_path):
    path, n = tmp_path / "t.jsonl", 500
    policy = TurnPolicy(max_parallel_tools=n, max_tool_calls=n)
    record(path, [calls(*[(f"c{i}", "add", {"a": i, "b": 1}) for i in range(n)]), "done"],
           ["go"], policy=policy)
    report = bob.replay(path)
    assert report.ok, str(report)
    r = AgentRuntime(ReplayLlm(path), ReplayTools(path), action_mode="native",
                     policy=policy).run(AgentRequest("go", "s1"))
    assert r.content == "done"
    assert [m.content for m in r.history[2:-1]] == [str(i + 1) for i in range(n)]


def test_a_turn_cancelled_in_the_middle_of_a_batch_replays_the_same(tmp_path, hang):
    """Three calls; the middle one is interrupted: the first and last ended before it."""
    path, release, token = tmp_path / "t.jsonl", hang(), CancelToken()
    ended = threading.Barrier(3, timeout=10)

    def fast(a: int) -> int:
        """Quick."""
        ended.wait()
        return a

    def slow(a: int) -> int:
        """Interrupted."""
        ended.wait()
        token.cancel()
        release.wait(10)
        return a

    rt = AgentRuntime(ScriptedLlm([calls(("c1", "fast", {"a": 1}), ("c2", "slow", {"a": 2}),
                                         ("c3", "fast", {"a": 3}))]),
                      FunctionTools([fast, slow]), events=JsonlEventSink(path),
                      action_mode="native")
    r = rt.run(AgentRequest("go", "s1"), token)
    # (c1 and c3 end as the cancel comes: under load one may be interrupted too; either way
    # the replay must give what was recorded)
    assert r.history[3].content.startswith("interrupted:") and len(r.history) == 5
    for _ in range(10):
        report = bob.replay(path)
        assert report.ok, str(report)


def test_a_recorded_ask_user_replays_the_same(tmp_path):
    path = tmp_path / "t.jsonl"
    record(path, [json.dumps({"type": "ask_user", "question": "which file?"}),
                  json.dumps({"type": "final", "content": "done"})], ["edit", "a.txt"],
           mode="json")
    report = bob.replay(path)
    assert report.ok and report.turns[0].endswith("ask_user)"), str(report)


def test_two_replays_in_parallel_threads_share_nothing(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    summed(a)
    record(b, [calls(("c1", "shout", {"text": "x"})), calls(("c2", "add", {"a": 5, "b": 5})),
               "X 10"], ["go"])
    reports = {a: [], b: []}
    start = threading.Barrier(2, timeout=10)

    def run(path):
        start.wait()
        reports[path] += [bob.replay(path) for _ in range(30)]

    threads = [threading.Thread(target=run, args=(p,)) for p in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.turns for r in reports[a]] == [["turn 1: same (2 LLM calls, 1 tool calls, "
                                              "final)"]] * 30
    assert [r.turns for r in reports[b]] == [["turn 1: same (3 LLM calls, 2 tool calls, "
                                              "final)"]] * 30


def test_a_replay_port_reused_for_a_second_run_says_so_at_once(tmp_path):
    path = tmp_path / "t.jsonl"
    summed(path)
    llm, port = ReplayLlm(path), ReplayTools(path)
    rt = AgentRuntime(llm, port, action_mode="native", policy=TurnPolicy(turn_timeout_ms=5000))
    assert rt.run(AgentRequest("sum", "s2")).content == "3"
    t0 = time.monotonic()
    with pytest.raises(bob.LlmError, match="LLM request 3 has no recorded reply"):
        rt.run(AgentRequest("sum", "s3"))
    assert time.monotonic() - t0 < 1.0
    assert llm.divergence == "LLM request 3 has no recorded reply"
    r = AgentRuntime(ScriptedLlm([calls(("c1", "add", {"a": 1, "b": 2})), "3"]), port,
                     action_mode="native").run(AgentRequest("sum", "s4"))
    assert "replay: tool call c1 add" in r.history[2].content and port.divergence


def test_a_hand_wired_replay_llm_checks_the_digest_itself_whatever_the_sinks(tmp_path):
    """`told` is only ever set by replay()'s own sink: a runtime with other sinks (a trace of
    the replay) digests each request in the port, so an edited input is still found."""
    path, again = tmp_path / "t.jsonl", tmp_path / "again.jsonl"
    summed(path)
    llm = ReplayLlm(path)
    rt = AgentRuntime(llm, ReplayTools(path), action_mode="native",
                      events=[JsonlEventSink(again), bob.LoggingEventSink()])
    with pytest.raises(bob.LlmError, match="LLM request 1 differs from the recorded"):
        rt.run(AgentRequest("sum, please", "s1"))
    assert llm.told is None
    rt = AgentRuntime(ReplayLlm(path), ReplayTools(path), action_mode="native",
                      events=JsonlEventSink(tmp_path / "b.jsonl"))
    assert rt.run(AgentRequest("sum", "s1")).content == "3"
    assert bob.replay(tmp_path / "b.jsonl").ok   # the replay's own trace replays too


def test_a_sink_that_replays_another_trace_on_the_loops_thread(tmp_path):
    """Reentrancy: replay() called from a sink of a turn being replayed by hand, on the same
    thread, between the port's answers: neither replay sees the other's digests."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    summed(a)
    record(b, [calls(("c9", "shout", {"text": "y"})), "Y"], ["go"])
    inner = []

    class Nested:
        def emit(self, event):
            if event.kind in ("llm_call_started", "tool_call_started"):
                inner.append(bob.replay(b))

    llm = ReplayLlm(a)
    r = AgentRuntime(llm, ReplayTools(a), action_mode="native", events=Nested()).run(
        AgentRequest("sum", "s1"))
    assert r.content == "3" and llm.divergence is None
    assert len(inner) == 3 and all(rep.ok for rep in inner), [str(x) for x in inner]


def test_after_many_inline_steps_a_hung_live_tool_keeps_its_timeout_and_cancel(tmp_path, hang):
    """Stale wake-up tokens of inline answers (one a call) stay in the turn's queue: a live
    tool's wait reads them first, and must neither end early nor miss the cancel."""
    path, release, n = tmp_path / "t.jsonl", hang(), 300
    policy = TurnPolicy(max_steps=n + 2, max_tool_calls=n + 1, tool_timeout_ms=300)
    replies = [calls((f"c{i}", "add", {"a": i, "b": 1})) for i in range(n)]
    record(path, replies + [calls(("last", "shout", {"text": "x"})), "done"], ["count"],
           policy=policy)
    entered = threading.Event()

    def shout(text: str) -> str:   # (the recorded description: only the result differs)
        """Upper-case a text."""
        entered.set()
        release.wait(10)
        return text.upper()

    report = bob.replay(path, tools=FunctionTools([add, shout]), policy=policy)
    assert not report.ok and report.new == "tool 'shout' timed out after 300 ms"
    token = CancelToken()
    entered.clear()
    stamp = cancel_once_entered(entered, token)
    t0 = time.monotonic()
    r = AgentRuntime(ReplayLlm(path), FunctionTools([add, shout]), action_mode="native",
                     policy=policy).run(AgentRequest("count", "s1"), token)
    assert r.finish_reason is FinishReason.CANCELLED and r.steps == n + 1
    assert time.monotonic() - stamp["t"] < 0.1
    assert time.monotonic() - t0 < 0.3 + 1.0   # not the tool's 300 ms and more


def test_an_inline_answer_leaves_the_pool_and_the_abandoned_count_alone(tmp_path):
    """A replay uses no worker thread: it starts none and counts none, cancelled or not."""
    path = tmp_path / "t.jsonl"
    record(path, [calls(("c1", "add", {"a": 1, "b": 2})), calls(("c2", "add", {"a": 3, "b": 3})),
                  "done"], ["go"], cancel_on=lambda e: e.kind == "tool_call_completed"
           and e.data["call_id"] == "c2")
    before = bob.abandoned_workers()
    threads = {t.ident for t in threading.enumerate()}
    for _ in range(5):
        assert bob.replay(path).ok
    assert bob.abandoned_workers() == before
    assert {t.ident for t in threading.enumerate()} <= threads
