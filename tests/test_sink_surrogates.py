"""JsonlEventSink writes an event whose text holds a lone surrogate (a cut emoji), escaped:
before, the line failed to encode and the event was dropped (the sink's error logged)."""
from __future__ import annotations

import json

from bob import AgentRequest, AgentRuntime, FunctionTools, JsonlEventSink, ScriptedLlm


def echo(text: str) -> str:
    """Say it back."""
    return text


def test_tool_events_with_a_lone_surrogate_reach_the_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    call = json.dumps({"type": "tool_call", "name": "echo", "arguments": {"text": "cut \ud83d"}})
    done = json.dumps({"type": "final", "content": "ok"})
    sink = JsonlEventSink(path)
    AgentRuntime(ScriptedLlm([call, done]), FunctionTools([echo]), events=sink).run(
        AgentRequest("hi"))
    sink.close()
    events = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    started = [e["data"] for e in events if e["kind"] == "tool_call_started"]
    completed = [e["data"] for e in events if e["kind"] == "tool_call_completed"]
    assert started[0]["arguments"] == {"text": "cut \ud83d"}
    assert completed[0]["content"] == "cut \ud83d"
    assert events[-1]["kind"] == "turn_completed"
