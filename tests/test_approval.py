"""Tests of tool approval: `ask_tools` with an approver callback, and pause and resume.

Through the public API only: a real AgentRuntime, ScriptedLlm, FunctionTools, and the real
JsonFileSessionStore for a resume in a fresh runtime. Blocking approvers wait on
threading.Events (conftest.hang), never on sleeps.

Sections: 1. Helpers  2. The approver callback  3. Pause and resume  4. Cancel and deadline
"""
from __future__ import annotations

import json
import threading
import time

import pytest

import bob
from bob import (AgentError, AgentRequest, AgentRuntime, Approval, Cancelled, CancelToken,
                 FinishReason, GuardReason, JsonFileSessionStore, ScriptedLlm, TurnPolicy)
from conftest import ListSink, assert_well_formed, batch, cancel_once_entered, final, tc


# ---- 1. Helpers ---------------------------------------------------------------------------------

class Tools:
    """`echo` and `write`, recording every call that really ran."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, int]] = []

    def port(self) -> bob.FunctionTools:
        def echo(x: int) -> str:
            """Echo x."""
            self.ran.append(("echo", x))
            return f"echo {x}"

        def write(x: int) -> str:
            """Pretend to write x."""
            self.ran.append(("write", x))
            return f"wrote {x}"
        return bob.FunctionTools([echo, write])


def runtime(replies, tools: Tools, *, store=None, sink=None, mode="json", **kw) -> AgentRuntime:
    policy = TurnPolicy(**kw.pop("policy", {}))
    return AgentRuntime(ScriptedLlm(replies), tools.port(), store=store, events=sink,
                        action_mode=mode, policy=policy, ask_tools=("write",), **kw)


def tool_messages(history):
    return [m for m in history if m.role == "tool"]


# ---- 2. The approver callback -------------------------------------------------------------------

def test_an_approved_call_runs_and_both_events_say_so():
    tools, sink, asked = Tools(), ListSink(), []

    def approver(call):
        asked.append((call.name, call.arguments))
        return Approval(True)
    rt = runtime([tc("echo", x=1), tc("write", x=2), final("done")], tools, sink=sink,
                 approver=approver)
    r = rt.run(AgentRequest("go"))
    assert r.finish_reason is FinishReason.FINAL and r.content == "done"
    assert asked == [("write", {"x": 2})]          # echo does not match ask_tools
    assert tools.ran == [("echo", 1), ("write", 2)]
    [req] = sink.of("approval_requested")
    assert req["name"] == "write" and req["arguments"] == {"x": 2} and req["call_id"]
    assert sink.of("approval_decided") == [{"call_id": req["call_id"], "allow": True,
                                            "arguments_changed": False, "reason": "",
                                            "arguments": None}]


def test_a_declined_call_does_not_run_and_the_model_hears_the_reason():
    tools = Tools()
    rt = runtime([tc("write", x=2), final("ok")], tools,
                 approver=lambda call: Approval(False, "not on Fridays"))
    r = rt.run(AgentRequest("go"))
    assert tools.ran == []
    [result] = tool_messages(r.history)
    assert result.is_error and "declined" in result.content and "not on Fridays" in result.content
    seen = rt.llm.requests[1].messages[-1].content          # what the model was sent
    assert "not on Fridays" in seen
    assert r.finish_reason is FinishReason.FINAL


def test_edited_arguments_run_and_are_what_history_and_trace_record():
    tools, sink = Tools(), ListSink()
    rt = runtime([tc("write", x=2), final("ok")], tools, sink=sink,
                 approver=lambda call: Approval(True, arguments={"x": 7}))
    r = rt.run(AgentRequest("go"))
    assert tools.ran == [("write", 7)]
    [call_msg] = [m for m in r.history if m.tool_calls]
    assert call_msg.tool_calls[0].arguments == {"x": 7}
    assert sink.of("tool_call_started")[0]["arguments"] == {"x": 7}
    assert sink.of("approval_decided")[0]["arguments_changed"] is True


def test_an_approver_that_fails_declines_the_call_with_the_error_text():
    def approver(call):
        raise RuntimeError("policy server down")
    tools = Tools()
    r = runtime([tc("write", x=2), final("ok")], tools, approver=approver).run(AgentRequest("go"))
    [result] = tool_messages(r.history)
    assert tools.ran == [] and result.is_error and "policy server down" in result.content


def test_an_approver_raising_cancelled_ends_the_turn_cancelled():
    def approver(call):
        raise Cancelled("user pressed Ctrl-C")
    tools = Tools()
    r = runtime([batch(("a", "echo", {"x": 1}), ("b", "write", {"x": 2})), final("never")],
                tools, mode="native", approver=approver).run(AgentRequest("go"))
    assert r.finish_reason is FinishReason.CANCELLED
    assert tools.ran == []                                # nothing of the batch ran
    assert_well_formed(r.history)
    assert all("interrupted" in m.content for m in tool_messages(r.history))


@pytest.mark.parametrize("arguments, says", [
    ({"x": float("nan")}, "holds NaN or Infinity"),
    ({"x": 10 ** 5000}, "holds an integer over 4,000 digits long"),
])
def test_unfit_arguments_from_the_approver_decline_the_call(arguments, says):
    tools, sink = Tools(), ListSink()
    rt = runtime([tc("write", x=2), final("ok")], tools, sink=sink,
                 approver=lambda call: Approval(True, arguments=arguments))
    r = rt.run(AgentRequest("go"))
    assert r.finish_reason is FinishReason.FINAL and tools.ran == []
    [result] = tool_messages(r.history)
    assert result.is_error and "the approver's arguments were unfit: it " + says in result.content
    assert sink.of("approval_decided")[0]["allow"] is False


def test_deny_wins_over_ask():
    tools, asked = Tools(), []
    rt = runtime([tc("write", x=2), final("ok")], tools, deny_tools=("write",),
                 approver=lambda call: asked.append(call) or Approval(True))
    r = rt.run(AgentRequest("go"))
    assert asked == [] and tools.ran == []
    [result] = tool_messages(r.history)
    assert "deny_tools" in result.content


# ---- 3. Pause and resume ------------------------------------------------------------------------

def test_pause_then_resume_in_a_fresh_runtime_over_the_same_file_store(tmp_path):
    tools, sink = Tools(), ListSink()
    first = runtime([tc("write", x=2)], tools, store=JsonFileSessionStore(tmp_path), sink=sink)
    r = first.run(AgentRequest("go", session_id="s"))
    assert r.finish_reason is FinishReason.NEEDS_APPROVAL and tools.ran == []
    [call] = r.pending
    assert (call.name, call.arguments) == ("write", {"x": 2})
    assert r.history[-1].tool_calls == (call,)          # saved with the assistant's call
    assert sink.of("approval_requested")[0]["call_id"] == call.id

    later = runtime([final("written")], tools, store=JsonFileSessionStore(tmp_path))
    r2 = later.run(AgentRequest(None, session_id="s", approvals={call.id: Approval(True)}))
    assert r2.finish_reason is FinishReason.FINAL and r2.content == "written"
    assert tools.ran == [("write", 2)] and r2.pending == ()
    assert_well_formed(r2.history)
    assert [m.role for m in r2.history] == ["user", "assistant", "tool", "assistant"]


def test_guards_count_across_the_pause_as_one_turn(tmp_path):
    store, tools = JsonFileSessionStore(tmp_path), Tools()
    policy = {"max_steps": 1}
    r = runtime([tc("write", x=2)], tools, store=store, policy=policy).run(AgentRequest("go"))
    r2 = runtime([final("no step left")], tools, store=store, policy=policy).run(
        AgentRequest(None, approvals={r.pending[0].id: Approval(True)}))
    assert tools.ran == [("write", 2)]
    assert r2.finish_reason is FinishReason.GUARD_EXCEEDED
    assert r2.guard_reason is GuardReason.MAX_STEPS and r2.steps == 1


def test_a_resume_takes_up_only_the_guards_counts_from_the_session(tmp_path):
    store, tools = JsonFileSessionStore(tmp_path), Tools()
    r = runtime([tc("write", x=2)], tools, store=store).run(AgentRequest("go", session_id="s"))
    path = store.path_for("s")
    saved = json.loads(path.read_text())
    saved["paused"]["guard"]["remaining_s"] = 0   # a name of the guard's, not one of its counts
    path.write_text(json.dumps(saved))
    r2 = runtime([final("written")], tools, store=store).run(
        AgentRequest(None, session_id="s", approvals={r.pending[0].id: Approval(True)}))
    assert (r2.finish_reason, r2.content, tools.ran) == (FinishReason.FINAL, "written",
                                                         [("write", 2)])


def test_a_resumed_turn_saves_the_session_as_no_longer_paused(tmp_path):
    store, tools = JsonFileSessionStore(tmp_path), Tools()
    r = runtime([tc("write", x=2)], tools, store=store).run(AgentRequest("go", session_id="s"))
    assert store.load("s").paused is not None
    runtime([final("written")], tools, store=store).run(
        AgentRequest(None, session_id="s", approvals={r.pending[0].id: Approval(True)}))
    assert store.load("s").paused is None


def test_the_batches_after_a_resumed_one_are_guarded_again(tmp_path):
    store, tools = JsonFileSessionStore(tmp_path), Tools()
    policy = {"max_parallel_tools": 2}
    r = runtime([tc("write", x=2)], tools, store=store, policy=policy).run(AgentRequest("go"))
    too_many = batch(("e1", "echo", {"x": 1}), ("e2", "echo", {"x": 2}), ("e3", "echo", {"x": 3}))
    r2 = runtime([too_many, final("done")], tools, store=store, policy=policy,
                 mode="native").run(AgentRequest(None, approvals={r.pending[0].id: Approval(True)}))
    assert tools.ran == [("write", 2)]   # the resumed batch ran; the next one, too big, did not
    assert r2.finish_reason is FinishReason.FINAL
    assert "this batch has 3 calls" in tool_messages(r2.history)[-1].content


def test_a_call_left_without_a_decision_pauses_again(tmp_path):
    store, tools = JsonFileSessionStore(tmp_path), Tools()
    reply = batch(("a", "write", {"x": 1}), ("b", "echo", {"x": 2}), ("c", "write", {"x": 3}))
    r = runtime([reply], tools, store=store, mode="native").run(AgentRequest("go"))
    assert [c.id for c in r.pending] == ["a", "c"]
    r2 = runtime([], tools, store=store, mode="native").run(
        AgentRequest(None, approvals={"a": Approval(False, "no")}))
    assert r2.finish_reason is FinishReason.NEEDS_APPROVAL
    assert [c.id for c in r2.pending] == ["c"] and tools.ran == []   # the whole batch waits
    r3 = runtime([final("done")], tools, store=store, mode="native").run(
        AgentRequest(None, approvals={"c": Approval(True, arguments={"x": 30})}))
    assert r3.finish_reason is FinishReason.FINAL
    assert sorted(tools.ran) == [("echo", 2), ("write", 30)]   # in parallel; a stays declined
    results = tool_messages(r3.history)
    assert [m.tool_call_id for m in results] == ["a", "b", "c"]
    assert "declined" in results[0].content and "no" in results[0].content
    assert_well_formed(r3.history)


def test_new_input_while_calls_wait_answers_them_not_run_first(tmp_path):
    store, tools = JsonFileSessionStore(tmp_path), Tools()
    runtime([tc("write", x=2)], tools, store=store).run(AgentRequest("go"))
    r = runtime([final("fine")], tools, store=store).run(AgentRequest("never mind"))
    assert r.finish_reason is FinishReason.FINAL and tools.ran == []
    assert [m.role for m in r.history] == ["user", "assistant", "tool", "user", "assistant"]
    assert r.history[2].is_error and "not run" in r.history[2].content
    assert_well_formed(r.history)
    with pytest.raises(AgentError, match="no tool calls waiting"):   # nothing waits any more
        runtime([], tools, store=store).run(AgentRequest(None, approvals={}))


# ---- 4. Cancel and deadline ---------------------------------------------------------------------

def blocking_approver(entered: threading.Event, release: threading.Event):
    def approver(call):
        entered.set()
        release.wait(10)
        return Approval(True)
    return approver


def test_cancel_during_a_slow_approver_returns_within_100_ms(hang):
    entered, tools, token = threading.Event(), Tools(), CancelToken()
    rt = runtime([tc("write", x=2), final("never")], tools,
                 approver=blocking_approver(entered, hang()))
    stamp = cancel_once_entered(entered, token)
    r = rt.run(AgentRequest("go"), cancel=token)
    latency = time.monotonic() - stamp["t"]
    assert r.finish_reason is FinishReason.CANCELLED
    assert latency < 0.1, f"cancel took {latency * 1000:.0f} ms"
    assert tools.ran == [] and "interrupted" in r.history[-1].content
    assert_well_formed(r.history)


def test_approver_time_counts_against_the_turn_deadline(hang):
    entered, tools = threading.Event(), Tools()
    rt = runtime([tc("write", x=2)], tools, approver=blocking_approver(entered, hang()),
                 policy={"turn_timeout_ms": 200})
    r = rt.run(AgentRequest("go"))
    assert r.guard_reason is GuardReason.TURN_TIMEOUT and "approver" in r.content
    assert tools.ran == []
    assert_well_formed(r.history)


def test_a_resume_that_stops_before_calltool_keeps_the_pause(tmp_path):
    store, tools = JsonFileSessionStore(tmp_path), Tools()
    r = runtime([tc("write", x=2)], tools, store=store).run(AgentRequest("go"))
    call_id = r.pending[0].id
    with pytest.raises(bob.ConfigError, match="must be an Approval"):
        runtime([], tools, store=store).run(AgentRequest(None, approvals={call_id: True}))
    cancelled = CancelToken()
    cancelled.cancel()
    r2 = runtime([], tools, store=store).run(
        AgentRequest(None, approvals={call_id: Approval(True)}), cancel=cancelled)
    assert r2.finish_reason is FinishReason.CANCELLED and tools.ran == []
    r3 = runtime([final("done")], tools, store=store).run(
        AgentRequest(None, approvals={call_id: Approval(True)}))
    assert r3.finish_reason is FinishReason.FINAL and tools.ran == [("write", 2)]
    assert_well_formed(r3.history)
