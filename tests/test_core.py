"""Tests of bob's turn loop: guards, cancel and deadlines, parallel batches, the JSON action
parser, history truncation, events, policy validation, usage and import hygiene.

Everything runs real threads through a real AgentRuntime with ScriptedLlm and FunctionTools.
No sleeps synchronise anything: blocking ports wait on threading.Events (see conftest.hang).

Sections: 1. Helpers  2. Guards  3. Cancel and deadlines  4. Parallel batches
          5. JSON actions  6. Truncation  7. Events  8. Policy, usage, import, ScriptedLlm
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bob
from conftest import (Counter, ListSink, agent, assert_tripped, assert_well_formed, batch,
                      cancel_once_entered, final, tc, wait_until)
from bob import (AgentError, AgentRequest, AgentRuntime, CancelToken, CompositeToolPort,
                 ConfigError, FinishReason,
                 FunctionTools, GuardReason, LlmError, LlmResponse, Message, ScriptedLlm,
                 ToolCall, TurnPolicy, Usage)

ROOT = Path(__file__).resolve().parent.parent


# ---- 1. Helpers ---------------------------------------------------------------------------------

# ---- 2. Guards ----------------------------------------------------------------------------------

def test_max_steps_allows_exactly_n_llm_calls():
    c = Counter()
    rt = agent([tc("echo", x=1), tc("echo", x=2), final("done")], tools=c.tools(), max_steps=3)
    r = rt.run(AgentRequest("go"))
    assert (r.finish_reason, r.steps, r.content) == (FinishReason.FINAL, 3, "done")


def test_max_steps_trips_when_call_n_plus_1_is_needed():
    c = Counter()
    sink = ListSink()
    rt = agent([tc("echo", x=1), tc("echo", x=2), tc("echo", x=3), final("never")],
               tools=c.tools(), events=sink, max_steps=3)
    r = rt.run(AgentRequest("go"))
    assert_tripped(r, GuardReason.MAX_STEPS, "max_steps")
    assert len(rt.llm.requests) == 3 and r.steps == 3 and len(c.calls) == 3
    [trip] = sink.of("guard_tripped")
    assert trip["reason"] == "max_steps" and "max_steps=3" in trip["detail"]


def test_max_tool_calls_reaching_exactly_n_still_answers():
    c = Counter()
    rt = agent([tc("echo", x=1), tc("echo", x=2), final("done")], tools=c.tools(),
               max_tool_calls=2)
    r = rt.run(AgentRequest("go"))
    assert (r.finish_reason, r.tool_calls, len(c.calls)) == (FinishReason.FINAL, 2, 2)


def test_max_tool_calls_batch_that_would_pass_n_trips_without_running():
    c = Counter()
    rt = agent([batch(("c1", "echo", {"x": 1})),
                batch(("c2", "echo", {"x": 2}), ("c3", "echo", {"x": 3})), "never"],
               tools=c.tools(), mode="native", max_tool_calls=2)
    r = rt.run(AgentRequest("go"))
    assert_tripped(r, GuardReason.MAX_TOOL_CALLS, "max_tool_calls")
    assert len(c.calls) == 1 and r.tool_calls == 1   # nothing of the second batch ran
    refused = [m for m in r.history if m.role == "tool"][1:]
    assert [m.tool_call_id for m in refused] == ["c2", "c3"]
    assert all(m.is_error and "not run" in m.content for m in refused)


def test_max_consecutive_errors_trips_before_the_next_llm_call():
    c = Counter()
    rt = agent([tc("fail", n=1), tc("fail", n=2), final("never")], tools=c.tools(),
               max_consecutive_errors=2)
    r = rt.run(AgentRequest("go"))
    assert_tripped(r, GuardReason.MAX_CONSECUTIVE_ERRORS, "max_consecutive_errors")
    assert len(rt.llm.requests) == 2 and len(c.calls) == 2


def test_a_success_resets_the_error_streak():
    c = Counter()
    rt = agent([tc("fail", n=1), tc("echo", x=1), tc("fail", n=2), final("done")],
               tools=c.tools(), max_consecutive_errors=2)
    assert rt.run(AgentRequest("go")).finish_reason is FinishReason.FINAL


def test_unknown_tools_count_as_consecutive_errors():
    rt = agent([tc("nope", x=1), tc("nope", x=2), final("never")], tools=Counter().tools(),
               max_consecutive_errors=2)
    assert_tripped(rt.run(AgentRequest("go")), GuardReason.MAX_CONSECUTIVE_ERRORS,
                   "max_consecutive_errors")


def test_loop_detected_on_third_identical_batch_with_any_key_order():
    c = Counter()
    reordered = '{"type": "tool_call", "name": "echo", "arguments": {"b": 2, "a": 1}}'
    rt = agent([tc("echo", a=1, b=2), reordered, tc("echo", a=1, b=2), final("never")],
               tools=c.tools())
    r = rt.run(AgentRequest("go"))
    assert_tripped(r, GuardReason.LOOP_DETECTED, "max_repeated_batches")
    assert len(c.calls) == 2                          # the third batch never ran
    assert r.history[-1].is_error and "not run" in r.history[-1].content


def test_loop_detection_respects_a_custom_limit():
    c = Counter()
    rt = agent([tc("echo", x=1), tc("echo", x=1), final("never")], tools=c.tools(),
               max_repeated_batches=1)
    assert_tripped(rt.run(AgentRequest("go")), GuardReason.LOOP_DETECTED, "max_repeated_batches")
    assert len(c.calls) == 1


def test_stagnation_on_same_text_more_than_n_times():
    c = Counter()
    replies = [batch((f"c{i}", "echo", {"x": i}), text="let me look") for i in range(4)]
    rt = agent(replies + ["never"], tools=c.tools(), mode="native", max_stagnation_steps=2)
    r = rt.run(AgentRequest("go"))
    assert_tripped(r, GuardReason.STAGNATION, "max_stagnation_steps")
    assert len(rt.llm.requests) == 3 and len(c.calls) == 2


def test_stagnation_catches_a_b_a_oscillation():
    c = Counter()
    a, b = tc("echo", x=1), tc("echo", x=2)
    rt = agent([a, b, a, b, a, final("never")], tools=c.tools(), max_stagnation_steps=2,
               max_repeated_batches=10)
    r = rt.run(AgentRequest("go"))
    assert_tripped(r, GuardReason.STAGNATION, "max_stagnation_steps")
    assert len(rt.llm.requests) == 5 and len(c.calls) == 4


def test_stagnation_never_blocks_a_final_answer():
    c = Counter()
    replies = [batch((f"c{i}", "echo", {"x": i}), text="same") for i in range(2)]
    rt = agent(replies + [LlmResponse("same")], tools=c.tools(), mode="native",
               max_stagnation_steps=2)
    r = rt.run(AgentRequest("go"))
    assert (r.finish_reason, r.content) == (FinishReason.FINAL, "same")


def test_ask_user_ends_the_turn_with_the_question():
    rt = agent(['{"type": "ask_user", "question": "Which file?"}'])
    r = rt.run(AgentRequest("edit it"))
    assert (r.finish_reason, r.content) == (FinishReason.ASK_USER, "Which file?")


# ---- 3. Cancel and deadlines --------------------------------------------------------------------

def blocking_llm(entered: threading.Event, release: threading.Event):
    """A reply that hangs (ignoring cancel) until released, like a stuck HTTP request."""
    def reply(req, cancel):
        entered.set()
        release.wait(10)
        return final("too late")
    return reply


def blocking_tools(entered: threading.Event, release: threading.Event) -> FunctionTools:
    def stuck() -> str:
        """Hangs until released."""
        entered.set()
        release.wait(10)
        return "too late"

    def quick() -> str:
        """Returns at once."""
        return "quick result"
    return FunctionTools([stuck, quick])


def run_and_cancel(rt: AgentRuntime, entered: threading.Event):
    token = CancelToken()
    stamp = cancel_once_entered(entered, token)
    r = rt.run(AgentRequest("go", session_id="c"), cancel=token)
    return r, time.monotonic() - stamp["t"]


def test_cancel_while_the_llm_blocks_forever(hang):
    entered, release = threading.Event(), hang()
    before = bob.abandoned_workers()
    rt = agent([blocking_llm(entered, release)])
    r, latency = run_and_cancel(rt, entered)
    assert r.finish_reason is FinishReason.CANCELLED and r.guard_reason is None
    assert latency < 0.1, f"cancel took {latency * 1000:.0f} ms"
    assert [m.role for m in r.history] == ["user"]
    assert bob.abandoned_workers() >= before + 1      # the hung worker is counted...
    release.set()
    assert wait_until(lambda: bob.abandoned_workers() <= before)   # ...until it ends


class HungListing:
    """A ToolPort whose list_tools blocks (e.g. a tool server that never answers)."""

    def __init__(self, entered, release):
        self.entered, self.release = entered, release

    def list_tools(self):
        self.entered.set()
        self.release.wait()
        return []

    def call_tool(self, call, timeout_s, cancel=None):
        raise AssertionError("never called")


def test_cancel_while_list_tools_blocks_keeps_the_users_message(hang):
    entered, release = threading.Event(), hang()
    rt = agent(["never"], tools=HungListing(entered, release))
    r, latency = run_and_cancel(rt, entered)
    assert r.finish_reason is FinishReason.CANCELLED and latency < 0.1
    assert [(m.role, m.content) for m in rt.store.load("c").messages] == [("user", "go")]


def test_a_list_tools_that_hangs_past_the_deadline_is_a_turn_timeout(hang):
    entered, release = threading.Event(), hang()
    rt = agent(["never"], tools=HungListing(entered, release), turn_timeout_ms=150)
    r = rt.run(AgentRequest("go"))
    assert (r.finish_reason, r.guard_reason) == (FinishReason.GUARD_EXCEEDED,
                                                 GuardReason.TURN_TIMEOUT)
    assert "listing the tools" in r.content and "turn_timeout_ms=150" in r.content


def test_cancel_while_a_tool_blocks_forever(hang):
    entered, release = threading.Event(), hang()
    before = bob.abandoned_workers()
    rt = agent([tc("stuck"), final("never")], tools=blocking_tools(entered, release))
    r, latency = run_and_cancel(rt, entered)
    assert r.finish_reason is FinishReason.CANCELLED
    assert latency < 0.1, f"cancel took {latency * 1000:.0f} ms"
    assert_well_formed(r.history)
    last = r.history[-1]
    assert last.role == "tool" and last.is_error and "interrupted" in last.content
    release.set()
    assert wait_until(lambda: bob.abandoned_workers() <= before)


def test_cancel_mid_batch_keeps_finished_results_and_interrupts_the_rest(hang):
    entered, release, quick_done = threading.Event(), hang(), threading.Event()

    def quick() -> str:
        """Returns at once."""
        quick_done.set()
        return "quick result"

    def stuck() -> str:
        """Hangs until released; says it is in only once quick has returned."""
        quick_done.wait(5)
        entered.set()
        release.wait(10)
        return "too late"

    rt = agent([batch(("c1", "quick", {}), ("c2", "stuck", {})), "never"], mode="native",
               tools=FunctionTools([quick, stuck]))
    r, latency = run_and_cancel(rt, entered)
    assert r.finish_reason is FinishReason.CANCELLED and latency < 0.1
    assert_well_formed(r.history)
    quick, stuck = r.history[-2:]
    assert (quick.content, quick.is_error) == ("quick result", False)
    assert stuck.is_error and "interrupted" in stuck.content


def test_a_cancel_just_before_the_batch_runs_no_tool():
    token, ran = CancelToken(), threading.Event()

    def write() -> str:
        """A tool with a side effect."""
        ran.set()
        return "written"

    class CancelOnAction:            # e.g. a UI sink whose user presses Ctrl-C at this moment
        def emit(self, event):
            if event.kind == "action_parsed":
                token.cancel()

    rt = AgentRuntime(ScriptedLlm([tc("write"), final("never")]), FunctionTools([write]),
                      events=CancelOnAction())
    r = rt.run(AgentRequest("go"), cancel=token)
    assert r.finish_reason is FinishReason.CANCELLED
    assert_well_formed(r.history)
    assert "interrupted" in r.history[-1].content
    assert not ran.wait(0.2), "the tool ran after the turn was cancelled"


def test_a_cancel_during_a_batch_ends_the_turn_when_the_batch_ends():
    token, sink = CancelToken(), ListSink()

    def stop(x: int) -> str:
        """Cancel the turn, then answer."""
        token.cancel()
        return "stopped"
    rt = agent([tc("stop", x=1), final("never")], tools=bob.FunctionTools([stop]), events=sink)
    r = rt.run(AgentRequest("go"), cancel=token)
    assert r.finish_reason is FinishReason.CANCELLED and r.history[-1].content == "stopped"
    assert [(e["from"], e["to"]) for e in sink.of("state")][-1] == ("call_tool", "done")
    assert len(rt.llm.requests) == 1


def test_a_cancelled_token_stops_before_any_llm_call():
    token = CancelToken()
    token.cancel()
    rt = agent([final("never")])
    r = rt.run(AgentRequest("go"), cancel=token)
    assert r.finish_reason is FinishReason.CANCELLED and rt.llm.requests == []


def test_turn_deadline_while_the_llm_blocks(hang):
    entered, release = threading.Event(), hang()
    rt = agent([blocking_llm(entered, release)], turn_timeout_ms=200)
    t0 = time.monotonic()
    r = rt.run(AgentRequest("go"))
    assert_tripped(r, GuardReason.TURN_TIMEOUT, "turn_timeout_ms")
    assert 0.19 <= time.monotonic() - t0 < 0.5


def test_turn_deadline_while_a_tool_blocks(hang):
    entered, release = threading.Event(), hang()
    rt = agent([tc("stuck"), final("never")], tools=blocking_tools(entered, release),
               turn_timeout_ms=250)
    t0 = time.monotonic()
    r = rt.run(AgentRequest("go"))
    assert_tripped(r, GuardReason.TURN_TIMEOUT, "turn_timeout_ms")
    assert time.monotonic() - t0 < 0.6
    assert r.history[-1].is_error and "timed out" in r.history[-1].content


# ---- 4. Parallel batches ------------------------------------------------------------------------

def test_batch_results_come_back_in_call_order_even_when_finishing_reversed():
    done_order: list[str] = []
    fast_done = threading.Event()

    def slow() -> str:
        """Finishes only after fast."""
        assert fast_done.wait(2), "fast never ran: the batch is not concurrent"
        done_order.append("slow")
        return "slow result"

    def fast() -> str:
        """Finishes first."""
        done_order.append("fast")
        fast_done.set()
        return "fast result"

    rt = agent([batch(("c1", "slow", {}), ("c2", "fast", {})), "done"], mode="native",
               tools=FunctionTools([slow, fast]))
    r = rt.run(AgentRequest("go"))
    assert done_order == ["fast", "slow"]
    tools = [m for m in r.history if m.role == "tool"]
    assert [(m.tool_call_id, m.content) for m in tools] == [("c1", "slow result"),
                                                           ("c2", "fast result")]
    assert_well_formed(r.history)
    assert r.finish_reason is FinishReason.FINAL


def test_batch_calls_really_run_concurrently():
    ping_in, pong_in = threading.Event(), threading.Event()

    def ping() -> str:
        """Waits for pong."""
        ping_in.set()
        return "met" if pong_in.wait(0.5) else "alone"

    def pong() -> str:
        """Waits for ping."""
        pong_in.set()
        return "met" if ping_in.wait(0.5) else "alone"

    rt = agent([batch(("c1", "ping", {}), ("c2", "pong", {})), "done"], mode="native",
               tools=FunctionTools([ping, pong]))
    r = rt.run(AgentRequest("go"))
    assert [m.content for m in r.history if m.role == "tool"] == ["met", "met"]


def test_duplicate_call_ids_in_a_batch_keep_the_prompt_well_formed():
    c = Counter()
    rt = agent([batch(("same", "echo", {"x": 1}), ("same", "echo", {"x": 2})), "done"],
               mode="native", tools=c.tools())
    r = rt.run(AgentRequest("go"))
    assert r.finish_reason is FinishReason.FINAL and len(c.calls) == 2
    wire = rt.llm.requests[1].messages[1:]
    assert len(wire) == 4, [(m.role, m.tool_call_id) for m in wire]
    assert_well_formed(wire)
    assert len({m.tool_call_id for m in wire if m.role == "tool"}) == 2


def test_batch_over_max_parallel_tools_runs_nothing_and_the_loop_goes_on():
    c = Counter()
    calls = [(f"c{i}", "echo", {"x": i}) for i in range(3)]
    rt = agent([batch(*calls), "fine, one at a time"], mode="native", tools=c.tools(),
               max_parallel_tools=2)
    r = rt.run(AgentRequest("go"))
    assert (r.finish_reason, r.content) == (FinishReason.FINAL, "fine, one at a time")
    assert c.calls == [] and r.tool_calls == 0
    refused = [m for m in r.history if m.role == "tool"]
    assert [m.tool_call_id for m in refused] == ["c0", "c1", "c2"]
    assert all(m.is_error and "max_parallel_tools=2" in m.content for m in refused)
    assert_well_formed(r.history)


# ---- 5. JSON actions ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ('  \n {"type": "final", "content": "hi"} \n\t', bob.Final("hi")),
    ('```json\n{"type": "final", "content": "hi"}\n```', bob.Final("hi")),
    ('```\n{"type": "ask_user", "question": "why?"}\n```', bob.AskUser("why?")),
    ('```JSON\n{"type": "final", "content": "hi"}\n```', bob.Final("hi")),
    ('{"type": "tool_call", "name": "add", "arguments": {"a": 1}}',
     bob.CallTools((ToolCall("call_1", "add", {"a": 1}),))),
    ('{"type": "tool_call", "name": "now"}', bob.CallTools((ToolCall("call_1", "now", {}),))),
    ('<think>\nThey want {x}; "final" it is.\n</think>\n\n{"type": "final", "content": "hi"}',
     bob.Final("hi")),
    ('<think></think>```json\n{"type": "final", "content": "hi"}\n```', bob.Final("hi")),
])
def test_parse_action_accepts(text, expected):
    assert bob.parse_action(text) == expected


def test_a_reasoning_models_think_block_costs_no_re_prompt():
    # Qwen3, DeepSeek-R1 and QwQ, served as they often are, put <think>...</think> before the
    # action: every reply was malformed twice and every turn an AgentError.
    think = "<think>\nThe user greets me. I answer with a final action.\n</think>\n\n"
    r = AgentRuntime(ScriptedLlm([think + final("hello")])).run(AgentRequest("hi"))
    assert (r.finish_reason, r.content, r.steps) == (FinishReason.FINAL, "hello", 1)


@pytest.mark.parametrize("text, says", [
    ("", "empty"),
    ("Sure! Here you go.", "not valid JSON"),
    ('<think>never closed {"type": "final", "content": "a"}', "not valid JSON"),
    ('<think>a</think> words {"type": "final", "content": "a"}', "not valid JSON"),
    ('{"type": "final", "content": "a"} {"type": "final", "content": "b"}', "not valid JSON"),
    ('[{"type": "final", "content": "a"}]', "JSON object"),
    ('"final"', "JSON object"),
    ('{"type": "answer", "content": "a"}', '"type" must be'),
    ('{"content": "a"}', '"type" must be'),
    ('{"type": "final"}', '"content"'),
    ('{"type": "final", "content": 42}', '"content"'),
    ('{"type": "ask_user"}', '"question"'),
    ('{"type": "tool_call", "arguments": {}}', '"name"'),
    ('{"type": "tool_call", "name": "", "arguments": {}}', '"name"'),
    ('{"type": "tool_call", "name": "x", "arguments": [1, 2]}', '"arguments"'),
    ('{"type": "tool_call", "name": "x", "arguments": "{\\"a\\": 1}"}', '"arguments"'),
])
def test_parse_action_rejects_with_a_reason(text, says):
    with pytest.raises(bob.ActionParseError) as err:
        bob.parse_action(text)
    assert says in str(err.value)
    assert isinstance(err.value, bob.BobError)


def test_a_bad_reply_gets_one_corrective_reprompt_then_succeeds():
    sink = ListSink()
    rt = agent(["I think the answer is 4", final("4")], events=sink)
    r = rt.run(AgentRequest("2+2?"))
    assert (r.finish_reason, r.content) == (FinishReason.FINAL, "4")
    second = rt.llm.requests[1].messages
    assert second[-1].role == "user" and "not valid JSON" in second[-1].content
    assert "I think the answer is 4" in second[-1].content
    assert sink.of("parse_error") == [{"error": sink.of("parse_error")[0]["error"], "attempt": 1}]


def test_parse_failures_reset_after_a_valid_action():
    c = Counter()
    rt = agent(["oops", tc("echo", x=1), "oops again", final("ok")], tools=c.tools())
    assert rt.run(AgentRequest("go")).finish_reason is FinishReason.FINAL


def test_two_bad_replies_in_a_row_raise_agent_error_and_the_session_is_saved():
    rt = agent(["not json", '["still", "not", "an object"]', final("never")])
    with pytest.raises(AgentError, match="twice"):
        rt.run(AgentRequest("hello there", session_id="s1"))
    saved = rt.store.load("s1")
    assert saved is not None and saved.messages[0] == Message("user", "hello there")


# ---- 6. Truncation ------------------------------------------------------------------------------

@st.composite
def histories(draw):
    """Histories as blocks ((start, end) of each non-system block), maybe led by orphans."""
    msgs: list[Message] = []
    blocks: list[tuple[int, int]] = []
    if draw(st.booleans()):
        msgs.append(Message("system", "sys"))
    for j in range(draw(st.integers(0, 2))):       # results of calls cut off a stored history
        msgs.append(Message("tool", f"orphan{j}", tool_call_id=f"gone{j}", name="t"))
    for b in range(draw(st.integers(0, 14))):
        kind = draw(st.sampled_from(["user", "assistant", "calls", "calls", "system"]))
        start = len(msgs)
        if kind == "system":
            msgs.append(Message("system", f"sys{b}"))
            continue
        if kind == "calls":
            calls = tuple(ToolCall(f"b{b}c{j}", "t", {}) for j in range(draw(st.integers(1, 3))))
            msgs.append(Message("assistant", f"a{b}", calls))
            msgs += [Message("tool", f"r{c.id}", tool_call_id=c.id, name="t") for c in calls]
        else:
            msgs.append(Message(kind, f"{kind}{b}"))
        blocks.append((start, len(msgs)))
    limit = draw(st.integers(1, 20))
    starts = [s for s, _ in blocks]
    keep_from = draw(st.none() | st.sampled_from(starts)) if starts else None
    return msgs, blocks, limit, keep_from


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories())
def test_truncate_history_never_orphans_tool_results(case):
    msgs, blocks, limit, keep_from = case
    out = bob.truncate_history(msgs, limit, keep=keep_from)
    index = {id(m): i for i, m in enumerate(msgs)}
    kept = [index[id(m)] for m in out]
    assert kept == sorted(set(kept)), "output is not a subsequence of the input"
    system = [i for i, m in enumerate(msgs) if m.role == "system"]
    forced_len = next((e - s for s, e in blocks if keep_from is not None and s <= keep_from < e), 0)
    n_sys = min(len(system), max(0, limit - forced_len))   # system messages count, go last
    assert [i for i in kept if msgs[i].role == "system"] == system[len(system) - n_sys:]
    if keep_from is not None:
        assert keep_from in kept
    assert not any(m.content.startswith("orphan") for m in out)
    assert_well_formed([m for m in out if m.role != "system"])
    for p, m in enumerate(out):        # each result follows its call, only results in between
        if m.role == "tool":
            q = p - 1
            while out[q].role == "tool":
                q -= 1
            assert m.tool_call_id in [c.id for c in out[q].tool_calls]
    body = [i for i in kept if msgs[i].role != "system"]
    forced = [list(range(s, e)) for s, e in blocks if keep_from is not None and s <= keep_from < e]
    if len(kept) > limit:            # only the unit holding keep_from may pass the limit
        assert [body] == forced and n_sys == 0
    dropped = [(s, e) for s, e in blocks if s not in kept]
    if dropped:                      # and nothing is dropped that need not be
        assert len(kept) + dropped[-1][1] - dropped[-1][0] > limit


def test_truncate_history_drops_results_whose_call_is_gone():
    msgs = [Message("tool", "orphan", tool_call_id="x", name="t"), Message("user", "hi")]
    assert bob.truncate_history(msgs, 10) == [Message("user", "hi")]


def test_truncate_history_keeps_the_unit_holding_keep_from():
    call = ToolCall("a", "t", {})
    msgs = [Message("user", "u0"), Message("assistant", "", (call,)),
            Message("tool", "r", tool_call_id="a", name="t"), Message("user", "u1")]
    out = bob.truncate_history(msgs, 1, keep=2)
    assert msgs[2] in out and msgs[1] in out


def test_the_prompt_never_exceeds_max_history_messages_in_a_long_session():
    c = Counter()
    replies = []
    for i in range(10):
        replies += [tc("echo", x=i), final(f"answer {i}")]
    rt = agent(replies, tools=c.tools(), max_history_messages=5)
    for i in range(10):
        r = rt.run(AgentRequest(f"question {i}", session_id="long"))
        assert r.finish_reason is FinishReason.FINAL
    assert len(r.history) == 40
    for req in rt.llm.requests:
        roles = [m.role for m in req.messages]
        assert roles[0] == "system" and roles.count("system") == 1
        assert len(req.messages) <= 5 + 1
    for i in range(10):                 # each turn's question is always in its prompts
        for req in rt.llm.requests[2 * i:2 * i + 2]:
            assert any(m.content == f"question {i}" for m in req.messages)


# ---- 7. Events ----------------------------------------------------------------------------------

FULL_TURN_KINDS = [
    "session_loaded", "turn_started", "state", "state", "llm_call_started", "llm_call_completed",
    "state", "action_parsed", "state", "tool_call_started", "tool_call_completed", "state", "state",
    "llm_call_started", "llm_call_completed", "state", "action_parsed", "state", "turn_completed"]


def two_step_agent(events) -> AgentRuntime:
    c = Counter()
    return AgentRuntime(ScriptedLlm([LlmResponse(tc("echo", x=7), usage=Usage(10, 2)),
                                     LlmResponse(final("seven"), usage=Usage(12, 3))]),
                        c.tools(), events=events)


def test_jsonl_trace_of_a_full_turn(tmp_path):
    path = tmp_path / "trace.jsonl"
    sink = bob.JsonlEventSink(path)
    two_step_agent(sink).run(AgentRequest("seven?", session_id="ev"))
    sink.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["kind"] for e in events] == FULL_TURN_KINDS
    assert {e["session_id"] for e in events} == {"ev"}
    states = [e["data"] for e in events if e["kind"] == "state"]
    assert states[0]["from"] == "start" and states[-1]["to"] == "done"
    for prev, cur in zip(states, states[1:]):
        assert prev["to"] == cur["from"]
    for s in states:
        assert bob.State(s["to"]) in bob.TRANSITIONS[bob.State(s["from"])]
    start = events[1]["data"]
    assert start["input"] == "seven?" and [t["name"] for t in start["tools"]] == ["echo", "fail"]
    assert events[-1]["data"] == {"finish_reason": "final", "guard_reason": None, "steps": 2,
                                  "tool_calls": 1, "content": "seven",
                                  "usage": {"prompt_tokens": 22, "completion_tokens": 5}}
    done = [e["data"] for e in events if e["kind"] == "tool_call_completed"]
    assert done[0]["name"] == "echo" and done[0]["is_error"] is False
    assert [e["step"] for e in events if e["kind"] == "llm_call_started"] == [1, 2]


def test_text_deltas_arrive_between_llm_call_events():
    class StreamingLlm:
        def complete(self, req, cancel, on_delta=None):
            text = final("streamed")
            for i in range(0, len(text), 7):
                on_delta(text[i:i + 7])
            return LlmResponse(text)

    sink = ListSink()
    AgentRuntime(StreamingLlm(), events=sink).run(AgentRequest("go"))
    kinds = sink.kinds()
    first, last = kinds.index("text_delta"), len(kinds) - 1 - kinds[::-1].index("text_delta")
    assert kinds.index("llm_call_started") < first and last < kinds.index("llm_call_completed")
    assert "".join(d["text"] for d in sink.of("text_delta")) == final("streamed")


def test_a_raising_sink_breaks_nothing_and_other_sinks_get_every_event():
    class BrokenSink:
        def emit(self, event):
            raise RuntimeError("sink down")

    good = ListSink()
    r = two_step_agent([BrokenSink(), good]).run(AgentRequest("seven?"))
    assert r.content == "seven" and good.kinds() == FULL_TURN_KINDS


def test_secret_arguments_are_redacted_in_events(tmp_path):
    def login(user: str, api_key: str) -> str:
        """Log in."""
        return "ok" if api_key == "sk-SECRET-123" else "bad key"

    path = tmp_path / "trace.jsonl"
    sink, mem = bob.JsonlEventSink(path), ListSink()
    rt = AgentRuntime(ScriptedLlm([tc("login", user="bob", api_key="sk-SECRET-123"),
                                   final("in")]), FunctionTools([login]), events=[sink, mem])
    r = rt.run(AgentRequest("log in"))
    sink.close()
    assert r.history[2].content == "ok"                     # the tool got the real key
    assert mem.of("tool_call_started")[0]["arguments"] == {"user": "bob", "api_key": "***"}
    assert "sk-SECRET-123" not in path.read_text()


# ---- 8. Policy, usage, import, ScriptedLlm ------------------------------------------------------

POLICY_FIELDS = [f.name for f in dataclasses.fields(TurnPolicy)]


@pytest.mark.parametrize("field", POLICY_FIELDS)
@pytest.mark.parametrize("bad", [0, -1, True, "5", 2.5])
def test_turn_policy_rejects_bad_values_naming_the_field(field, bad):
    with pytest.raises(ConfigError) as err:
        TurnPolicy(**{field: bad})
    assert isinstance(err.value, ValueError) and field in str(err.value)


def test_turn_policy_defaults_match_the_design():
    assert TurnPolicy() == TurnPolicy(12, 8, 3, 90_000, 15_000, 50, 8, 2, 5, 20_000)


def test_usage_is_summed_per_turn_and_per_session():
    rt = AgentRuntime(ScriptedLlm([LlmResponse(tc("echo", x=1), usage=Usage(10, 2)),
                                   LlmResponse(final("a"), usage=Usage(12, 3)),
                                   LlmResponse(final("b"), usage=Usage(30, 4))]),
                      Counter().tools())
    first = rt.run(AgentRequest("one", session_id="u"))
    second = rt.run(AgentRequest("two", session_id="u"))
    assert first.usage == Usage(22, 5) and second.usage == Usage(30, 4)
    saved = rt.store.load("u")
    assert saved.usage == Usage(52, 9) and saved.usage.total_tokens == 61
    assert saved.version == 2


def test_import_needs_neither_mcp_nor_requests_and_has_no_side_effects(tmp_path):
    code = ("import sys, os, threading\n"
            "sys.modules['mcp'] = None\nsys.modules['requests'] = None\n"
            "import bob\n"
            "assert threading.active_count() == 1, threading.enumerate()\n"
            "assert os.listdir('.') == [], os.listdir('.')\n"
            "print('imported', bob.__name__)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "imported bob" and proc.stderr == ""
    assert list(tmp_path.iterdir()) == []


def test_scripted_llm_out_of_replies_raises_llm_error_after_saving():
    rt = agent([])
    with pytest.raises(LlmError, match="no reply left"):
        rt.run(AgentRequest("anyone?", session_id="empty"))
    assert rt.store.load("empty").messages == [Message("user", "anyone?")]


def test_scripted_llm_exception_reply_is_raised():
    rt = agent([LlmError("HTTP 500 from the server", status_code=500)])
    with pytest.raises(LlmError) as err:
        rt.run(AgentRequest("go"))
    assert err.value.status_code == 500


def test_health_reports_tools_and_workers():
    report = agent([], tools=Counter().tools()).health()
    assert report["ok"] is True and report["tools"] == 2 and "abandoned_workers" in report


def test_a_tool_call_with_no_tool_port_is_an_unknown_tool_result():
    rt = agent([tc("ls"), final("no tools then")])
    r = rt.run(AgentRequest("go"))
    assert r.finish_reason is FinishReason.FINAL and r.content == "no tools then"
    assert r.history[2].is_error
    assert "unknown tool 'ls'; available tools: none" in r.history[2].content


class RaisingListing:
    """A ToolPort whose list_tools raises, like a tool server that is gone."""

    def list_tools(self):
        raise RuntimeError("tool server gone")

    def call_tool(self, call, timeout_s, cancel=None):
        raise AssertionError("never called")


class OddSchema(RaisingListing):
    """A schema json cannot encode: refused at Start, naming the tool (it was an internal
    error in build_prompt until the JSON check knew values JSON does not have)."""

    def list_tools(self):
        return [bob.ToolDescriptor("odd", "odd", {"type": "object", "x": object()})]


@pytest.mark.parametrize("tools, message", [
    (RaisingListing(), "listing the tools failed: RuntimeError: tool server"),
    (OddSchema(), "tool 'odd': its input schema holds a value of type object"),
])
def test_an_error_inside_a_turn_is_an_agent_error_after_saving(tools, message):
    rt = agent(["never"], tools=tools)
    with pytest.raises(AgentError, match=message):
        rt.run(AgentRequest("keep me", session_id="s"))
    assert rt.store.load("s").messages[-1].content == "keep me"


def test_a_store_that_cannot_load_raises_and_saves_nothing(tmp_path):
    (tmp_path / "s.json").write_text("{not json")
    rt = AgentRuntime(ScriptedLlm(["never"]), store=bob.JsonFileSessionStore(tmp_path))
    with pytest.raises(bob.StoreError, match="s.json is corrupt"):
        rt.run(AgentRequest("hi", session_id="s"))
    assert (tmp_path / "s.json").read_text() == "{not json"     # nothing was overwritten


def test_refused_calls_do_not_count_against_max_tool_calls():
    c = Counter()
    rt = AgentRuntime(ScriptedLlm([tc("nope"), tc("fs__write_x"), tc("echo", x=1), final("ok")]),
                      CompositeToolPort([c.tools(), FunctionTools([fs__write_x])]),
                      policy=TurnPolicy(max_tool_calls=1), deny_tools=["fs__write_*"])
    r = rt.run(AgentRequest("go"))
    assert (r.finish_reason, r.tool_calls) == (FinishReason.FINAL, 1)
    assert [name for name, _ in c.calls] == ["echo"]


def fs__write_x() -> str:
    """A denied tool."""
    raise AssertionError("a denied tool must never run")


def test_port_calls_that_ignore_cancel_are_capped(hang):
    release = hang()
    n = bob._MAX_ABANDONED - bob.abandoned_workers()
    entered = [threading.Event() for _ in range(n)]
    rt = agent([blocking_llm(e, release) for e in entered] + ["never"])
    for e in entered:   # each turn's model call hangs, ignoring the cancel that ends the turn
        assert run_and_cancel(rt, e)[0].finish_reason is FinishReason.CANCELLED
    assert bob.abandoned_workers() >= bob._MAX_ABANDONED
    with pytest.raises(AgentError, match="earlier port calls are still hung"):
        rt.run(AgentRequest("one more", session_id="c"))
    assert rt.store.load("c").messages[-1].content == "one more"


def test_a_tool_port_returning_something_else_is_an_error_result():
    class Sloppy:
        def list_tools(self):
            return [bob.ToolDescriptor("t", "t", {"type": "object"})]

        def call_tool(self, call, timeout_s, cancel=None):
            return "not a ToolResult"

    r = agent([tc("t"), final("ok")], tools=Sloppy()).run(AgentRequest("go"))
    assert r.finish_reason is FinishReason.FINAL
    assert r.history[2].is_error and "returned str, not a ToolResult" in r.history[2].content


def test_a_tool_result_whose_content_is_not_text_is_an_error_result():
    class Sloppy:
        def list_tools(self):
            return [bob.ToolDescriptor("t", "t", {"type": "object"})]

        def call_tool(self, call, timeout_s, cancel=None):
            return bob.ToolResult(call.id, call.name, 42)   # type: ignore[arg-type]

    r = agent([tc("t"), final("ok")], tools=Sloppy()).run(AgentRequest("go"))
    assert r.finish_reason is FinishReason.FINAL
    assert r.history[2].is_error
    assert "returned a ToolResult whose content is int, not a ToolResult with text" in (
        r.history[2].content)


def test_health_reports_a_hung_tool_listing_in_time(hang):
    entered, release = threading.Event(), hang()
    t0 = time.monotonic()
    report = agent([], tools=HungListing(entered, release)).health(timeout_s=0.2)
    assert time.monotonic() - t0 < 1.0
    assert report["ok"] is False and "did not answer in 0.2 s" in report["tools_error"]
    assert agent([]).health() == {"ok": True, "tools": 0, "action_mode": "json",
                                  "abandoned_workers": bob.abandoned_workers()}


def test_a_turn_that_raises_completes_without_a_finish_reason():
    sink = ListSink()
    with pytest.raises(LlmError):
        agent([LlmError("down")], events=sink).run(AgentRequest("go"))
    done = [e for e in sink.events if e.kind == "turn_completed"]
    assert len(done) == 1 and done[0].data["finish_reason"] is None
