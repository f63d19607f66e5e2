"""OpenAICompatLlm against hostile endpoints and sloppy models, on a real server on 127.0.0.1.

Sections:
    1. Helpers: a byte-level misbehaving reply, a call bounded by a thread join
    2. [DONE] ends a stream (issue 10.1)
    3. Response size limit, gzip bombs (10.2)
    4. timeout_s bounds the whole call (10.3)
    5. health() leaks no thread per call (10.4)
    6. Malformed 200 bodies and usage (10.5)
    7. tool_choice (10.6)
    8. Sloppy native tool arguments (10.7)
"""
from __future__ import annotations

import gzip
import json
import threading
import time

import pytest
from conftest import make_llm, wait_until
from fake_openai import FakeOpenAI, chunk, completion, stream_reply, tool_calls_reply

from bob import (AgentRequest, AgentRuntime, CancelToken, ConfigError, FinishReason,
                 FunctionTools, LlmError, LlmRequest, Message, OpenAICompatLlm, ScriptedLlm,
                 ToolCall, ToolDescriptor, Usage, abandoned_workers)

MB = 1024 * 1024


# ---- 1. Helpers ---------------------------------------------------------------------------------

def ask(*, tools=(), mode: str = "json", within: float | None = None) -> LlmRequest:
    return LlmRequest([Message("system", "sys"), Message("user", "hi")], list(tools),
                      "json" if mode == "json" else None,
                      None if within is None else time.monotonic() + within)


ADD = ToolDescriptor("add", "Add two integers.", {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]})


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def head(headers: dict[str, str], status: str = "200 OK") -> bytes:
    lines = [f"HTTP/1.1 {status}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def endless(headers: dict[str, str], piece: bytes, pause: float = 0.0, first: bytes = b""):
    """A raw reply: these headers, `first`, then `piece` again and again until the client goes."""
    def play(write, stop: threading.Event) -> None:
        write(head(headers) + first)
        while not stop.wait(pause) if pause else not stop.is_set():
            write(piece)
    return {"raw": play}


def bounded(fn, limit: float):
    """(result or exception, seconds taken) of fn() on a thread; fails if it runs past `limit`."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:
            out.append(e)
    t0 = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    assert out, f"still running after {limit} s"
    return out[0], time.monotonic() - t0


# ---- 2. [DONE] ends a stream --------------------------------------------------------------------

def test_done_ends_the_stream_even_when_the_server_keeps_the_connection_open():
    held = stream_reply(["Hel", "lo"], finish_reason=None, usage=None, hold=True)
    with FakeOpenAI([held, stream_reply(["again"])]) as srv:
        llm = make_llm(srv, stream=True, timeout_s=5)
        out, took = bounded(lambda: llm.complete(ask(), CancelToken()), 10)
        assert not isinstance(out, Exception) and out.content == "Hello", out
        assert took < 1.0, f"took {took:.2f} s after [DONE]"
        assert llm.complete(ask(), CancelToken()).content == "again"   # a fresh connection


# ---- 3. Response size limit ---------------------------------------------------------------------

def gzip_bomb(inflated: int) -> bytes:
    return gzip.compress(b"\0" * inflated, 9)


@pytest.mark.parametrize("reply", [
    endless({"Content-Type": "application/json", "Content-Length": str(50 * MB)}, b" " * 65536),
    endless({"Content-Type": "text/event-stream", "Connection": "close"}, b"x" * 65536,
            first=b"data: "),
    endless({"Content-Type": "text/event-stream", "Connection": "close"},
            b"data: " + json.dumps(chunk("x" * 1000)).encode() + b"\n\n"),
], ids=["json", "sse-one-long-line", "sse-many-events"])
def test_a_body_over_max_response_bytes_is_an_llm_error_naming_the_limit(reply):
    with FakeOpenAI([reply]) as srv:
        llm = make_llm(srv, max_response_bytes=MB, stream=True)
        out, _ = bounded(lambda: llm.complete(ask(), CancelToken()), 20)
    assert isinstance(out, LlmError), out
    assert "max_response_bytes=1048576" in str(out) and "[llm]" in str(out)


def test_a_gzip_bomb_counts_decompressed_bytes():
    # 20 MB in 20 KB, 20 times the limit (compressing 200 MB took the suite a second of CPU).
    # Counting what came over the wire, bob would read it all and fail on the JSON instead.
    bomb = gzip_bomb(20 * MB)
    reply = {"raw": lambda write, stop: write(head({
        "Content-Type": "application/json", "Content-Encoding": "gzip",
        "Content-Length": str(len(bomb))}) + bomb)}
    with FakeOpenAI([reply]) as srv:
        out, _ = bounded(lambda: make_llm(srv, max_response_bytes=MB).complete(
            ask(), CancelToken()), 20)
    assert isinstance(out, LlmError) and "max_response_bytes=1048576" in str(out), out


def test_a_gzipped_completion_under_the_limit_is_read():
    body = gzip.compress(json.dumps(completion("zipped")).encode())
    reply = {"raw": lambda write, stop: write(head({
        "Content-Type": "application/json", "Content-Encoding": "gzip",
        "Content-Length": str(len(body))}) + body)}
    with FakeOpenAI([reply]) as srv:
        assert make_llm(srv).complete(ask(), CancelToken()).content == "zipped"


@pytest.mark.parametrize("value", [0, -1, 1.5, "16MB", True])
def test_a_bad_max_response_bytes_is_a_config_error(value):
    with pytest.raises(ConfigError, match="max_response_bytes"):
        OpenAICompatLlm("test:x", base_url="http://127.0.0.1:9/v1", max_response_bytes=value)


# ---- 4. timeout_s bounds the whole call ---------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("deadline", [False, True])
def test_a_server_sending_a_byte_every_so_often_ends_at_the_timeout(stream, deadline):
    headers = {"Content-Type": "text/event-stream" if stream else "application/json",
               "Content-Length": str(10 * MB)}
    with FakeOpenAI([endless(headers, b" " if not stream else b":", pause=0.1)]) as srv:
        llm = make_llm(srv, stream=stream, timeout_s=60 if deadline else 0.3)
        out, took = bounded(lambda: llm.complete(ask(within=0.3 if deadline else None),
                                                 CancelToken()), 10)
    assert isinstance(out, LlmError) and "no answer in time" in str(out), out
    # at most 0.1 s early and 1 s late, as when the timeout was 1 s (0.3 s: three bytes came)
    assert 0.2 < took < 1.3, f"ended after {took:.2f} s, the timeout was 0.3 s"


# ---- 5. health() ------------------------------------------------------------------------------

def test_health_against_a_tool_port_that_never_answers_leaks_at_most_one_thread(hang):
    release = hang()

    class Hanging:
        def list_tools(self):
            release.wait(30)
            return [ADD]

        def call_tool(self, call, timeout_s):
            raise AssertionError("not called")
    rt = AgentRuntime(ScriptedLlm(), Hanging())
    before, hung = threading.active_count(), abandoned_workers()
    reports = [rt.health(timeout_s=0.01) for _ in range(50)]
    extra = threading.active_count() - before
    assert extra <= 1, f"{extra} threads more after 50 health() calls"
    assert abandoned_workers() - hung <= 1
    assert all(not r["ok"] and "list_tools did not answer in 0.01 s" in r["tools_error"]
               for r in reports)
    release.set()
    assert wait_until(lambda: rt.health(timeout_s=1.0)["tools"] == 1)


# ---- 6. Malformed 200 bodies and usage ----------------------------------------------------------

def with_message(message) -> dict:
    return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


@pytest.mark.parametrize("body, says", [
    ("null", "not a JSON object"),
    ("42", "not a JSON object"),
    (json.dumps([completion("a")]), "not a JSON object"),
    (json.dumps({"choices": []}), "'choices'"),
    (json.dumps({"choices": None}), "'choices'"),
    (json.dumps({"choices": "x"}), "'choices'"),
    (json.dumps({"choices": {"0": {}}}), "'choices'"),
    (json.dumps({"choices": [None]}), "choice is not a JSON object"),
    (json.dumps(with_message("hi")), "message is not a JSON object"),
    (json.dumps(with_message(None)), "message is not a JSON object"),
    (json.dumps(with_message({"content": 5})), "content is neither text nor a list of parts"),
    (json.dumps(with_message({"content": {"a": 1}})), "content is neither text nor a list"),
    (json.dumps(with_message({"content": [1, 2]})), "content is neither text nor a list"),
    (json.dumps(with_message({"content": "", "tool_calls": "x"})),
     "tool_calls is not a JSON array"),
    (json.dumps(with_message({"content": "", "tool_calls": [5]})),
     "tool call is not a JSON object"),
    (json.dumps(with_message({"content": "", "tool_calls": [{"function": "add"}]})),
     "function is not a JSON object"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None)
def test_every_malformed_200_body_is_an_llm_error_with_an_excerpt(body, says):
    reply = {"status": 200, "headers": {"Content-Type": "application/json"}, "body": body}
    with FakeOpenAI([reply]) as srv:
        with pytest.raises(LlmError) as e:
            make_llm(srv).complete(ask(tools=[ADD], mode="native"), CancelToken())
    assert says in str(e.value) and "HTTP 200" in str(e.value)
    assert e.value.status_code == 200 and body[:20] in str(e.value)


@pytest.mark.parametrize("event", [
    {"choices": "x"}, {"choices": [5]}, {"choices": [{"delta": "x"}]},
    {"choices": [{"delta": {"content": 5}}]},
    {"choices": [{"delta": {"tool_calls": "x"}}]}, {"choices": [{"delta": {"tool_calls": [5]}}]},
    {"choices": [{"delta": {"tool_calls": [{"index": [0], "function": {}}]}}]},
])
def test_a_malformed_stream_event_is_an_llm_error(event):
    with FakeOpenAI([{"stream": [event]}]) as srv:
        with pytest.raises(LlmError, match="bad stream event") as e:
            make_llm(srv, stream=True).complete(ask(), CancelToken())
    assert e.value.status_code == 200


def test_a_malformed_body_reaches_a_turn_as_llm_error_not_agent_error():
    with FakeOpenAI([{"choices": [{"message": "hi"}]}]) as srv:
        with pytest.raises(LlmError, match="message is not a JSON object"):
            AgentRuntime(make_llm(srv), action_mode="native").run(AgentRequest("hi"))


@pytest.mark.parametrize("usage", ["n/a", 5, ["x"], {"prompt_tokens": "12"},
                                   {"prompt_tokens": 1, "completion_tokens": -3}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_usage_is_ignored_and_the_answer_kept(usage, stream):
    if stream:
        reply = stream_reply(["kept"], usage=None)
        reply["stream"].append(chunk(usage=usage))
    else:
        reply = completion("kept")
        reply["usage"] = usage
    with FakeOpenAI([reply]) as srv:
        out = make_llm(srv, stream=stream).complete(ask(), CancelToken())
    assert (out.content, out.usage) == ("kept", Usage())


# ---- 7. tool_choice -----------------------------------------------------------------------------

@pytest.mark.parametrize("choice", [None, "auto", "required", "none"])
def test_native_mode_sends_tool_choice_with_tools(choice):
    kw = {} if choice is None else {"tool_choice": choice}
    with FakeOpenAI(["a", "b", "c"]) as srv:
        llm = make_llm(srv, **kw)
        llm.complete(ask(tools=[ADD], mode="native"), CancelToken())
        llm.complete(ask(mode="native"), CancelToken())            # no tools
        llm.complete(ask(tools=[ADD], mode="json"), CancelToken())  # tools in the prompt
        bodies = [r["body"] for r in srv.requests]
    assert bodies[0]["tool_choice"] == (choice or "auto")
    assert "tool_choice" not in bodies[1] and "tool_choice" not in bodies[2]


@pytest.mark.parametrize("value", ["any", "", None, {"type": "function"}])
def test_a_bad_tool_choice_is_a_config_error(value):
    with pytest.raises(ConfigError, match="tool_choice must be auto, required or none"):
        OpenAICompatLlm("test:x", base_url="http://127.0.0.1:9/v1", tool_choice=value)


# ---- 8. Sloppy native tool arguments ------------------------------------------------------------

def test_raw_newlines_and_tabs_in_argument_strings_are_accepted():
    reply = tool_calls_reply([("note", '{"text": "line 1\nline\t2"}')])
    with FakeOpenAI([reply]) as srv:
        out = make_llm(srv).complete(ask(tools=[ADD], mode="native"), CancelToken())
    assert out.tool_calls == (ToolCall("call_1", "note", {"text": "line 1\nline\t2"}),)


@pytest.mark.parametrize("arguments, says", [
    ('{"a": 2, "b": ', "not valid JSON"),
    ("[2, 3]", "not a JSON object"),
    ('"2 and 3"', "not a JSON object"),
    ("null", "not a JSON object"),
])
def test_unusable_native_arguments_are_an_error_result_the_model_sees(arguments, says):
    ran = []

    def add_logged(a: int, b: int) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b
    with FakeOpenAI([tool_calls_reply([("add_logged", arguments)]), "sorry"]) as srv:
        rt = AgentRuntime(make_llm(srv), FunctionTools([add_logged]), action_mode="native")
        result = rt.run(AgentRequest("2+3?"))
        sent = srv.requests[1]["body"]["messages"][-1]
    assert result.finish_reason == FinishReason.FINAL and ran == []
    tool = result.history[2]
    assert tool.role == "tool" and tool.is_error and says in tool.content
    assert "add_logged" in tool.content and "at at" not in tool.content
    assert sent["role"] == "tool" and says in sent["content"]
    assert Message.from_dict(result.history[1].to_dict()) == result.history[1]


def test_a_tool_call_without_error_stores_no_error_field():
    m = Message("assistant", "", (ToolCall("c1", "add", {"a": 1}),))
    assert "error" not in m.to_dict()["tool_calls"][0]
    assert Message.from_dict(m.to_dict()) == m
