"""Attacks on the JSONL trace: secrets that reach it unmasked, requests without a digest, and
hostile data that makes building an event raise. Each test failed before its fix.

Runs use the real OpenAI adapter against tests/fake_openai.py where the model is involved, real
FunctionTools, and a real JsonlEventSink file read back.
Sections: 1. Helpers  2. Secrets  3. Completeness and digests  4. Hostile data
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

import bob
from bob import (AgentRequest, AgentRuntime, Approval, FunctionTools, JsonlEventSink, LlmResponse,
                 Message, ScriptedLlm, ToolCall)
from conftest import final, make_llm
from fake_openai import completion, stream_reply, tool_calls_reply

SECRET = "hunter2-SECRET"


# ---- 1. Helpers ---------------------------------------------------------------------------------

def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def of(path: Path, kind: str) -> list[dict]:
    return [e["data"] for e in events(path) if e["kind"] == kind]


def leaks(path: Path, secret: str = SECRET) -> list[str]:
    """The kinds of the events whose line holds `secret`."""
    return [json.loads(line)["kind"] for line in path.read_text().splitlines() if secret in line]


def runtime(llm, path: Path, fns=(), **kw) -> AgentRuntime:
    kw.setdefault("action_mode", "native")
    return AgentRuntime(llm, FunctionTools(list(fns)), events=JsonlEventSink(path), **kw)


def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


# ---- 2. Secrets ---------------------------------------------------------------------------------

def test_a_secret_pair_in_the_user_input_is_masked(srv, tmp_path):
    path = tmp_path / "t.jsonl"
    srv.push("ok")
    runtime(make_llm(srv), path).run(AgentRequest(f'use {{"password": "{SECRET}"}}'))
    assert leaks(path) == []


def test_a_secret_pair_in_the_system_prompt_is_masked(srv, tmp_path):
    path = tmp_path / "t.jsonl"
    srv.push("ok")
    runtime(make_llm(srv), path, system_prompt=f'Config: {{"api_key": "{SECRET}"}}').run(
        AgentRequest("hi"))
    assert leaks(path) == []


def test_a_secret_pair_in_the_final_answer_is_masked_in_turn_completed(srv, tmp_path):
    path = tmp_path / "t.jsonl"
    srv.push(f'Your settings: {{"password": "{SECRET}"}}')
    runtime(make_llm(srv), path).run(AgentRequest("show settings"))
    assert SECRET not in json.dumps(of(path, "llm_call_completed"))  # masked there
    assert leaks(path) == []


def test_a_streamed_reply_reaches_the_trace_only_masked(srv, tmp_path):
    path = tmp_path / "t.jsonl"
    srv.push(stream_reply([f'Settings: {{"password": "{SECRET}"}}']))
    r = runtime(make_llm(srv, stream=True), path).run(AgentRequest("show settings"))
    assert SECRET in r.content and leaks(path) == []   # the trace leaves text_delta out
    assert "text_delta" not in [e["kind"] for e in events(path)]


def test_a_secret_in_an_invalid_json_action_is_masked_in_the_error_event(srv, tmp_path):
    path = tmp_path / "t.jsonl"
    bad = json.dumps({"type": "toolcall", "name": "shout", "arguments": {"password": SECRET}})
    srv.push(bad, bad)
    with pytest.raises(bob.AgentError) as e:
        runtime(make_llm(srv), path, [shout], action_mode="json").run(AgentRequest("go"))
    assert SECRET not in str(e.value)
    assert leaks(path) == []


def test_a_reply_cut_inside_a_secret_value_is_masked(srv, tmp_path):
    path = tmp_path / "t.jsonl"
    cut = f'{{"type": "tool_call", "name": "shout", "arguments": {{"password": "{SECRET}'
    srv.push(completion(cut, finish_reason="length"), final("ok"))
    runtime(make_llm(srv), path, [shout], action_mode="json").run(AgentRequest("go"))
    assert leaks(path) == []


def fetch() -> dict:
    """Fetch a config document (the body is JSON text inside JSON)."""
    return {"status": 200, "body": json.dumps({"api_key": SECRET})}


def test_a_secret_pair_in_json_nested_in_a_tool_result_is_masked(srv, tmp_path):
    path = tmp_path / "t.jsonl"
    srv.push(tool_calls_reply([("fetch", {})]), "done")
    runtime(make_llm(srv), path, [fetch]).run(AgentRequest("fetch"))
    assert leaks(path) == []


def keys() -> dict:
    """List the account's keys."""
    return {"api_keys": [SECRET], "password": 20240417}


def test_non_string_secret_values_in_a_tool_result_are_masked(srv, tmp_path):
    path = tmp_path / "t.jsonl"
    srv.push(tool_calls_reply([("keys", {})]), "done")
    runtime(make_llm(srv), path, [keys]).run(AgentRequest("keys"))
    assert leaks(path) == [] and leaks(path, "20240417") == []


def login(user: str, github_token: str = "", private_key: str = "") -> str:
    """Log in."""
    return "ok"


def test_token_and_private_key_arguments_are_masked(srv, tmp_path):
    path = tmp_path / "t.jsonl"
    srv.push(tool_calls_reply([("login", {"user": "bo", "github_token": SECRET,
                                          "private_key": SECRET})]), "done")
    runtime(make_llm(srv), path, [login]).run(AgentRequest("log in"))
    assert leaks(path) == []


# ---- 3. Completeness and digests ----------------------------------------------------------------

TOO_LONG = {"status": 400, "body": {"error": {"message": "This model's maximum context length "
                                              "is 8192 tokens", "type": "invalid_request_error"}}}


def test_every_request_the_port_receives_has_its_digest(srv, tmp_path):
    path, seen = tmp_path / "t.jsonl", []
    llm = make_llm(srv)

    class Seeing:  # the real adapter, noting each request it is given
        def complete(self, req, cancel, on_delta=None):
            seen.append(bob.request_digest(req))
            return llm.complete(req, cancel, on_delta)

    srv.push(TOO_LONG, "ok")
    history = [Message("user", f"q{i}") if i % 2 == 0 else Message("assistant", f"a{i}")
               for i in range(6)]
    runtime(Seeing(), path).run(AgentRequest("next", history=history))
    assert len(srv.requests) == 2
    assert [e["data"]["digest"] for e in events(path)   # the retry's is in history_truncated
            if e["kind"] in ("llm_call_started", "history_truncated")] == seen


# ---- 4. Hostile data ----------------------------------------------------------------------------

def deep(n: int) -> dict:
    v: dict = {"x": 1}
    for _ in range(n):
        v = {"x": v}
    return v


def test_a_deeply_nested_history_is_a_clear_error_and_the_store_is_kept(srv, tmp_path):
    # It was "internal error in start: RecursionError" (with a sink), or in build_prompt.
    path = tmp_path / "t.jsonl"
    history = [Message("user", "hi"), Message("assistant", "", (ToolCall("c1", "shout",
                                                                         deep(1000)),)),
               Message("tool", "HI", tool_call_id="c1", name="shout")]
    with pytest.raises(bob.AgentError, match="history cannot be sent: .* nests deeper") as e:
        runtime(make_llm(srv), path, [shout]).run(AgentRequest("again", history=history))
    assert "internal error" not in str(e.value) and srv.requests == []


def test_deeply_nested_approved_arguments_do_not_break_the_turn(srv, tmp_path):
    path = tmp_path / "t.jsonl"

    def echo(x: dict) -> str:
        """Echo."""
        return "ok"

    srv.push(tool_calls_reply([("echo", {"x": {}})]), "done")
    rt = runtime(make_llm(srv), path, [echo], ask_tools=["echo"],
                 approver=lambda call: Approval(True, arguments={"x": deep(1000)}))
    r = rt.run(AgentRequest("go"))
    assert r.finish_reason is not None
    assert [e["kind"] for e in events(path)][-1] == "turn_completed"


def test_a_huge_integer_in_approved_arguments_does_not_break_the_turn(srv, tmp_path):
    path = tmp_path / "t.jsonl"

    def echo(n: int) -> str:
        """Echo."""
        return "ok"

    srv.push(tool_calls_reply([("echo", {"n": 1})]), "done")
    rt = runtime(make_llm(srv), path, [echo], ask_tools=["echo"],
                 approver=lambda call: Approval(True, arguments={"n": 10 ** 5000}))
    r = rt.run(AgentRequest("go"))
    assert r.finish_reason is not None


def test_mixed_type_argument_keys_do_not_break_the_turn(tmp_path):
    path = tmp_path / "t.jsonl"
    reply = LlmResponse("", (ToolCall("c1", "shout", {1: "a", "text": "b"}),))
    r = runtime(ScriptedLlm([reply, "done"]), path, [shout]).run(AgentRequest("go"))
    assert r.finish_reason is bob.FinishReason.FINAL


def test_a_tool_result_that_is_not_text_does_not_break_the_turn(tmp_path):
    path = tmp_path / "t.jsonl"

    class Port:
        def list_tools(self):
            return [bob.ToolDescriptor("get", "Get.", {"type": "object", "properties": {}})]

        def call_tool(self, call, timeout_s, cancel=None):
            return bob.ToolResult(call.id, call.name, None)

    llm = ScriptedLlm([LlmResponse("", (ToolCall("c1", "get", {}),)), "done"])
    r = AgentRuntime(llm, Port(), events=JsonlEventSink(path), action_mode="native").run(
        AgentRequest("go"))
    assert r.finish_reason is bob.FinishReason.FINAL
    assert len(of(path, "tool_call_started")) == len(of(path, "tool_call_completed"))


def test_a_lone_surrogate_in_reply_text_with_tool_calls_does_not_break_the_turn(srv, tmp_path):
    path = tmp_path / "t.jsonl"
    srv.push(tool_calls_reply([("shout", {"text": "a"})], content="cut emoji \ud83d"), "done")
    r = runtime(make_llm(srv), path, [shout]).run(AgentRequest("go"))
    assert r.finish_reason is bob.FinishReason.FINAL, r.content


def test_masking_a_large_reply_does_not_stall_the_turn(srv, tmp_path):
    path = tmp_path / "t.jsonl"
    srv.push('"' + " password" * 40_000)   # 360 KB; a reply may be 16 MiB
    rt = runtime(make_llm(srv), path, policy=bob.TurnPolicy(turn_timeout_ms=1000))
    t0 = time.monotonic()
    rt.run(AgentRequest("go"))
    took = time.monotonic() - t0
    assert took < 1.5, f"the turn took {took:.1f} s with turn_timeout_ms=1000"


def test_a_deep_input_schema_is_a_clear_error_naming_the_tool(tmp_path):
    # It was "internal error in start: RecursionError", only when a sink listened.
    path = tmp_path / "t.jsonl"
    schema: dict = {"type": "object"}
    for _ in range(500):
        schema = {"type": "object", "properties": {"x": schema}}

    class Port:
        def list_tools(self):
            return [bob.ToolDescriptor("get", "Get.", schema)]

        def call_tool(self, call, timeout_s, cancel=None):
            return bob.ToolResult(call.id, call.name, "x")

    rt = AgentRuntime(ScriptedLlm(["done"]), Port(), events=JsonlEventSink(path),
                      action_mode="native")
    with pytest.raises(bob.AgentError, match="tool 'get': its input schema nests deeper than "
                       "100 levels; deny it") as e:
        rt.run(AgentRequest("go"))
    assert "internal" not in str(e.value)
    rt.deny_tools = ("get",)   # the fix the message names
    assert rt.run(AgentRequest("go")).finish_reason is bob.FinishReason.FINAL


def test_a_json_escaped_api_key_is_masked_in_the_error_event(srv, tmp_path):
    path, key = tmp_path / "t.jsonl", "sk-abc/def+ghi/jkl"
    escaped = key.replace("/", "\\/")
    srv.push({"status": 401, "body": '{"error": {"message": "Incorrect API key: ' + escaped +
              '"}}'})
    with pytest.raises(bob.LlmError) as e:
        runtime(make_llm(srv, api_key=key), path).run(AgentRequest("hi"))
    assert "def+ghi" not in str(e.value)
    assert [line for line in path.read_text().splitlines() if "def+ghi" in line] == []


def no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def test_every_trace_line_is_json(srv, tmp_path):
    path = tmp_path / "t.jsonl"

    def echo(x: float) -> str:
        """Echo."""
        return str(x)

    srv.push(tool_calls_reply([("echo", '{"x": NaN}'), ("echo", '{"x": 1e999}')]), "done")
    runtime(make_llm(srv), path, [echo]).run(AgentRequest("go"))
    for line in path.read_text().splitlines():
        json.loads(line, parse_constant=no_constants)


def test_a_cancelled_llm_call_is_closed_in_the_trace(srv, tmp_path):
    path, token = tmp_path / "t.jsonl", bob.CancelToken()
    srv.push(srv.HANG)
    threading.Thread(target=lambda: srv.wait_for_requests(1, 5.0) and token.cancel()).start()
    r = runtime(make_llm(srv), path).run(AgentRequest("hi"), token)
    assert r.finish_reason is bob.FinishReason.CANCELLED
    kinds = [e["kind"] for e in events(path)]
    after = kinds[kinds.index("llm_call_started"):]   # no reply came: turn_completed closes it
    assert "llm_call_completed" not in after and after[-1] == "turn_completed", kinds
    assert of(path, "turn_completed")[0]["finish_reason"] == "cancelled"


def test_after_a_lost_save_race_the_next_turn_records_the_history(tmp_path):
    path, store = tmp_path / "t.jsonl", bob.InMemorySessionStore()
    other = AgentRuntime(ScriptedLlm(["from B"]), store=store, action_mode="native")

    def meanwhile(req, cancel):  # another writer's turn ends while ours waits on the model
        other.run(AgentRequest("B asks", "s1"))
        return "from A"

    rt = AgentRuntime(ScriptedLlm([meanwhile, "again"]), store=store,
                      events=JsonlEventSink(path), action_mode="native")
    with pytest.raises(bob.StoreError):
        rt.run(AgentRequest("A asks", "s1"))
    rt.run(AgentRequest("A again", "s1"))
    loaded = of(path, "session_loaded")
    assert [m["content"] for m in loaded[-1]["messages"]] == ["B asks", "from B"], loaded


def connect(host: str, password: str) -> str:
    """Connect to a database."""
    return "connected"


def test_a_server_error_echoing_the_request_is_masked_in_the_error_event(srv, tmp_path):
    path = tmp_path / "t.jsonl"

    def echo_back(body):
        return {"status": 400, "body": {"error": {"message": "invalid message: " + json.dumps(
            body["messages"][2]["tool_calls"][0]["function"]), "type": "BadRequestError"}}}

    srv.push(tool_calls_reply([("connect", {"host": "db", "password": SECRET})]), echo_back)
    with pytest.raises(bob.LlmError):
        runtime(make_llm(srv), path, [connect]).run(AgentRequest("connect"))
    assert of(path, "tool_call_started")[0]["arguments"]["password"] == "***"  # masked there
    assert leaks(path) == []


def settings() -> str:
    """Show the settings, as Python prints them."""
    return str({"user": "bo", "password": SECRET})


def test_a_secret_in_a_python_repr_tool_result_is_masked(srv, tmp_path):
    path = tmp_path / "t.jsonl"
    srv.push(tool_calls_reply([("settings", {})]), "done")
    runtime(make_llm(srv), path, [settings]).run(AgentRequest("settings"))
    assert leaks(path) == []


def fetch_with_key(url: str, api_key: str = SECRET) -> str:
    """Fetch a URL with the service's key."""
    return "ok"


def test_a_secret_default_of_a_function_tool_is_not_in_the_trace(srv, tmp_path):
    path = tmp_path / "t.jsonl"
    srv.push("ok")
    runtime(make_llm(srv), path, [fetch_with_key]).run(AgentRequest("hi"))
    assert leaks(path) == []
    assert SECRET not in json.dumps(srv.requests[0]["body"])
