"""Tests of the scheduler under hostile model output and long turns: a context-overflow answer
from a real HTTP endpoint (retried once with half the history), replies with tens of thousands
of tool calls (refused in linear time; cancel still holds), and `max_history_messages` held at
every step of a long turn.

Sections: 1. Context overflow  2. Huge replies  3. History cap inside a turn
"""
from __future__ import annotations

import gc
import time

import pytest
from fake_openai import FakeOpenAI

import bob
from bob import (AgentRequest, AgentRuntime, CancelToken, FinishReason, FunctionTools, LlmError,
                 LlmResponse, Message, OpenAICompatLlm, ScriptedLlm, ToolCall, TurnPolicy)
from conftest import ListSink, assert_well_formed, final

TOO_LONG = {"status": 400, "body": {"error": {
    "message": "This model's maximum context length is 8192 tokens. However, your messages "
               "resulted in 9000 tokens.", "code": "context_length_exceeded"}}}


def echo(x: int = 0) -> str:
    """Echo x."""
    return f"echo {x}"


def long_history(n: int) -> list[Message]:
    """n messages of earlier turns: questions and answers."""
    return [Message("user" if i % 2 == 0 else "assistant", f"old {i}") for i in range(n)]


# ---- 1. Context overflow ------------------------------------------------------------------------

LLAMA_CPP_TOO_LONG = {"status": 400, "body": {"error": {
    "code": 400, "message": "the request exceeds the available context size, try increasing it",
    "type": "exceed_context_size_error"}}}


@pytest.mark.parametrize("refusal", [TOO_LONG, LLAMA_CPP_TOO_LONG], ids=["openai", "llama.cpp"])
def test_context_overflow_is_retried_once_with_half_the_history(refusal):
    sink = ListSink()
    with FakeOpenAI([refusal, final("short enough")]) as srv:
        llm = OpenAICompatLlm("test:gpt-x", base_url=srv.url, api_key="sk-test")
        rt = AgentRuntime(llm, events=sink, policy=TurnPolicy(max_history_messages=50))
        r = rt.run(AgentRequest("question", history=long_history(40)))
        sent = [len(q["body"]["messages"]) - 1 for q in srv.requests]   # minus the system one
    assert r.finish_reason is FinishReason.FINAL and r.content == "short enough"
    assert sent == [41, 20]
    [cut] = sink.of("history_truncated")
    assert (cut["from"], cut["to"]) == (41, 20) and len(cut["digest"]) == 64
    assert srv.requests[1]["body"]["messages"][-1]["content"] == "question"
    assert len(r.history) == 42                          # the session itself is not cut


def test_context_overflow_down_to_the_input_alone_gives_up_with_the_llm_error():
    with FakeOpenAI([TOO_LONG] * 4 + ["never"]) as srv:
        llm = OpenAICompatLlm("test:gpt-x", base_url=srv.url, api_key="sk-test")
        rt = AgentRuntime(llm)
        with pytest.raises(LlmError, match="context") as e:
            rt.run(AgentRequest("question", history=long_history(10)))
        sizes = [len(q["body"]["messages"]) for q in srv.requests]
    assert sizes == [12, 6, 3, 2]     # halved while it shrinks: then system + input only
    assert e.value.status_code == 400


def test_another_400_is_not_retried():
    with FakeOpenAI([{"status": 400, "body": "bad temperature"}, "never"]) as srv:
        llm = OpenAICompatLlm("test:gpt-x", base_url=srv.url, api_key="sk-test")
        with pytest.raises(LlmError):
            AgentRuntime(llm).run(AgentRequest("question", history=long_history(10)))
        assert len(srv.requests) == 1


# ---- 2. Huge replies ----------------------------------------------------------------------------

def huge_reply(n: int) -> LlmResponse:
    """A native reply with n tool calls with distinct ids (so checking them for repeats is a
    full search when done naively)."""
    return LlmResponse("", tuple(ToolCall(f"id{i}", "echo", {"x": i}) for i in range(n)))


def test_a_reply_with_20000_calls_is_a_malformed_reply():
    """More calls than any batch may hold is garbage: one corrective re-prompt naming the limit,
    and no 20,000 "not run" results in the session (they stayed there for ever)."""
    rt = AgentRuntime(ScriptedLlm([huge_reply(20_000), final("ok")]), FunctionTools([echo]),
                      action_mode="native")
    r = rt.run(AgentRequest("go"))
    assert r.finish_reason is FinishReason.FINAL and r.tool_calls == 0
    assert not [m for m in r.history if m.role == "tool"] and len(r.history) <= 4
    fix = rt.llm.requests[1].messages[-1]
    assert "20000 tool calls" in fix.content and "at most 8 tools at a time" in fix.content
    assert_well_formed(r.history)


def test_a_reply_of_1000_calls_is_still_an_over_size_batch_that_gets_results():
    rt = AgentRuntime(ScriptedLlm([huge_reply(1_000), final("ok")]), FunctionTools([echo]),
                      action_mode="native")
    r = rt.run(AgentRequest("go"))
    results = [m for m in r.history if m.role == "tool"]
    assert len(results) == 1_000 and all("max_parallel_tools" in m.content for m in results)
    assert r.finish_reason is FinishReason.FINAL and r.tool_calls == 0
    assert_well_formed(r.history)
    assert len(rt.llm.requests[1].messages) <= 1 + 50            # the cap holds, unit or not


class CancelAt:
    """An event sink that cancels the turn when the model's reply arrives. Sinks run on the
    scheduler's thread, so the stamps start where bob's remaining work starts."""

    def __init__(self, token: CancelToken) -> None:
        self.token, self.wall, self.cpu = token, 0.0, 0.0

    def emit(self, event: bob.AgentEvent) -> None:
        if event.kind == "llm_call_completed":
            self.wall, self.cpu = time.monotonic(), time.thread_time()
            self.token.cancel()


def test_cancel_while_a_20000_call_reply_is_handled_returns_within_100_ms():
    token = CancelToken()
    sink = CancelAt(token)
    rt = AgentRuntime(ScriptedLlm([huge_reply(20_000)]), FunctionTools([echo]),
                      action_mode="native", events=sink)
    gc.collect()   # what earlier tests left is not this turn's work: collections during the
    gc.freeze()    # turn must not scan it
    try:
        r = rt.run(AgentRequest("go"), cancel=token)
    finally:
        gc.unfreeze()
    # bob's own work on this thread (the quadratic id check took 4.6 s of it), apart from what
    # other processes take of the CPU; the wall-clock bound catches a wait instead of work
    cpu, wall = time.thread_time() - sink.cpu, time.monotonic() - sink.wall
    assert r.finish_reason is FinishReason.CANCELLED
    assert cpu < 0.1, f"cancel took {cpu * 1000:.0f} ms of CPU ({wall * 1000:.0f} ms wall)"
    assert wall < 1.0, f"cancel took {wall * 1000:.0f} ms ({cpu * 1000:.0f} ms of CPU)"
    assert_well_formed(r.history)


# ---- 3. History cap inside a turn ---------------------------------------------------------------

def test_max_history_messages_holds_at_every_step_of_a_long_turn():
    replies = [LlmResponse("", (ToolCall(f"c{i}", "echo", {"x": i}),)) for i in range(30)]
    rt = AgentRuntime(ScriptedLlm([*replies, "done"]), FunctionTools([echo]),
                      action_mode="native", policy=TurnPolicy(
                          max_history_messages=4, max_steps=40, max_tool_calls=40,
                          max_repeated_batches=40))
    r = rt.run(AgentRequest("the question", history=long_history(6)))
    assert r.finish_reason is FinishReason.FINAL and r.steps == 31
    for req in rt.llm.requests:
        body = req.messages[1:]
        assert len(body) <= 4, [m.content for m in body]
        assert "the question" in [m.content for m in body]   # the current question stays
        assert_well_formed(body)                             # a call keeps its result
    last = rt.llm.requests[-1].messages[1:]      # the next unit (2 messages) would pass 4
    assert [(m.role, m.tool_call_id) for m in last] == [
        ("user", None), ("assistant", None), ("tool", "c29")]
