"""Tests of the trace as a complete record: what turn_started, session_loaded, the LLM calls
and the tool calls carry, that refused calls are started too, and that secrets stay masked.

Runs are recorded through a real AgentRuntime into a real JsonlEventSink file and read back.
Sections: 1. Helpers  2. The trace
"""
from __future__ import annotations

import json
from pathlib import Path

import bob
from bob import (AgentRequest, AgentRuntime, FunctionTools, JsonlEventSink,
                 LlmResponse, ScriptedLlm, ToolCall, TurnPolicy)


# ---- 1. Helpers ---------------------------------------------------------------------------------

def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


def tools() -> FunctionTools:
    return FunctionTools([add, shout])


def calls(*specs: tuple[str, str, dict], text: str = "") -> LlmResponse:
    """A native-mode reply with tool calls (id, name, arguments)."""
    return LlmResponse(text, tuple(ToolCall(i, n, a) for i, n, a in specs),
                       finish_reason="tool_calls")


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def of(path: Path, kind: str) -> list[dict]:
    return [e["data"] for e in events(path) if e["kind"] == kind]


def record(path: Path, replies, inputs, *, mode="native", policy=None, **kw) -> list:
    """Run `inputs` as turns of one session, recording into `path`; returns the results."""
    sink = JsonlEventSink(path)
    rt = AgentRuntime(ScriptedLlm(replies), tools(), events=sink, policy=policy,
                      action_mode=mode, **kw)
    results = [rt.run(AgentRequest(text, "s1")) for text in inputs]
    sink.close()
    return results


# ---- 2. The trace -------------------------------------------------------------------------------

def test_the_trace_is_a_complete_record(tmp_path):
    path = tmp_path / "t.jsonl"
    r = record(path, [calls(("c1", "add", {"a": 1, "b": 2})), "3"], ["sum"],
               policy=TurnPolicy(max_steps=5), system_prompt="Be brief.")[0]
    [start] = of(path, "turn_started")
    assert start["format"] == bob.TRACE_FORMAT and start["version"] == bob.__version__
    assert start["model"] == "ScriptedLlm" and start["action_mode"] == "native"
    assert start["policy"]["max_steps"] == 5 and start["system_prompt"] == "Be brief."
    assert start["input"] == "sum" and start["tools"][0] == {
        "name": "add", "description": "Add two integers.",
        "input_schema": tools().list_tools()[0].input_schema}
    assert of(path, "session_loaded") == [{"paused": None, "messages": []}]
    digests = [d["digest"] for d in of(path, "llm_call_started")]
    assert len(digests) == 2 and all(len(d) == 64 for d in digests)
    first = of(path, "llm_call_completed")[0]
    assert first["tool_calls"] == [{"id": "c1", "name": "add", "arguments": {"a": 1, "b": 2}}]
    assert first["finish_reason"] == "tool_calls" and "usage" in first
    assert of(path, "tool_call_completed")[0]["content"] == "3"
    assert of(path, "turn_completed")[0]["content"] == r.content == "3"


def test_json_mode_secrets_in_reply_text_are_masked(tmp_path):
    path = tmp_path / "t.jsonl"
    reply = json.dumps({"type": "tool_call", "name": "shout",
                        "arguments": {"text": "a", "password": "hunter2"}})
    record(path, [reply, json.dumps({"type": "final", "content": "ok"})], ["go"], mode="json")
    assert "hunter2" not in path.read_text()


def test_a_trace_begun_mid_session_holds_the_history_it_began_from(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    store = bob.InMemorySessionStore()
    AgentRuntime(ScriptedLlm(["hello"]), tools(), store=store, events=JsonlEventSink(first),
                 action_mode="native").run(AgentRequest("hi", "s1"))
    rt = AgentRuntime(ScriptedLlm([calls(("x", "add", {"a": 2, "b": 2})), "4", "ok"]), tools(),
                      store=store, events=JsonlEventSink(second), action_mode="native")
    rt.run(AgentRequest("sum", "s1"))
    [loaded] = of(second, "session_loaded")
    assert [m["content"] for m in loaded["messages"]] == ["hi", "hello"]
    rt.run(AgentRequest("again", "s1"))   # as this runtime left it: not loaded again
    assert len(of(second, "session_loaded")) == 1


def test_each_digest_is_of_exactly_what_the_port_received(tmp_path):
    path, seen = tmp_path / "t.jsonl", []
    llm = ScriptedLlm([calls(("c1", "add", {"a": 1, "b": 2})), "3"])

    class Seeing:
        def complete(self, req, cancel, on_delta=None):
            seen.append(req)
            return llm.complete(req, cancel, on_delta)
    AgentRuntime(Seeing(), tools(), events=JsonlEventSink(path), action_mode="native").run(
        AgentRequest("sum"))
    assert [d["digest"] for d in of(path, "llm_call_started")] == [
        bob.request_digest(r) for r in seen]
    assert len(set(bob.request_digest(r) for r in seen)) == 2   # a different request, another
