"""Round 6, attacked: what landed this round (a turn that ran out of time replays the same, a
turn whose own token fires is out of time, the tools offered compared at turn_started, the
adapter learning refused message fields), tried where its promises are weakest.

The five breaks it found were strict xfails until round 7 fixed them; they are plain tests now,
beside the promises that held under attack. Real parts throughout: real runtimes, tools and
stores, the fake OpenAI server on 127.0.0.1 (tests/fake_openai.py), the CLI as a subprocess.
Sections: 1. Helpers  2. Replay: where the time ran out  3. Replay: edited traces, reused ids
4. The turn's own token  5. The tools offered  6. The adapter's refused fields
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fake_openai import FakeOpenAI, stream_reply, tool_calls_reply
from test_replay import record
from test_round6_replay import GivingUp, held_at, ran_out_of_time, replayed_at_once
from test_trace import add, calls, shout

import bob
from bob import (AgentRequest, AgentRuntime, Approval, CancelToken, FinishReason, FunctionTools,
                 GuardReason, InMemorySessionStore, JsonlEventSink, LlmError, LlmRequest, Message,
                 ScriptedLlm, SessionState, ToolCall, ToolDescriptor, ToolResult, TurnPolicy)
from conftest import KEY, assert_well_formed, make_llm, run_cli, wait_until


# ---- 1. Helpers ---------------------------------------------------------------------------------

class HeldSink(JsonlEventSink):
    """A trace file whose writer is slow at one event kind (held_at): the loop's thread waits."""

    def __init__(self, path, hold):
        super().__init__(path)
        self.hold = hold

    def emit(self, event):
        super().emit(event)
        self.hold(event)


def resume_held(path, kind: str, replies, timeout_ms: int = 300) -> bob.AgentRunResult:
    """A turn paused on c1 (add, ask_tools), then resumed with c1 allowed, by a runtime whose
    trace writer holds the loop at the first `kind` event until the deadline has passed."""
    [paused] = record(path, [calls(("c1", "add", {"a": 1, "b": 2}))], ["sum"],
                      ask_tools=["add"])
    assert paused.finish_reason is FinishReason.NEEDS_APPROVAL
    sink = HeldSink(path, held_at(kind, timeout_ms))
    rt = AgentRuntime(ScriptedLlm(replies), FunctionTools([add]), ask_tools=["add"],
                      policy=TurnPolicy(turn_timeout_ms=timeout_ms), action_mode="native",
                      events=sink, store=InMemorySessionStore())
    rt.store.save("s1", SessionState(paused.history, version=1, paused={
        "guard": {}, "input_index": 0, "approvals": {}}))
    result = rt.run(AgentRequest(None, "s1", approvals={"c1": Approval(True)}))
    sink.close()
    return result


def lines_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_lines(path, events) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


# ---- 2. Replay: where the time ran out ----------------------------------------------------------

def before_the_first_llm_call(path) -> list:
    return record(path, ["never asked"], ["hi"], policy=TurnPolicy(turn_timeout_ms=300),
                  cancel_on=held_at("state", 300))   # start -> build_prompt: the first state


def before_the_first_llm_call_of_a_second_turn(path) -> list:
    hold = held_at("state", 300)
    turns = []

    def second_turn_held(event) -> bool:
        turns.extend([1] if event.kind == "turn_started" else [])
        return len(turns) == 2 and hold(event)
    return record(path, ["one", "never asked"], ["hi", "again"],
                  policy=TurnPolicy(turn_timeout_ms=300), cancel_on=second_turn_held)


def before_the_batch(path) -> list:
    return record(path, [calls(("c1", "add", {"a": 1, "b": 2}))], ["sum"],
                  policy=TurnPolicy(turn_timeout_ms=300), cancel_on=held_at("action_parsed", 300))


def cancelled_as_the_time_ran_out(path) -> list:
    hold = held_at("action_parsed", 300)
    return record(path, [calls(("c1", "add", {"a": 1, "b": 2}))], ["sum"],
                  policy=TurnPolicy(turn_timeout_ms=300),
                  cancel_on=lambda e: not hold(e) and e.kind == "action_parsed")


# Each recording waits (idle) for its 300 ms turn deadline: all run side by side, in threads.
RAN_OUT = {
    "first call": before_the_first_llm_call,
    "second turn": before_the_first_llm_call_of_a_second_turn,
    "resumed, before its batch": lambda path: resume_held(path, "approval_decided", ["3"]),
    "resumed, while its tool ran": lambda path: resume_held(path, "tool_call_completed",
                                                            ["never asked"]),
    "cli, first call": before_the_first_llm_call,
    "cli, before its batch": before_the_batch,
    "live, before its batch": before_the_batch,
    "trip deleted, before its batch": before_the_batch,   # section 3
    "live, after a tool answered": lambda path: record(
        path, [calls(("c1", "add", {"a": 1, "b": 2}))], ["sum"],
        policy=TurnPolicy(turn_timeout_ms=300), cancel_on=held_at("tool_call_completed", 300)),
    "cancelled": cancelled_as_the_time_ran_out,
}


@pytest.fixture(scope="module")
def ran_out(tmp_path_factory):
    """The recordings of RAN_OUT, each in its own directory, run side by side in threads when
    the first of their tests asks, all ended before any test goes on (nothing runs behind a
    replay's time bound). A test takes its own: path, result = ran_out("first call") (a
    recording's failure is raised there)."""
    paths = {key: tmp_path_factory.mktemp("ran-out") / "t.jsonl" for key in RAN_OUT}
    with ThreadPoolExecutor(len(RAN_OUT)) as pool:
        done = {key: pool.submit(RAN_OUT[key], paths[key]) for key in RAN_OUT}
    return lambda key: (paths[key], done[key].result())


def test_time_found_passed_before_the_first_llm_call_replays_the_same(ran_out):
    path, [r] = ran_out("first call")
    assert (r.guard_reason, r.steps) == (GuardReason.TURN_TIMEOUT, 0)
    report = replayed_at_once(path)
    assert report.ok, str(report)


def test_time_found_passed_before_the_first_llm_call_of_a_second_turn_replays(ran_out):
    path, (first, second) = ran_out("second turn")
    assert first.finish_reason is FinishReason.FINAL
    assert second.guard_reason is GuardReason.TURN_TIMEOUT
    report = replayed_at_once(path)
    assert report.ok, str(report)


def test_a_resumed_turn_whose_time_ran_out_before_its_batch_replays_the_same(ran_out):
    path, r = ran_out("resumed, before its batch")
    assert r.guard_reason is GuardReason.TURN_TIMEOUT
    assert r.history[-1].content.startswith("not run: the turn took longer than")
    report = replayed_at_once(path)
    assert report.ok, str(report)


def test_a_resumed_turn_whose_time_ran_out_while_its_tool_ran_replays_the_same(ran_out):
    path, r = ran_out("resumed, while its tool ran")
    assert (r.guard_reason, r.history[-1].content) == (GuardReason.TURN_TIMEOUT, "3")
    report = replayed_at_once(path)
    assert report.ok, str(report)


def test_a_turn_whose_tool_listing_ran_out_of_time_replays_the_same(tmp_path, hang):
    release = hang()

    class SlowListing(FunctionTools):
        def list_tools(self):
            release.wait(10)   # an MCP server slow to list its tools
            return super().list_tools()
    path = tmp_path / "t.jsonl"
    [r] = record(path, ["never asked"], ["hi"], policy=TurnPolicy(turn_timeout_ms=200),
                 tools_port=SlowListing([add]))
    assert r.content == "Stopped: listing the tools did not answer within turn_timeout_ms=200."
    release.set()
    report = replayed_at_once(path)
    assert report.ok, str(report)


def test_the_cli_replays_a_turn_whose_time_ran_out_before_its_first_llm_call(tmp_path, ran_out):
    path, _ = ran_out("cli, first call")
    done = run_cli(tmp_path, "replay", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "turn 1: same" in done.stdout


def test_the_cli_replays_a_turn_whose_time_ran_out_before_its_batch(tmp_path, ran_out):
    path, [r] = ran_out("cli, before its batch")
    assert r.guard_reason is GuardReason.TURN_TIMEOUT
    done = run_cli(tmp_path, "replay", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "turn 1: same (1 LLM calls, 0 tool calls, guard_exceeded)" in done.stdout


def test_parallel_calls_one_outliving_the_turn_replay_at_once(tmp_path, hang):
    """Two calls at once; one outlives the turn: its recorded "timed out" result, the other's
    answer, and the check before the next LLM call replay without waiting."""
    release = hang()

    def slow(text: str) -> str:
        """Wait, then echo."""
        release.wait(10)
        return text
    path = tmp_path / "t.jsonl"
    [r] = record(path, [calls(("c1", "add", {"a": 1, "b": 2}), ("c2", "slow", {"text": "x"}))],
                 ["go"], policy=TurnPolicy(turn_timeout_ms=300),
                 tools_port=FunctionTools([add, slow]))
    assert r.guard_reason is GuardReason.TURN_TIMEOUT
    assert r.history[-2].content == "3"
    assert r.history[-1].content.startswith("tool 'slow' timed out after")
    release.set()
    assert replayed_at_once(path).ok


def test_live_tools_replay_a_turn_whose_time_ran_out_before_its_batch(ran_out):
    """replay(tools=live): the live port runs on a worker thread; the recorded check before the
    batch trips again and the live tool is never called."""
    ran = []

    def counted(a: int, b: int) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b
    counted.__name__ = "add"
    path, _ = ran_out("live, before its batch")
    report = replayed_at_once(path, tools=FunctionTools([counted, shout]))
    assert report.ok, str(report)
    assert ran == []


def test_live_tools_replay_a_turn_whose_time_ran_out_after_a_tool_answered(ran_out):
    path, _ = ran_out("live, after a tool answered")
    report = replayed_at_once(path, tools=FunctionTools([add, shout]))
    assert report.ok, str(report)


def test_a_cancel_recorded_as_the_time_ran_out_replays_cancelled(ran_out):
    """The sink holds the loop past the deadline at action_parsed, and the caller cancels
    there too: the cancel wins (CANCELLED, "interrupted"), and replays so, at once."""
    path, [r] = ran_out("cancelled")
    assert r.finish_reason is FinishReason.CANCELLED
    assert r.history[-1].content.startswith("interrupted")
    report = replayed_at_once(path)
    assert report.ok, str(report)


def streamed_past_the_deadline(path) -> None:
    """A real adapter streaming (as the REPL does): the second step's reply drips until the
    turn's time runs out mid-stream."""
    slow = stream_reply(["Hel", "lo", " wor", "ld", "!"] * 4, delay_s=0.15)
    with FakeOpenAI([tool_calls_reply([("add", {"a": 1, "b": 2})]), slow]) as srv:
        rt = AgentRuntime(make_llm(srv, stream=True), FunctionTools([add]),
                          events=JsonlEventSink(path), action_mode="native",
                          policy=TurnPolicy(turn_timeout_ms=1500))
        try:
            r = rt.run(AgentRequest("sum", "s1"))
            assert r.guard_reason is GuardReason.TURN_TIMEOUT
        except LlmError as e:   # the adapter's clock ran out first: the cut stream's error
            assert "cut before it finished" in str(e) or "no answer in time" in str(e)
        rt.sinks[0].close()


def two_sessions_one_timed_out(path, release: threading.Event) -> dict:
    """Two sessions on one runtime and one trace file, their events interleaved: s1's model
    outlives its turn while s2's whole turn runs."""
    entered = threading.Event()

    def slow(req, cancel):
        entered.set()
        release.wait(10)
        return "late"
    sink = JsonlEventSink(path)
    rt = AgentRuntime(ScriptedLlm([slow, "two"]), FunctionTools([add]), events=sink,
                      policy=TurnPolicy(turn_timeout_ms=1500), action_mode="native")
    results = {}
    first = threading.Thread(target=lambda: results.update(
        s1=rt.run(AgentRequest("one", "s1"))))
    first.start()
    assert entered.wait(5)
    results["s2"] = rt.run(AgentRequest("two", "s2"))
    first.join(5)
    release.set()
    sink.close()
    return results


@pytest.fixture(scope="module")
def out_of_time(tmp_path_factory):
    """The two cases below each wait out a turn deadline of 1.5 s (a loaded machine's first
    step, or the other session's turn, must fit in it), idle: they run side by side in threads
    when the first of their tests asks, and each test takes its own (a case's failed assertion
    is raised by .result()). Then, as conftest's hang checks: blocked workers must end."""
    before, release = bob.abandoned_workers(), threading.Event()
    paths = {key: tmp_path_factory.mktemp(key) / "t.jsonl" for key in ("streamed", "two")}
    with ThreadPoolExecutor(2) as pool:
        cases = {"streamed": pool.submit(streamed_past_the_deadline, paths["streamed"]),
                 "two": pool.submit(two_sessions_one_timed_out, paths["two"], release)}
        try:
            yield paths, cases, before
        finally:
            release.set()


def test_a_reply_streamed_past_the_deadline_in_a_later_step_replays_at_once(out_of_time):
    """The replay of streamed_past_the_deadline answers at once."""
    paths, cases, _ = out_of_time
    cases["streamed"].result(timeout=30)
    path = paths["streamed"]
    assert [e["kind"] for e in lines_of(path)].count("llm_call_started") == 2
    report = replayed_at_once(path)
    assert report.ok, str(report)


def test_two_sessions_in_one_trace_one_timed_out_while_the_other_answered(out_of_time):
    """two_sessions_one_timed_out: s2 answered before s1 timed out; both replay at once."""
    paths, cases, before = out_of_time
    results = cases["two"].result(timeout=30)
    cases["streamed"].result(timeout=30)   # done too, before counting the blocked workers
    assert wait_until(lambda: bob.abandoned_workers() <= before), "blocked workers never ended"
    path = paths["two"]
    assert results["s1"].guard_reason is GuardReason.TURN_TIMEOUT
    assert results["s2"].content == "two"
    kinds = [(e["session_id"], e["kind"]) for e in lines_of(path)]
    assert kinds.index(("s2", "turn_completed")) < kinds.index(("s1", "turn_completed"))
    report = replayed_at_once(path)
    assert report.ok, str(report)
    assert len(report.turns) == 2


# ---- 3. Replay: edited traces, reused ids -------------------------------------------------------

def test_a_deleted_approval_decision_is_reported_at_once(tmp_path):
    path = tmp_path / "t.jsonl"
    record(path, [calls(("c1", "add", {"a": 1, "b": 2})), "3"], ["sum"],
           policy=TurnPolicy(turn_timeout_ms=2000), ask_tools=["add"],
           approver=lambda call: Approval(True))
    write_lines(path, [e for e in lines_of(path) if e["kind"] != "approval_decided"])
    try:
        report = replayed_at_once(path)
    except bob.TraceError:   # as for a deleted reply: the line named, at once
        return
    assert not report.ok


def test_an_added_turn_timeout_trip_is_reported_at_once(tmp_path):
    path = tmp_path / "t.jsonl"
    record(path, [calls(("c1", "add", {"a": 1, "b": 2})), "3"], ["sum"],
           policy=TurnPolicy(turn_timeout_ms=60_000))
    events = lines_of(path)
    at = next(i for i, e in enumerate(events) if e["kind"] == "action_parsed") + 1
    events.insert(at, {**events[at - 1], "kind": "guard_tripped", "data": {
        "reason": "turn_timeout", "detail": "the turn took longer than turn_timeout_ms=60000"}})
    write_lines(path, events)
    report = replayed_at_once(path)
    assert not report.ok and report.turn == 1


def test_a_deleted_turn_timeout_trip_is_reported_at_once(ran_out):
    """The check before the batch tripped; the trip deleted by hand: the replay runs the call
    the recording did not, and says so at once."""
    path, _ = ran_out("trip deleted, before its batch")
    write_lines(path, [e for e in lines_of(path) if e["kind"] != "guard_tripped"])
    report = replayed_at_once(path)
    assert not report.ok
    assert report.what == "tool call c1 add({\"a\": 1, \"b\": 2}) was never recorded"


def test_decisions_on_a_call_id_reused_across_batches_replay_in_order(tmp_path):
    path = tmp_path / "t.jsonl"
    answers = iter([Approval(True), Approval(False, "no more")])
    [r] = record(path, [calls(("c1", "add", {"a": 1, "b": 2})),
                        calls(("c1", "add", {"a": 3, "b": 4})), "done"], ["sum"],
                 ask_tools=["add"], approver=lambda call: next(answers))
    assert [m.content for m in r.history if m.role == "tool"] == [
        "3", "the user declined this call: no more"]
    report = replayed_at_once(path)
    assert report.ok, str(report)


def test_a_resumed_turn_asked_again_about_its_id_replays_the_approvers_decision(tmp_path):
    """A resume's decision on c1 is given in the request, not asked; the model then reuses c1
    and the approver declines it: the replay's approver answers with that decline, not the
    resume's allow (nor fails to read the resume's decision, asked about in no request)."""
    path = tmp_path / "t.jsonl"
    [paused] = record(path, [calls(("c1", "add", {"a": 1, "b": 2}))], ["sum"],
                      ask_tools=["add"])
    rt = AgentRuntime(ScriptedLlm([calls(("c1", "add", {"a": 3, "b": 4})), "done"]),
                      FunctionTools([add]), ask_tools=["add"], action_mode="native",
                      approver=lambda call: Approval(False, "no more"),
                      events=JsonlEventSink(path), store=InMemorySessionStore())
    rt.store.save("s1", SessionState(paused.history, version=1, paused={
        "guard": {}, "input_index": 0, "approvals": {}}))
    r = rt.run(AgentRequest(None, "s1", approvals={"c1": Approval(True)}))
    rt.sinks[0].close()
    assert [m.content for m in r.history if m.role == "tool"] == [
        "3", "the user declined this call: no more"]
    report = replayed_at_once(path)
    assert report.ok, str(report)
    assert report.turns == ["turn 1: same (1 LLM calls, 0 tool calls, needs_approval)",
                            "turn 2: same (2 LLM calls, 1 tool calls, final)"]


# ---- 4. The turn's own token --------------------------------------------------------------------

class KeepsToken:
    """An LlmPort that keeps the token it was given (to fire it later, from another thread) and
    answers with a call to add, then "done"."""

    def __init__(self):
        self.token = None
        self.llm = ScriptedLlm([calls(("c1", "add", {"a": 1, "b": 2})), "done"])

    def complete(self, req, cancel, on_delta=None):
        self.token = cancel
        return self.llm.complete(req, cancel)


def test_a_port_firing_its_token_late_ends_the_approvers_wait_as_out_of_time(hang):
    release = hang()
    asked = threading.Event()
    llm = KeepsToken()

    def approver(call):
        asked.set()
        release.wait(10)
        return Approval(True)
    rt = AgentRuntime(llm, FunctionTools([add]), ask_tools=["add"], approver=approver,
                      policy=TurnPolicy(turn_timeout_ms=60_000), action_mode="native")
    threading.Thread(target=lambda: asked.wait(5) and llm.token.cancel()).start()
    r = ran_out_of_time(rt, AgentRequest("sum", "s1"), 2.0)
    assert r.content == "Stopped: the approver did not answer within turn_timeout_ms=60000."
    assert_well_formed(r.history)


def test_the_callers_cancel_then_a_ports_fire_during_the_approvers_wait_is_cancelled():
    """The user cancels at the approval prompt and, at once, a port gives up the turn's token:
    the caller's cancel came first, the turn is CANCELLED (not out of time)."""
    caller = CancelToken()
    llm = KeepsToken()

    def approver(call):
        caller.cancel()
        llm.token.cancel()
        return Approval(True)
    rt = AgentRuntime(llm, FunctionTools([add]), ask_tools=["add"], approver=approver,
                      policy=TurnPolicy(turn_timeout_ms=60_000), action_mode="native")
    r = rt.run(AgentRequest("sum", "s1"), caller)
    assert (r.finish_reason, r.guard_reason) == (FinishReason.CANCELLED, None)
    assert r.history[-1].content.startswith("interrupted")


def test_a_model_port_that_fires_its_token_and_raises_cancelled_ends_the_turn_out_of_time():
    def giving_up(req, cancel):
        cancel.cancel()
        raise bob.Cancelled("the port gave up")
    outcomes = []
    for _ in range(5):   # (the loop's thread may see the fire before the raise: all 5 must pass)
        rt = AgentRuntime(ScriptedLlm([giving_up]), policy=TurnPolicy(turn_timeout_ms=60_000))
        try:
            r = rt.run(AgentRequest("hi", "s1"))
            outcomes.append((r.guard_reason, r.content))
        except bob.Cancelled as e:
            outcomes.append(f"raised Cancelled: {e}")
    assert outcomes == [(GuardReason.TURN_TIMEOUT,
                         "Stopped: the model did not answer within turn_timeout_ms=60000.")] * 5


def test_a_tool_firing_its_token_in_a_resumed_turn_ends_it_out_of_time_its_answer_kept():
    store = InMemorySessionStore()
    rt = AgentRuntime(ScriptedLlm([calls(("c1", "add", {"a": 1, "b": 2})), "never asked"]),
                      GivingUp([add]), ask_tools=["add"], store=store, action_mode="native",
                      policy=TurnPolicy(turn_timeout_ms=60_000))
    assert rt.run(AgentRequest("sum", "s1")).finish_reason is FinishReason.NEEDS_APPROVAL
    r = ran_out_of_time(rt, AgentRequest(None, "s1", approvals={"c1": Approval(True)}), 1.0)
    assert r.content == "Stopped: the turn took longer than turn_timeout_ms=60000."
    assert r.history[-1].content == "gave up"
    # and the next turn has its own time
    rt.llm = ScriptedLlm(["fine"])
    assert rt.run(AgentRequest("again", "s1")).content == "fine"


# ---- 5. The tools offered -----------------------------------------------------------------------

SECRET_EXAMPLE = '{"api_key": "sk-live-0123456789abcdef"}'


class Listed:
    """A ToolPort of one tool, `look`, with the schema given (a Python-built one may hold
    tuples), answering "ok"."""

    def __init__(self, schema):
        self.schema = schema

    def list_tools(self):
        return [ToolDescriptor("look", "Look a thing up.", self.schema)]

    def call_tool(self, call, timeout_s, cancel=None):
        return ToolResult(call.id, call.name, "ok")


def record_look(path, schema) -> None:
    rt = AgentRuntime(ScriptedLlm([calls(("c1", "look", {"q": "b"})), "done"]), Listed(schema),
                      events=JsonlEventSink(path), action_mode="native")
    assert rt.run(AgentRequest("hi", "s1")).content == "done"
    rt.sinks[0].close()


def test_a_secret_in_a_tuple_of_a_tools_schema_is_masked_as_in_a_list(tmp_path):
    path = tmp_path / "t.jsonl"
    record_look(path, {"type": "object", "properties": {"q": {
        "type": "string", "examples": (SECRET_EXAMPLE, "b")}}, "required": ("q",)})
    assert "sk-live-0123456789abcdef" not in path.read_text()


def test_a_tools_schema_with_tuples_replays_with_the_tools_live(tmp_path):
    schema = {"type": "object", "properties": {"q": {"type": "string", "enum": ("a", "b")}},
              "required": ("q",)}
    path = tmp_path / "t.jsonl"
    record_look(path, schema)
    assert replayed_at_once(path).ok
    report = replayed_at_once(path, tools=Listed(schema))
    assert report.ok, str(report)


def test_tools_offered_in_another_order_are_named_so(tmp_path):
    path = tmp_path / "t.jsonl"
    record(path, ["hi"], ["x"])
    report = replayed_at_once(path, tools=FunctionTools([shout, add]))
    assert (report.ok, report.step, report.recorded, report.new) == (
        False, 0, ["add", "shout"], ["shout", "add"])
    assert not report.what.endswith(": "), report.what


def test_tools_with_masked_secrets_replay_recorded_and_live(tmp_path):
    """A description quoting a key and a secret-named property's default: masked in the trace
    (as the model sees them), and the same when the live tools are masked again at Start."""
    class Keyed(Listed):
        def list_tools(self):
            return [ToolDescriptor("look", f"Look up. Example: {SECRET_EXAMPLE}", self.schema)]
    schema = {"type": "object", "properties": {
        "q": {"type": "string"}, "api_key": {"type": "string", "default": "sk-live-0123456789"}}}
    path = tmp_path / "t.jsonl"
    rt = AgentRuntime(ScriptedLlm([calls(("c1", "look", {"q": "b"})), "done"]), Keyed(schema),
                      events=JsonlEventSink(path), action_mode="native")
    assert rt.run(AgentRequest("hi", "s1")).content == "done"
    rt.sinks[0].close()
    assert "sk-live-0123456789" not in path.read_text()
    assert replayed_at_once(path).ok
    report = replayed_at_once(path, tools=Keyed(schema))
    assert report.ok, str(report)


ODD_TOOLS = {   # (description, input_schema) of one tool, `look`
    "a lone surrogate": ("Look \ud800 up", {"type": "object"}),
    "an int past 2**64": ("x", {"type": "object", "properties": {"n": {"maximum": 2 ** 70}}}),
    "floats": ("x", {"type": "object", "properties": {"n": {"default": 0.1 + 0.2},
                                                      "m": {"default": -0.0}}}),
    "no description": (None, {"type": "object"}),
    "a number for a description": (5, {"type": "object"}),
    "NUL and line separators": ("a\x00b\u2028c\u2029d\x85e", {"type": "object"}),
}


@pytest.mark.parametrize("description, schema", ODD_TOOLS.values(), ids=list(ODD_TOOLS))
def test_odd_tools_offered_replay_recorded_and_live(tmp_path, description, schema):
    class Odd(Listed):
        def list_tools(self):
            return [ToolDescriptor("look", description, self.schema)]
    path = tmp_path / "t.jsonl"
    rt = AgentRuntime(ScriptedLlm([calls(("c1", "look", {})), "done"]), Odd(schema),
                      events=JsonlEventSink(path), action_mode="native")
    assert rt.run(AgentRequest("hi", "s1")).content == "done"
    rt.sinks[0].close()
    for tools in None, Odd(schema):
        report = replayed_at_once(path, tools=tools)
        assert report.ok, str(report)


class UnfitSchema:
    """A port listing a tool whose schema JSON cannot hold (a custom port's; FunctionTools
    leaves such a default out since the eighth round)."""

    def list_tools(self):
        return [bob.ToolDescriptor("clamp", "Clamp x to hi.", {"type": "object", "properties": {
            "hi": {"type": "number", "default": math.inf}}})]

    def call_tool(self, call, timeout_s):
        raise AssertionError("never called")


def test_a_turn_failed_on_an_unfit_tool_schema_replays_offline(tmp_path):
    path = tmp_path / "t.jsonl"
    rt = AgentRuntime(ScriptedLlm(["never asked"]), UnfitSchema(), events=JsonlEventSink(path))
    with pytest.raises(bob.AgentError, match="holds NaN or Infinity"):
        rt.run(AgentRequest("hi", "s1"))
    rt.sinks[0].close()
    assert replayed_at_once(path, tools=UnfitSchema()).ok
    report = replayed_at_once(path)
    assert report.ok, str(report)


@pytest.mark.parametrize("tools", ["deleted", None, "add", [{"description": "x"}]])
def test_a_turn_started_whose_tools_were_edited_is_a_trace_error(tmp_path, tools):
    path = tmp_path / "t.jsonl"
    record(path, ["hi", "again"], ["x", "y"])
    events = lines_of(path)
    start = [e for e in events if e["kind"] == "turn_started"][1]["data"]
    if tools == "deleted":
        del start["tools"]
    else:
        start["tools"] = tools
    write_lines(path, events)
    with pytest.raises(bob.TraceError, match="the turn that starts at line"):
        bob.replay(path)


# ---- 6. The adapter's refused fields ------------------------------------------------------------

THOUGHT = "The user wants 2+3; both a and b are required, so call add."
HISTORY = [
    Message("user", "2+3?"),
    Message("assistant", "", (ToolCall("call_1", "add", {"a": 2, "b": 3},
                                       extra={"extra_content": {"google": {"s": "sig"}}}),),
            reasoning=THOUGHT),
    Message("tool", "5", tool_call_id="call_1", name="add"),
    Message("user", "and 4+4?")]


def a_request(messages=HISTORY) -> LlmRequest:
    return LlmRequest(list(messages), [], None, None)


def sent_back(request: dict) -> tuple:
    m = request["body"]["messages"][1]
    return "reasoning_content" in m, "extra_content" in m["tool_calls"][0]


def test_a_refusal_echoing_a_reasoning_that_says_required_is_still_learnt():
    refusal = {"status": 422, "body": {"object": "error", "message": {"detail": [{
        "type": "extra_forbidden", "loc": ["body", "messages", 2, "reasoning_content"],
        "msg": "Extra inputs are not permitted", "input": THOUGHT,
        "url": "https://errors.pydantic.dev/2.6/v/extra_forbidden"}]},
        "type": "invalid_request_error"}}
    with FakeOpenAI([refusal, "8"]) as srv:
        assert make_llm(srv, retry_max=0).complete(a_request(), CancelToken()).content == "8"
        assert [sent_back(r)[0] for r in srv.requests] == [True, False]


def test_a_message_field_named_but_never_sent_is_no_refusal(caplog):
    flagged = {"status": 400, "body": {"error": {"message": (
        "Invalid 'messages[0].content': the text 'why is reasoning_content unexpected?' was "
        "flagged by the moderation filter"), "type": "invalid_request_error"}}}
    question = [Message("user", "why is reasoning_content unexpected?")]
    with caplog.at_level(logging.WARNING, logger="bob"), \
            FakeOpenAI([flagged, "ok"]) as srv:
        llm = make_llm(srv, retry_max=0)
        with pytest.raises(LlmError, match="HTTP 400"):
            llm.complete(a_request(question), CancelToken())
        asked = len(srv.requests)
        llm.complete(a_request(), CancelToken())
        sent = sent_back(srv.requests[-1])
    assert not [r for r in caplog.records if "rejected" in r.getMessage()]
    assert (asked, sent) == (1, (True, True))


ODD_WORDS = {   # more servers' ways of refusing a field in a message
    "gemini": 'Invalid JSON payload received. Unknown name "reasoning_content" at '
              "'messages[1]': Cannot find field.",
    "groq": "'messages.1' : for 'role:assistant' the following must be satisfied[('messages.1' "
            ": property 'reasoning_content' is unsupported, did you mean 'reasoning'?)]",
    "ajv": "/messages/1 must NOT have additional properties (reasoning_content)",
    "plain text": "unknown field reasoning_content",
}


@pytest.mark.parametrize("words", ODD_WORDS.values(), ids=list(ODD_WORDS))
def test_a_refusal_in_odd_words_is_learnt(words):
    status = {"status": 400, "body": {"error": {"message": words}}}
    if words.startswith("unknown field"):   # a text body, not JSON
        status = {"status": 400, "body": words}
    with FakeOpenAI([status, "8"]) as srv:
        assert make_llm(srv, retry_max=0).complete(a_request(), CancelToken()).content == "8"
        assert [sent_back(r)[0] for r in srv.requests] == [True, False]


def test_a_server_refusing_both_fields_at_once_costs_two_uncounted_tries(caplog):
    def strict(body):
        if any("reasoning_content" in m or "extra_content" in str(m.get("tool_calls"))
               for m in body["messages"]):
            return {"status": 400, "body": {"error": {"message": (
                "Additional properties are not allowed ('extra_content', 'reasoning_content' "
                "were unexpected)")}}}
        return "8"
    with caplog.at_level(logging.WARNING, logger="bob"), FakeOpenAI([strict] * 5) as srv:
        assert make_llm(srv, retry_max=0).complete(a_request(), CancelToken()).content == "8"
        sent = [sent_back(r) for r in srv.requests]
    assert sent == [(True, True), (False, True), (False, False)]
    assert len([r for r in caplog.records if "rejected" in r.getMessage()]) == 2


@pytest.mark.parametrize("status", [400, 422, 500])
def test_a_server_naming_every_learnt_field_for_ever_is_asked_a_bounded_number_of_times(status):
    """json mode, streamed, a thinking history: every optional field and both message fields
    are named in every answer; each is left out once, then the error is the user's."""
    refusal = {"status": status, "body": {"error": {"message": (
        "unknown fields: response_format, stream_options, reasoning_content, extra_content")}}}
    with FakeOpenAI([refusal] * 30) as srv:
        llm = make_llm(srv, retry_max=1, stream=True)
        t0 = time.monotonic()
        with pytest.raises(LlmError, match=f"HTTP {status}"):
            llm.complete(LlmRequest(HISTORY, [], "json", None), CancelToken())
        assert time.monotonic() - t0 < 5
        assert len(srv.requests) <= 8, len(srv.requests)
        last = srv.requests[-1]["body"]
    assert "stream_options" not in last and "response_format" not in last
    assert "reasoning_content" not in last["messages"][1]


def test_no_secret_in_the_refusal_warning_or_the_error(tmp_path, caplog):
    """The key and the login in base_url: neither in a warning nor in the error, even when the
    server echoes the request's Authorization header in its refusals."""
    def echoing(body):
        return {"status": 400, "body": {"error": {"message": (
            f"reasoning_content not allowed (Authorization: Bearer {KEY})")}}}
    with caplog.at_level(logging.DEBUG, logger="bob"), FakeOpenAI([echoing] * 3) as srv:
        url = srv.url.replace("http://", "http://alice:hunter2-pass@")
        llm = bob.OpenAICompatLlm("test:gpt-x", base_url=url, api_key=KEY, retry_max=0)
        with pytest.raises(LlmError) as e:
            llm.complete(a_request(), CancelToken())
        assert len(srv.requests) == 2
    said = " ".join(r.getMessage() for r in caplog.records) + str(e.value) + repr(llm)
    assert "rejected reasoning_content" in said
    assert KEY not in said and "s3cret" not in said
    assert "hunter2" not in said
