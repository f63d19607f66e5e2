"""Round 7: ports that raise an exception which tests false (its class defines __bool__ or
__len__: other people's code may). The loop tells an error from none by `is None`, never by
truth: before, such an LlmError ended the turn as FINAL with no content (the error lost), and
after a simplification it raised AttributeError from the loop itself.

Real runtimes with small real ports written here (the misbehaviour is the port's own class).
Sections: 1. Falsy exceptions  2. Each port
"""
from __future__ import annotations

import pytest

import bob
from bob import AgentRequest, AgentRuntime, ScriptedLlm, ToolDescriptor
from conftest import ListSink


# ---- 1. Falsy exceptions ------------------------------------------------------------------------

class FalsyLlmError(bob.LlmError):
    def __bool__(self):
        return False


class EmptyError(Exception):
    """An exception that is also an empty container."""

    def __len__(self):
        return 0


class RaisingLlm:
    def complete(self, req, cancel, on_delta=None):
        raise FalsyLlmError("the endpoint said no")


class RaisingTools:
    def list_tools(self):
        return [ToolDescriptor("boom", "Breaks.", {"type": "object", "properties": {}})]

    def call_tool(self, call, timeout_s, cancel=None):
        raise EmptyError("the tool port broke")


CALL = '{"type": "tool_call", "name": "boom", "arguments": {}}'
FINAL = '{"type": "final", "content": "done"}'


# ---- 2. Each port -------------------------------------------------------------------------------

def test_a_falsy_llm_error_fails_the_turn_with_it():
    sink = ListSink()
    with pytest.raises(FalsyLlmError, match="the endpoint said no"):
        AgentRuntime(RaisingLlm(), None, events=sink).run(AgentRequest("hi"))
    events = sink.events
    assert [e.data["finish_reason"] for e in events if e.kind == "turn_completed"] == [None]
    assert [e.data["error"] for e in events if e.kind == "error"] == [
        "FalsyLlmError: the endpoint said no"]


def test_a_falsy_exception_from_a_tool_port_is_its_calls_error_result():
    r = AgentRuntime(ScriptedLlm([CALL, FINAL]), RaisingTools()).run(AgentRequest("hi"))
    assert r.content == "done"
    [result] = [m for m in r.history if m.role == "tool"]
    assert result.is_error
    assert result.content == "executor unavailable: EmptyError: the tool port broke"


def test_a_falsy_exception_from_the_approver_declines_the_call():
    def approver(call):
        raise EmptyError("the approver broke")
    r = AgentRuntime(ScriptedLlm([CALL, FINAL]), RaisingTools(), ask_tools=["boom"],
                     approver=approver).run(AgentRequest("hi"))
    [result] = [m for m in r.history if m.role == "tool"]
    assert result.content == ("the user declined this call: the approver failed: EmptyError: "
                              "the approver broke")
