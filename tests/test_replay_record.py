"""Tests of issue 20: replay never waits for what the trace lacks, masking never breaks a replay
and leaves no secret in the record, every turn in the record is whole.

Runs are recorded through a real AgentRuntime into a real JsonlEventSink file, then replayed
from that file. Sections: 1. Helpers  2. Replay never waits  3. Masking  4. Whole turns
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

import bob
from bob import (AgentRequest, AgentRuntime, Approval, FinishReason, FunctionTools, GuardReason,
                 JsonlEventSink, LlmResponse, ScriptedLlm, ToolCall, ToolDescriptor, ToolResult,
                 TraceError, TurnPolicy)


# ---- 1. Helpers ---------------------------------------------------------------------------------

def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


def login(token: str) -> str:
    """Log in with a token."""
    return "welcome"


def calls(*specs: tuple[str, str, dict], text: str = "") -> LlmResponse:
    """A native-mode reply with tool calls (id, name, arguments)."""
    return LlmResponse(text, tuple(ToolCall(i, n, a) for i, n, a in specs),
                       finish_reason="tool_calls")


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def record(path: Path, replies, inputs, *, mode="native", tools_port=None, **kw) -> list:
    """Run `inputs` as turns of session s1, recorded into `path`; the results."""
    sink = JsonlEventSink(path)
    rt = AgentRuntime(ScriptedLlm(replies), tools_port or FunctionTools([add, shout, login]),
                      events=sink, action_mode=mode, **kw)
    results = [rt.run(AgentRequest(text, "s1")) for text in inputs]
    sink.close()
    return results


def assert_no_secret(path: Path, *secrets: str) -> None:
    text = path.read_text()
    for s in secrets:
        assert s not in text, f"{s!r} is in the trace"


# ---- 2. Replay never waits for what the trace lacks -------------------------------------------

def test_a_reply_deleted_from_the_middle_is_a_trace_error_at_once(tmp_path):
    path = tmp_path / "t.jsonl"
    record(path, [calls(("c1", "add", {"a": 1, "b": 2})), calls(("c2", "add", {"a": 3, "b": 4})),
                  "7"], ["sum"], policy=TurnPolicy(turn_timeout_ms=4000))
    lines = path.read_text().splitlines()
    gone = [n for n, line in enumerate(lines, 1) if '"llm_call_completed"' in line][1]
    started = max(n for n, line in enumerate(lines[:gone], 1) if '"llm_call_started"' in line)
    path.write_text("\n".join(lines[:gone - 1] + lines[gone:]) + "\n")
    t0 = time.monotonic()
    with pytest.raises(TraceError, match=f"line {started}: .*no llm_call_completed"):
        bob.replay(path)
    assert time.monotonic() - t0 < 2.0   # not the recorded 4 s deadline


def test_an_edit_in_a_later_turn_is_named_by_its_line_in_the_file(tmp_path):
    # Each turn's events were once numbered again from 1 while replaying it: an error in turn 2
    # named a line of turn 1
    path = tmp_path / "t.jsonl"
    record(path, ["first", calls(("c1", "add", {"a": 1, "b": 2})), "3"], ["hi", "sum"])
    lines = path.read_text().splitlines()
    bad = [n for n, line in enumerate(lines, 1) if '"llm_call_completed"' in line][-1]
    edited = json.loads(lines[bad - 1])
    edited["data"]["content"] = 5
    lines[bad - 1] = json.dumps(edited)
    path.write_text("\n".join(lines) + "\n")
    assert bad > 20   # in the second turn
    with pytest.raises(TraceError, match=f"^line {bad}: this llm_call_completed is not as bob"):
        bob.replay(path)


def record_a_turn_timeout(path: Path, hang, timeout_ms: int) -> None:
    """One turn of session s1, "sum": a tool call, then a model that outlives turn_timeout_ms
    (`hang` is conftest's fixture); recorded into `path` (test_round4_replay_attack uses it)."""
    release = hang()

    def slow(req, cancel):
        release.wait(10)
        return "late"

    [r] = record(path, [calls(("c1", "add", {"a": 1, "b": 2})), slow], ["sum"],
                 policy=TurnPolicy(turn_timeout_ms=timeout_ms))
    assert r.guard_reason is GuardReason.TURN_TIMEOUT


def test_a_recorded_turn_timeout_replays_without_waiting_for_it(tmp_path, hang):
    path = tmp_path / "t.jsonl"
    record_a_turn_timeout(path, hang, 400)   # waited out: 0.4 s, the bound below
    t0 = time.monotonic()
    report = bob.replay(path)
    took = time.monotonic() - t0
    assert report.ok, str(report)
    assert took < 0.4, f"the replay took {took:.2f} s: it waited for the recorded timeout"


def test_a_live_tool_gone_renamed_or_changed_is_named(tmp_path):
    path = tmp_path / "t.jsonl"
    record(path, [calls(("c1", "add", {"a": 1, "b": 2})), "3"], ["sum"])

    def yell(text: str) -> str:
        """Upper-case a text."""
        return text.upper()

    def add3(a: int, b: int, c: int = 0) -> int:
        """Add two integers."""
        return a + b + c

    live = FunctionTools([yell, login])
    live.add(add3, name="add")
    report = bob.replay(path, tools=live)
    assert not report.ok and report.step == 0   # at the turn's start, where they are offered
    assert report.recorded == ["add", "shout", "login"] and report.new == ["yell", "login", "add"]
    assert "removed: shout" in report.what and "added: yell" in report.what
    assert "changed: add (input_schema)" in report.what
    assert "digest" not in report.detail


# ---- 3. Masking ---------------------------------------------------------------------------------

SECRET = "sk-live-0123456789abcdef"


def test_a_final_answer_quoting_a_secret_pair_is_masked_everywhere_and_replays(tmp_path):
    path = tmp_path / "t.jsonl"
    [r] = record(path, [f'use {{"api_key": "{SECRET}"}}'], ["key?"])
    assert SECRET in r.content      # the caller gets the answer as it is
    assert_no_secret(path, SECRET)
    report = bob.replay(path)
    assert report.ok, str(report)
    assert SECRET not in str(report)


def test_a_malformed_reply_holding_a_secret_replays(tmp_path):
    path = tmp_path / "t.jsonl"
    bad = f'{{"type": "final", "api_key": "{SECRET}" "content": "x"}}'
    [r] = record(path, [bad, '{"type": "final", "content": "ok"}'], ["go"], mode="json")
    assert r.content == "ok"
    assert_no_secret(path, SECRET)
    report = bob.replay(path)
    assert report.ok, str(report)


def test_calls_with_different_secret_arguments_replay_the_same(tmp_path):
    path = tmp_path / "t.jsonl"
    replies = [calls((f"c{i}", "login", {"token": f"tok-{i}-secret"})) for i in range(3)]
    [r] = record(path, [*replies, "in"], ["log in"])
    # the loop guard sees what the trace sees: three calls alike but for a secret are a loop
    assert r.guard_reason is GuardReason.LOOP_DETECTED
    assert_no_secret(path, "tok-0-secret", "tok-1-secret", "tok-2-secret")
    report = bob.replay(path)
    assert report.ok, str(report)


def test_no_field_of_the_trace_keeps_a_secret_in_clear(tmp_path, caplog):
    path = tmp_path / "t.jsonl"
    pair = f'{{"password": "{SECRET}"}}'

    class Port:
        def list_tools(self):
            schema = {"type": "object", "properties": {
                "api_key": {"type": "string", "default": SECRET}, "x": {"type": "integer"}}}
            return [ToolDescriptor("svc", f"A service; config {pair}", schema),
                    ToolDescriptor("login", "Log in.", {"type": "object", "properties": {
                        "token": {"type": "string"}}})]

        def call_tool(self, call, timeout_s, cancel=None):
            return ToolResult(call.id, call.name, "ok", False)

    def approver(call):
        return Approval(False, f"no: {pair}")

    store = bob.InMemorySessionStore()
    sink = JsonlEventSink(path)
    first = AgentRuntime(ScriptedLlm([calls(("c1", "login", {"token": SECRET}))]), Port(),
                         store=store, events=sink, action_mode="native", ask_tools=["login"])
    assert first.run(AgentRequest(f"my input {pair}", "s1")).finish_reason is \
        FinishReason.NEEDS_APPROVAL
    bad = '{"type": {"secret": "' + SECRET + '"}}'
    svc = '{"type": "tool_call", "name": "svc", "arguments": {"x": 1}}'
    logged = logging.getLogger("test.events")
    second = AgentRuntime(ScriptedLlm([svc, bad, bad]), Port(),
                          store=store, action_mode="json", ask_tools=["svc"], approver=approver,
                          events=[sink, bob.LoggingEventSink(logged)])
    caplog.set_level(logging.INFO, logger="test.events")
    with pytest.raises(bob.AgentError):
        second.run(AgentRequest(f"again {pair}", "s1"))
    sink.close()
    kinds = {e["kind"] for e in events(path)}
    assert {"session_loaded", "approval_decided", "parse_error", "turn_started"} <= kinds
    assert_no_secret(path, SECRET)
    assert SECRET not in caplog.text


def test_logging_sink_never_writes_text_deltas(caplog):
    logger = logging.getLogger("test.deltas")
    caplog.set_level(logging.INFO, logger="test.deltas")

    class Streaming(ScriptedLlm):
        def complete(self, req, cancel, on_delta=None):
            for piece in ('{"api_', 'key": "', SECRET, '"}'):
                on_delta(piece)
            return super().complete(req, cancel, on_delta)

    AgentRuntime(Streaming([f'{{"api_key": "{SECRET}"}}']), action_mode="native",
                 events=bob.LoggingEventSink(logger)).run(AgentRequest("hi"))
    assert "llm_call_completed" in caplog.text and SECRET not in caplog.text


def test_secret_names_in_text_are_found_in_any_case(tmp_path):
    # _TEXT_KEY matches the lowered text: "API_KEY" in a text is a secret as in a dict key
    path = tmp_path / "t.jsonl"
    record(path, [f'{{"API_KEY": "{SECRET}", "Password": "hunter2"}}'], ["?"])
    assert_no_secret(path, SECRET, "hunter2")
    assert bob.redact({"API_KEY": SECRET}) == {"API_KEY": "***"}
    # a name is matched case-blind as re's IGNORECASE has it: a Turkish dotted capital I, or a
    # dotless i, is still an "i" (lowering or casefolding the name first loses them)
    assert bob.secret_name("AUTHOR\u0130ZATION") and bob.secret_name("credent\u0131al")


# ---- 4. Every turn in the record is whole -------------------------------------------------------

def turns_of(path: Path) -> list[list[str]]:
    out: list[list[str]] = []
    for e in events(path):
        if e["kind"] in ("session_loaded", "turn_started") and (
                not out or out[-1][-1] == "turn_completed"):
            out.append([])
        out[-1].append(e["kind"])
    return out


def test_a_resume_that_fails_at_start_still_begins_with_turn_started(tmp_path):
    path, store = tmp_path / "t.jsonl", bob.InMemorySessionStore()
    sink = JsonlEventSink(path)
    rt = AgentRuntime(ScriptedLlm([calls(("c1", "shout", {"text": "a"})), "done", "ok"]),
                      FunctionTools([shout]), store=store, events=sink, action_mode="native",
                      ask_tools=["shout"])
    rt.run(AgentRequest("go", "s1"))
    with pytest.raises(bob.ConfigError, match="must be an Approval"):
        rt.run(AgentRequest(None, "s1", approvals={"c1": True}))
    rt.run(AgentRequest(None, "s1", approvals={"c1": Approval(True)}))
    rt.run(AgentRequest("more", "s1"))
    with pytest.raises(bob.AgentError, match="no tool calls waiting"):
        rt.run(AgentRequest(None, "s1", approvals={}))
    sink.close()
    for turn in turns_of(path):
        assert turn[turn[0] == "session_loaded"] == "turn_started", turn
        assert turn[-1] == "turn_completed", turn
    resumed = turns_of(path)[2]
    assert resumed.index("turn_started") < resumed.index("approval_decided")
    report = bob.replay(path)
    assert report.ok, str(report)


def test_after_a_failed_save_the_next_turn_says_what_it_loaded(tmp_path):
    path = tmp_path / "t.jsonl"

    class FullOnce(bob.InMemorySessionStore):
        fail = False

        def save(self, session_id, state):
            if self.fail:
                self.fail = False
                raise bob.StoreError("disk full")
            super().save(session_id, state)

    store = FullOnce()
    sink = JsonlEventSink(path)
    rt = AgentRuntime(ScriptedLlm(["one", "two", "three"]), store=store, events=sink,
                      action_mode="native")
    rt.run(AgentRequest("a", "s1"))
    store.fail = True
    with pytest.raises(bob.StoreError):
        rt.run(AgentRequest("b", "s1"))
    rt.run(AgentRequest("c", "s1"))
    sink.close()
    loaded = [e["data"]["messages"] for e in events(path) if e["kind"] == "session_loaded"]
    assert len(loaded) == 2 and [m["content"] for m in loaded[1]] == ["a", "one"]
    report = bob.replay(path)
    assert report.ok, str(report)


def test_a_resume_of_a_session_with_nothing_in_it_ends_its_turn_in_the_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    sink = JsonlEventSink(path)
    rt = AgentRuntime(ScriptedLlm([]), events=sink, action_mode="native")
    with pytest.raises(bob.AgentError, match="no tool calls waiting"):
        rt.run(AgentRequest(None, "fresh", approvals={}))
    sink.close()
    assert [e["kind"] for e in events(path)] == [
        "session_loaded", "turn_started", "error", "turn_completed"]
    report = bob.replay(path)
    assert report.ok, str(report)
