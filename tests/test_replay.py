"""Tests of the complete trace and of replay: bob.replay, ReplayLlm, ReplayTools, ReplayReport.

Runs are recorded through a real AgentRuntime into a real JsonlEventSink file, then replayed
from that file. Sections: 1. Helpers  2. The trace  3. Replays that are the same
4. Divergences  5. The OpenAI adapter  6. Speed: a replay port answers on the loop's thread
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

import bob
from bob import (AgentRequest, AgentRuntime, CancelToken, FinishReason, FunctionTools,
                 GuardReason, JsonlEventSink, LlmResponse, ReplayLlm, ReplayTools,
                 ScriptedLlm, ToolCall, TraceError, TurnPolicy)
from fake_openai import FakeOpenAI, tool_calls_reply
from test_trace import calls, of, shout, tools   # the helpers the two files share


# ---- 1. Helpers ---------------------------------------------------------------------------------

def record(path: Path, replies, inputs, *, mode="native", policy=None, tools_port=None,
           cancel_on=None, **kw) -> list:
    """Run `inputs` as turns of one session, recording into `path`; returns the results.
    `cancel_on(event)` True cancels the running turn from the sink (on the loop's thread)."""
    token = CancelToken()

    class Sink(JsonlEventSink):
        def emit(self, event):
            super().emit(event)
            if cancel_on and cancel_on(event):
                token.cancel()

    sink = Sink(path)
    rt = AgentRuntime(ScriptedLlm(replies), tools_port or tools(), events=sink, policy=policy,
                      action_mode=mode, **kw)
    results = []
    for text in inputs:
        token = CancelToken()
        try:
            results.append(rt.run(AgentRequest(text, "s1"), token))
        except bob.StoreError as e:   # a failed save raises; the answer is on the error
            results.append(e.result)
    sink.close()
    return results


def big_run(path: Path) -> list:
    """Four turns, native mode: parallel calls, a re-prompt, a guard trip, a cancelled turn."""
    replies = [
        calls(("c1", "add", {"a": 1, "b": 2}), ("c2", "shout", {"text": "hi"}), text="both"),
        calls(("c3", "add", {"a": 3, "b": 4})),
        "1 + 2 = 3, HI, 7",                                           # turn 1: final
        "",                                                           # turn 2: empty: re-prompt
        "sorry: 42",                                                  # ... then final
        calls(("d1", "add", {"a": 1, "b": 1})),                       # turn 3: loops
        calls(("d2", "add", {"a": 1, "b": 1})),
        calls(("d3", "add", {"a": 1, "b": 1})),
        calls(("e1", "add", {"a": 5, "b": 5})),                       # turn 4: cancelled
    ]
    return record(path, replies, ["one", "two", "three", "four"],
                  cancel_on=lambda e: e.kind == "tool_call_completed" and e.data["call_id"] == "e1")


# ---- 2. The trace -------------------------------------------------------------------------------

def test_refused_calls_are_started_too_and_secrets_stay_masked(tmp_path):
    path = tmp_path / "t.jsonl"
    secret = {"text": "x", "api_key": "sk-SECRET"}
    record(path, [calls(*[(f"c{i}", "shout", secret) for i in range(3)]), "done"], ["go"],
           policy=TurnPolicy(max_parallel_tools=2))
    started, completed = of(path, "tool_call_started"), of(path, "tool_call_completed")
    assert [s["call_id"] for s in started] == [c["call_id"] for c in completed]
    assert [s["call_id"] for s in started] == ["c0", "c1", "c2"]
    assert [s["runs"] for s in started] == [False] * 3
    assert "sk-SECRET" not in path.read_text()
    assert bob.replay(path).ok      # digests are taken over the masked form


def test_json_mode_secrets_in_reply_text_are_masked_and_replay(tmp_path):
    path = tmp_path / "t.jsonl"
    reply = json.dumps({"type": "tool_call", "name": "shout",
                        "arguments": {"text": "a", "password": "hunter2"}})
    record(path, [reply, json.dumps({"type": "final", "content": "ok"})], ["go"], mode="json")
    assert "hunter2" not in path.read_text()
    assert bob.replay(path).ok


def test_a_trace_begun_mid_session_replays_alone(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    store = bob.InMemorySessionStore()
    AgentRuntime(ScriptedLlm(["hello"]), tools(), store=store, events=JsonlEventSink(first),
                 action_mode="native").run(AgentRequest("hi", "s1"))
    rt = AgentRuntime(ScriptedLlm([calls(("x", "add", {"a": 2, "b": 2})), "4"]), tools(),
                      store=store, events=JsonlEventSink(second), action_mode="native")
    rt.run(AgentRequest("sum", "s1"))
    [loaded] = of(second, "session_loaded")
    assert [m["content"] for m in loaded["messages"]] == ["hi", "hello"]
    report = bob.replay(second)
    assert report.ok and report.turns == ["turn 1: same (2 LLM calls, 1 tool calls, final)"]


# ---- 3. Replays that are the same ---------------------------------------------------------------

def test_a_multi_turn_run_replays_the_same_twenty_times(tmp_path):
    path = tmp_path / "t.jsonl"
    results = big_run(path)
    assert [r.finish_reason for r in results] == [
        FinishReason.FINAL, FinishReason.FINAL, FinishReason.GUARD_EXCEEDED,
        FinishReason.CANCELLED]
    assert results[2].guard_reason is GuardReason.LOOP_DETECTED
    assert of(path, "parse_error")      # the re-prompt is in the trace
    assert len(of(path, "session_loaded")) == 1   # later turns continue from the trace
    for _ in range(20):
        report = bob.replay(path)
        assert report.ok, str(report)
    assert report.turns == ["turn 1: same (3 LLM calls, 3 tool calls, final)",
                            "turn 2: same (2 LLM calls, 0 tool calls, final)",
                            "turn 3: same (3 LLM calls, 2 tool calls, guard_exceeded)",
                            "turn 4: same (1 LLM calls, 1 tool calls, cancelled)"]


@pytest.mark.parametrize("where", ["llm", "model_answered", "after_batch"])
def test_turns_cancelled_at_each_point_replay_the_same(tmp_path, hang, where):
    path = tmp_path / "t.jsonl"
    release = hang()

    def slow(req, cancel):
        release.wait(10)
        return "never"

    first = slow if where == "llm" else calls(("c1", "add", {"a": 1, "b": 2}))
    on = {"llm": lambda e: e.kind == "llm_call_started",
          "model_answered": lambda e: e.kind == "action_parsed",
          "after_batch": lambda e: e.kind == "tool_call_completed"}[where]
    [r] = record(path, [first, "3"], ["go"], cancel_on=on)
    assert r.finish_reason is FinishReason.CANCELLED
    report = bob.replay(path)
    assert report.ok, str(report)


def test_a_json_mode_run_replays_the_same(tmp_path):
    path = tmp_path / "t.jsonl"
    replies = [json.dumps({"type": "tool_call", "name": "add", "arguments": {"a": 1, "b": 2}}),
               "not json", json.dumps({"type": "final", "content": "3"})]
    record(path, replies, ["sum"], mode="json")
    assert bob.replay(path).ok


def test_a_turn_that_raised_replays_the_same(tmp_path):
    path = tmp_path / "t.jsonl"
    with pytest.raises(bob.LlmError):
        record(path, [bob.LlmError("the endpoint is down")], ["hi"])
    assert bob.replay(path).ok


def test_a_reply_with_reasoning_replays_the_same(tmp_path):
    """DeepSeek's thinking mode: the reasoning goes back with the tool calls, so the next
    request holds it; the replayed reply must carry it too, or that request differs."""
    path = tmp_path / "t.jsonl"
    thought = LlmResponse("", (ToolCall("c1", "add", {"a": 1, "b": 2}),), reasoning="1 + 2")
    record(path, [thought, "3"], ["sum"])
    assert bob.replay(path).ok


def test_replay_llm_and_tools_in_a_hand_wired_runtime(tmp_path):
    """The pytest recipe of the README: record once, then replay in CI."""
    path = tmp_path / "t.jsonl"
    record(path, [calls(("c1", "add", {"a": 1, "b": 2})), "3"], ["sum"])
    llm, port = ReplayLlm(path), ReplayTools(path)
    r = AgentRuntime(llm, port, action_mode="native").run(AgentRequest("sum", "s1"))
    assert r.content == "3" and llm.divergence is None and port.divergence is None
    assert llm.left_over == 0


# ---- 4. Divergences -----------------------------------------------------------------------------

def test_a_changed_tool_result_with_real_tools(tmp_path):
    path = tmp_path / "t.jsonl"
    record(path, [calls(("c1", "add", {"a": 1, "b": 2})), "3"], ["sum"])

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b + 1

    report = bob.replay(path, tools=FunctionTools([add, shout]))
    assert not report.ok and report.turn == 1 and report.step == 1
    assert report.what == "tool_call_completed content"
    assert (report.recorded, report.new) == ("3", "4")
    assert bob.replay(path, tools=tools()).ok


def test_a_changed_system_prompt_shows_the_differing_message(tmp_path):
    path = tmp_path / "t.jsonl"
    record(path, ["hello"], ["hi"], system_prompt="Be brief.\nAlways.")
    report = bob.replay(path, system_prompt="Be brief.\nNever.")
    assert not report.ok and (report.turn, report.step) == (1, 1)
    assert report.what == "LLM request 1 differs from the recorded"
    assert report.detail == "  message 0 (system) differs"   # the digests are above it
    assert "recorded:" in str(report) and "message 0" in str(report)


def test_a_changed_user_message_is_found_in_history(tmp_path):
    path = tmp_path / "t.jsonl"
    record(path, [calls(("c1", "add", {"a": 1, "b": 2})), "3"], ["sum"])
    lines = path.read_text().splitlines()
    i = next(n for n, line in enumerate(lines) if '"tool_call_completed"' in line)
    lines[i] = lines[i].replace('"content": "3"', '"content": "5"')
    path.write_text("\n".join(lines) + "\n")
    report = bob.replay(path)   # the recorded result no longer gives the recorded request 2
    assert not report.ok and report.step == 2 and "request 2" in report.what


def test_a_tighter_max_steps_now_trips_a_guard(tmp_path):
    path = tmp_path / "t.jsonl"
    big_run(path)
    report = bob.replay(path, policy=TurnPolicy(max_steps=2))
    assert not report.ok and report.turn == 1
    assert report.new["kind"] == "guard_tripped" and report.new["reason"] == "max_steps"
    assert report.recorded["kind"] == "llm_call_started"


@pytest.mark.parametrize("cut", ["half_line", "whole_lines"])
def test_a_truncated_trace_says_which_line(tmp_path, cut):
    path = tmp_path / "t.jsonl"
    big_run(path)
    text = path.read_text()
    lines = text.splitlines()
    if cut == "half_line":
        path.write_text("\n".join(lines[:10]) + "\n" + lines[10][:20] + "\n")
        with pytest.raises(TraceError, match="line 11 is not a trace event"):
            bob.replay(path)
    else:
        path.write_text("\n".join(lines[:-3]) + "\n")
        last_start = max(n for n, line in enumerate(lines, 1) if '"turn_started"' in line)
        with pytest.raises(TraceError, match=f"starts at line {last_start} has no turn_completed"):
            bob.replay(path)


def test_a_reply_left_over(tmp_path):
    path = tmp_path / "t.jsonl"
    record(path, [calls(("c1", "add", {"a": 1, "b": 2})), "3"], ["sum"])
    llm = ReplayLlm(path)
    # an agent that stops earlier than the recorded one: the policy allows one LLM call
    r = AgentRuntime(llm, ReplayTools(path), action_mode="native",
                     policy=TurnPolicy(max_steps=1)).run(AgentRequest("sum", "s1"))
    assert r.guard_reason is GuardReason.MAX_STEPS and llm.left_over == 1
    report = bob.replay(path, policy=TurnPolicy(max_steps=1))   # through replay() too
    assert not report.ok and report.recorded["kind"] == "llm_call_started"


def test_a_request_with_no_recorded_reply(tmp_path):
    path = tmp_path / "t.jsonl"
    record(path, ["hello"], ["hi"])
    llm = ReplayLlm(path)
    rt = AgentRuntime(llm, ReplayTools(path), action_mode="native")
    rt.run(AgentRequest("hi", "s1"))
    with pytest.raises(bob.LlmError, match="LLM request 2 has no recorded reply"):
        rt.run(AgentRequest("again", "s1"))
    assert llm.divergence == "LLM request 2 has no recorded reply"


def test_a_tool_call_never_recorded(tmp_path):
    path = tmp_path / "t.jsonl"
    record(path, [calls(("c1", "add", {"a": 1, "b": 2})), "3"], ["sum"])
    port = ReplayTools(path)
    llm = ScriptedLlm([calls(("c1", "add", {"a": 2, "b": 2})), "4"])
    r = AgentRuntime(llm, port, action_mode="native").run(AgentRequest("sum", "s1"))
    assert "never recorded" in r.history[2].content and r.history[2].is_error
    assert port.divergence == ('tool call c1 add({"a": 2, "b": 2}) was never recorded; '
                               'recorded: add({"a": 1, "b": 2})')
    # through replay(): a batch refused in the recording runs under a looser policy
    refused = tmp_path / "refused.jsonl"
    record(refused, [calls(("c1", "add", {"a": 1, "b": 2}), ("c2", "add", {"a": 2, "b": 2}))],
           ["sum"], policy=TurnPolicy(max_tool_calls=1))
    report = bob.replay(refused, policy=TurnPolicy())
    assert not report.ok and report.what == 'tool call c1 add({"a": 1, "b": 2}) was never recorded'
    assert report.recorded.startswith("not run:")


def test_replay_never_calls_the_model_and_reads_only_events(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"kind": "turn_started"}\n')
    with pytest.raises(TraceError, match="line 1 is not a trace event"):
        bob.replay(path)
    with pytest.raises(TraceError, match="cannot read"):
        bob.replay(tmp_path / "missing.jsonl")
    path.write_text("")
    with pytest.raises(TraceError, match="has no turn_started"):
        bob.replay(path)


# ---- 5. The OpenAI adapter ----------------------------------------------------------------------

def test_a_trace_recorded_with_the_openai_adapter_replays_without_it(tmp_path):
    path = tmp_path / "t.jsonl"
    with FakeOpenAI([tool_calls_reply([("add", {"a": 1, "b": 2}), ("shout", {"text": "x"})]),
                     "3 and X"]) as srv:
        llm = bob.OpenAICompatLlm("openai:gpt-x", base_url=srv.url, api_key="sk-test")
        rt = AgentRuntime(llm, tools(), events=JsonlEventSink(path), action_mode="native")
        assert rt.run(AgentRequest("go")).content == "3 and X"
        llm.close()
    assert of(path, "turn_started")[0]["model"].startswith("openai:gpt-x at http://127.0.0.1")
    assert "sk-test" not in path.read_text()
    report = bob.replay(path)        # the server is gone: replay must not need it
    assert report.ok, str(report)
    assert report.turns == ["turn 1: same (2 LLM calls, 2 tool calls, final)"]


@pytest.mark.parametrize("slow_first", [False, True])
def test_a_turn_cancelled_while_a_tool_ran_replays_the_same(tmp_path, hang, slow_first):
    """The interrupted call before or after the one that ended (a replay runs them in order)."""
    path = tmp_path / "t.jsonl"
    release, fast_done, token = hang(), threading.Event(), CancelToken()

    def fast(a: int) -> int:
        """Quick."""
        fast_done.set()
        return a

    def slow(a: int) -> int:
        """Slow: the turn is cancelled while it runs."""
        fast_done.wait(10)
        token.cancel()
        release.wait(10)
        return a

    port = FunctionTools([fast, slow])
    batch = [("c1", "fast", {"a": 1}), ("c2", "slow", {"a": 2})][::-1 if slow_first else 1]
    rt = AgentRuntime(ScriptedLlm([calls(*batch)]), port, events=JsonlEventSink(path),
                      action_mode="native")
    r = rt.run(AgentRequest("go", "s1"), token)
    assert r.finish_reason is FinishReason.CANCELLED
    results = [m.content[:12] for m in r.history[2:]]
    assert results == (["interrupted:", "1"] if slow_first else ["1", "interrupted:"])
    for _ in range(20):
        report = bob.replay(path)
        assert report.ok, str(report)


def test_denied_calls_a_turn_timeout_and_a_failing_store_replay_the_same(tmp_path, hang):
    path = tmp_path / "t.jsonl"
    release = hang()

    class FullDisk(bob.InMemorySessionStore):
        def save(self, session_id, state):
            raise bob.StoreError("disk full")

    def slow(req, cancel):
        release.wait(10)
        return "late"

    [denied, timed_out] = record(
        path, [calls(("c1", "shout", {"text": "x"})), "ok", slow], ["one", "two"],
        deny_tools=["shout"], store=FullDisk(), policy=TurnPolicy(turn_timeout_ms=300))
    assert "denied" in denied.history[2].content
    assert timed_out.guard_reason is GuardReason.TURN_TIMEOUT
    assert [d["where"] for d in of(path, "error")] == ["store.save", "store.save"]
    assert len(of(path, "session_loaded")) == 2   # the save failed: turn 2 starts afresh
    report = bob.replay(path)       # waits out the recorded 300 ms again
    assert report.ok, str(report)


def test_arguments_too_deep_to_keep_are_recorded_refused_and_replay_the_same(tmp_path):
    path, deep = tmp_path / "t.jsonl", {"a": 1}
    for _ in range(1000):
        deep = {"a": deep}
    [r] = record(path, [calls(("c1", "add", deep)), "done"], ["go"])
    assert "nests deeper than 100" in r.history[2].content and r.content == "done"
    [recorded] = of(path, "llm_call_completed")[0]["tool_calls"]
    assert recorded["arguments"] == {} and "nests deeper" in recorded["error"]
    report = bob.replay(path)
    assert report.ok, str(report)


def test_a_trace_with_a_malformed_turn_is_a_trace_error(tmp_path):
    path = tmp_path / "t.jsonl"
    record(path, ["hello"], ["hi"])
    lines = path.read_text().replace('"max_steps": 12', '"max_steps": "many"')
    path.write_text(lines)
    with pytest.raises(TraceError, match="the turn that starts at line 1 cannot be replayed"):
        bob.replay(path)


# ---- 6. Approvals -------------------------------------------------------------------------------

def test_approver_decisions_replay_the_same(tmp_path):
    path = tmp_path / "t.jsonl"

    def approver(call):
        if call.arguments["text"] == "no":
            return bob.Approval(False, "not today")
        return bob.Approval(True, arguments={"text": "changed"})

    replies = [calls(("c1", "shout", {"text": "no"}), ("c2", "shout", {"text": "yes"}),
                     ("c3", "add", {"a": 1, "b": 1})), "done"]
    [r] = record(path, replies, ["go"], ask_tools=["shout"], approver=approver)
    assert [m.content for m in r.history[2:5]] == [
        "the user declined this call: not today", "CHANGED", "2"]
    report = bob.replay(path)
    assert report.ok, str(report)
    edited = path.read_text().replace('"reason": "not today"', '"reason": "never"')
    path.write_text(edited)
    report = bob.replay(path)
    assert not report.ok and report.what == "tool_call_completed content"
    assert report.new == "the user declined this call: never"


def test_a_paused_turn_and_its_resume_replay_the_same_even_alone(tmp_path):
    path, second = tmp_path / "t.jsonl", tmp_path / "resume.jsonl"
    store = bob.JsonFileSessionStore(tmp_path / "sessions")
    rt = AgentRuntime(ScriptedLlm([calls(("c1", "shout", {"text": "a"}))]), tools(),
                      store=store, events=JsonlEventSink(path), action_mode="native",
                      ask_tools=["shout"])
    paused = rt.run(AgentRequest("go", "s1"))
    assert paused.finish_reason is FinishReason.NEEDS_APPROVAL
    later = AgentRuntime(ScriptedLlm(["A it is"]), tools(), store=store,
                         events=JsonlEventSink(second), action_mode="native", ask_tools=["shout"])
    done = later.run(AgentRequest(None, "s1", approvals={"c1": bob.Approval(True)}))
    assert done.content == "A it is"
    path.write_text(path.read_text() + second.read_text())
    report = bob.replay(path)
    assert report.ok and report.turns[0].endswith("needs_approval)"), str(report)
    alone = bob.replay(second)        # the paused batch comes from session_loaded
    assert alone.ok, str(alone)


# ---- 6. Speed: a replay port answers on the loop's thread ---------------------------------------

def test_replay_ports_answer_on_the_loops_thread_and_live_tools_on_a_worker(tmp_path):
    """ReplayLlm and ReplayTools answer from memory: no thread hand-off per step (two a step
    were a third or more of a replay's time, bench/replay_speed.py). A live tool still runs on a
    worker."""
    path = tmp_path / "t.jsonl"
    record(path, [calls(("c1", "add", {"a": 1, "b": 2})), "3"], ["sum"])
    threads = []

    class Llm(ReplayLlm):
        _answers_inline = True   # a subclass says so itself (bob._inline)

        def complete(self, req, cancel, on_delta=None):
            threads.append(("llm", threading.current_thread()))
            return super().complete(req, cancel, on_delta)

    class Tools(ReplayTools):
        _answers_inline = True

        def list_tools(self):
            threads.append(("list", threading.current_thread()))
            return super().list_tools()

        def call_tool(self, call, timeout_s, cancel=None):
            threads.append(("tool", threading.current_thread()))
            return super().call_tool(call, timeout_s, cancel)

    def add(a: int, b: int) -> int:
        """Add two integers."""
        threads.append(("live tool", threading.current_thread()))
        return a + b

    r = AgentRuntime(Llm(path), Tools(path), action_mode="native").run(AgentRequest("sum", "s1"))
    assert r.content == "3"
    me = threading.current_thread()
    assert threads == [("list", me), ("llm", me), ("tool", me), ("llm", me)]
    threads.clear()
    r = AgentRuntime(Llm(path), FunctionTools([add, shout]), action_mode="native").run(
        AgentRequest("sum", "s1"))
    assert r.content == "3"
    assert [(what, t is me) for what, t in threads] == [
        ("llm", True), ("live tool", False), ("llm", True)]


def test_a_hung_live_tool_in_a_replay_still_times_out(tmp_path, hang):
    """--live-tools: a live tool may block, so it keeps its worker thread and its deadline."""
    path, release = tmp_path / "t.jsonl", hang()
    record(path, [calls(("c1", "add", {"a": 1, "b": 2})), "3"], ["sum"])

    def add(a: int, b: int) -> int:
        """Add two integers."""
        release.wait(10)   # (the recorded description: only the result differs)
        return a + b

    t0 = time.monotonic()
    report = bob.replay(path, tools=FunctionTools([add, shout]),
                        policy=TurnPolicy(tool_timeout_ms=200))
    assert time.monotonic() - t0 < 2.0
    assert not report.ok and report.what == "tool_call_completed content"
    assert report.new == "tool 'add' timed out after 200 ms"


def test_a_cancel_from_another_thread_ends_a_replayed_turn_within_100_ms(tmp_path):
    path = tmp_path / "t.jsonl"
    n = 200
    replies = [calls((f"c{i}", "add", {"a": i, "b": 1})) for i in range(n)] + ["done"]
    [r] = record(path, replies, ["count"], policy=TurnPolicy(max_steps=n + 1, max_tool_calls=n))
    assert r.content == "done"
    token = CancelToken()
    cancelled_at = []

    def cancel():
        cancelled_at.append(time.monotonic())
        token.cancel()

    class CancelAtStep10:
        def emit(self, event):   # cancels from another thread, mid-turn
            if event.kind == "llm_call_completed" and event.step == 10:
                other = threading.Thread(target=cancel)
                other.start()
                other.join()

    rt = AgentRuntime(ReplayLlm(path), ReplayTools(path), events=CancelAtStep10(),
                      policy=TurnPolicy(max_steps=n + 1, max_tool_calls=n), action_mode="native")
    r = rt.run(AgentRequest("count", "s1"), token)
    assert time.monotonic() - cancelled_at[0] < 0.1
    assert r.finish_reason is FinishReason.CANCELLED and r.steps == 10
