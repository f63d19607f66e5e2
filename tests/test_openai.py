"""Tests of OpenAICompatLlm against a real local HTTP server (tests/fake_openai.py).

Sections:
    1. Helpers
    2. Configuration: model strings, providers, keys
    3. The request on the wire (json and native mode)
    4. Replies: completions, tool calls, usage, malformed bodies
    5. Retries, Retry-After, deadlines, HTTP errors
    6. Cancellation
    7. Streaming
    8. Whole turns through AgentRuntime
"""
from __future__ import annotations

import socket
import threading
import time
from email.utils import formatdate

import pytest
from fake_openai import FakeOpenAI, chunk, completion, stream_reply, tool_calls_reply

from conftest import KEY, make_llm
from bob import (PROVIDERS, action_schema, AgentRequest, AgentRuntime, CancelToken, Cancelled,
                 ConfigError, FinishReason, FunctionTools, JsonlEventSink, LlmError, LlmRequest,
                 Message, OpenAICompatLlm, ToolCall, ToolDescriptor, Usage)




# ---- 1. Helpers ---------------------------------------------------------------------------------

def ask(text: str = "hi", *, tools=(), mode: str = "json", within: float | None = None,
        messages=None) -> LlmRequest:
    msgs = messages or [Message("system", "Be brief. Reply in JSON."), Message("user", text)]
    return LlmRequest(list(msgs), list(tools), "json" if mode == "json" else None,
                      None if within is None else time.monotonic() + within)


ADD = ToolDescriptor("add", "Add two integers.", {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]})


def cancel_when(event: threading.Event, delay: float = 0.0) -> tuple[CancelToken, list[float]]:
    """A token cancelled (after `delay`) once `event` is set; the list gets the cancel time."""
    token, at = CancelToken(), []

    def fire() -> None:
        if event.wait(5):
            time.sleep(delay)
            at.append(time.monotonic())
            token.cancel()
    threading.Thread(target=fire, daemon=True).start()
    return token, at


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


# ---- 2. Configuration ---------------------------------------------------------------------------

def test_known_local_provider_needs_no_key_and_model_keeps_its_colons(monkeypatch):
    llm = OpenAICompatLlm("ollama:llama3.2:3b")
    assert llm.provider == "ollama" and llm.model == "llama3.2:3b"
    assert llm.describe() == "ollama:llama3.2:3b at http://localhost:11434/v1"
    for name in ("openai", "ollama", "vllm", "llamacpp", "lmstudio", "openrouter", "groq",
                 "together", "deepseek", "mistral"):
        assert name in PROVIDERS


def test_missing_key_is_a_config_error_naming_the_variable(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="OPENAI_API_KEY"):
        OpenAICompatLlm("openai:gpt-4o-mini")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    llm = OpenAICompatLlm("openai:gpt-4o-mini")
    assert llm.describe() == "openai:gpt-4o-mini at https://api.openai.com/v1"
    assert KEY not in repr(llm) and KEY not in llm.describe()


def test_api_key_env_and_base_url_override_the_provider(monkeypatch):
    monkeypatch.setenv("BOB_TEST_KEY", KEY)
    llm = OpenAICompatLlm("groq:llama", base_url="http://127.0.0.1:9/v1/",
                          api_key_env="BOB_TEST_KEY")
    assert llm.base_url == "http://127.0.0.1:9/v1" and llm.api_key_env == "BOB_TEST_KEY"
    monkeypatch.delenv("BOB_TEST_KEY")
    with pytest.raises(ConfigError, match="BOB_TEST_KEY"):
        OpenAICompatLlm("ollama:llama", api_key_env="BOB_TEST_KEY")


def test_a_key_with_a_pasted_newline_is_a_config_error_without_the_key(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY + "\n")
    with pytest.raises(ConfigError, match="OPENAI_API_KEY contains spaces") as e:
        OpenAICompatLlm("openai:gpt-4o-mini")
    assert KEY not in str(e.value)


@pytest.mark.parametrize("model, message", [
    ("gpt-4o", "provider:model"), (":gpt", "provider:model"), ("openai:", "provider:model"),
    ("nosuch:model", "known providers are openai, ollama"),
])
def test_bad_model_strings_are_config_errors(model, message):
    with pytest.raises(ConfigError, match=message):
        OpenAICompatLlm(model, api_key=KEY)


def test_unknown_provider_works_with_a_base_url():
    with FakeOpenAI(["hello"]) as srv:
        llm = OpenAICompatLlm("mybox:some/model", base_url=srv.url)
        assert llm.complete(ask(), CancelToken()).content == "hello"
        assert "authorization" not in srv.requests[0]["headers"]
        assert srv.requests[0]["body"]["model"] == "some/model"


# ---- 3. The request on the wire -----------------------------------------------------------------

def test_json_mode_request_body_and_headers():
    with FakeOpenAI(['{"type":"final","content":"hi"}']) as srv:
        make_llm(srv).complete(ask(tools=[ADD]), CancelToken())
        r = srv.requests[0]
    assert r["path"] == "/v1/chat/completions" and r["method"] == "POST"
    assert r["headers"]["Authorization"] == f"Bearer {KEY}"
    assert r["headers"]["Content-Type"] == "application/json"
    assert r["body"] == {"model": "gpt-x", "messages": [
        {"role": "system", "content": "Be brief. Reply in JSON."},
        {"role": "user", "content": "hi"}], "response_format": {"type": "json_schema",
                                                                "json_schema": {
            "name": "action", "schema": action_schema([ADD])}}}


def test_native_mode_request_body_with_tool_calls_and_results():
    history = [Message("system", "sys"), Message("user", "2+3?"),
               Message("assistant", "", (ToolCall("c1", "add", {"a": 2, "b": 3}),
                                         ToolCall("c2", "add", {"a": 1, "b": 1}))),
               Message("tool", "5", tool_call_id="c1", name="add"),
               Message("tool", "2", tool_call_id="c2", name="add", is_error=True)]
    with FakeOpenAI(["5"]) as srv:
        llm = make_llm(srv, temperature=0.0, seed=7, max_tokens=100)
        llm.complete(ask(tools=[ADD], mode="native", messages=history), CancelToken())
        body = srv.requests[0]["body"]
    assert body == {
        "model": "gpt-x", "temperature": 0.0, "seed": 7, "max_tokens": 100,
        "tools": [{"type": "function", "function": {
            "name": "add", "description": "Add two integers.", "parameters": ADD.input_schema}}],
        "tool_choice": "auto",
        "messages": [
            {"role": "system", "content": "sys"}, {"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
                {"id": "c2", "type": "function",
                 "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]},
            {"role": "tool", "content": "5", "tool_call_id": "c1", "name": "add"},
            {"role": "tool", "content": "2", "tool_call_id": "c2", "name": "add"}]}


def test_json_response_format_can_be_turned_off():
    with FakeOpenAI(["{}"]) as srv:
        make_llm(srv, json_response_format=False).complete(ask(), CancelToken())
        assert "response_format" not in srv.requests[0]["body"]


def test_a_server_rejecting_response_format_is_asked_again_without_it():
    refusal = {"status": 400, "body": {"error": {
        "message": "'response_format.type' must be 'json_schema' or 'text'"}}}
    with FakeOpenAI([refusal, "one", "two"]) as srv:
        llm = make_llm(srv, retry_max=0)
        assert llm.complete(ask(), CancelToken()).content == "one"
        assert llm.complete(ask(), CancelToken()).content == "two"
        sent = [r["body"]["response_format"]["type"] for r in srv.requests]
    assert sent == ["json_schema", "json_object", "json_object"]  # the next form, no retry


def test_a_bad_tool_name_is_a_config_error_naming_it():
    bad = ToolDescriptor("fs.read file", "x", {"type": "object"})
    with FakeOpenAI() as srv:
        with pytest.raises(ConfigError, match="fs.read file"):
            make_llm(srv).complete(ask(tools=[bad], mode="native"), CancelToken())
        assert srv.requests == []


def test_one_connection_is_kept_alive_across_calls_and_streams():
    with FakeOpenAI(["a", stream_reply(["b"]), stream_reply(["c"]), "d"]) as srv:
        llm = make_llm(srv)
        for stream in (False, True, True, False):
            llm.stream = stream
            llm.complete(ask(), CancelToken())
        assert len({r["client_port"] for r in srv.requests}) == 1


# ---- 4. Replies ---------------------------------------------------------------------------------

def test_tool_calls_come_back_as_one_batch_with_parsed_arguments():
    reply = tool_calls_reply([("add", {"a": 2, "b": 3}), ("add", '{"a": 1, "b": 1}'),
                              ("now", ""), ("add", "{not json")])
    reply["choices"][0]["message"]["tool_calls"][2].pop("id")
    with FakeOpenAI([reply]) as srv:
        out = make_llm(srv).complete(ask(tools=[ADD], mode="native"), CancelToken())
    assert out.content == "" and out.finish_reason == "tool_calls"
    assert out.tool_calls[:3] == (ToolCall("call_1", "add", {"a": 2, "b": 3}),
                                  ToolCall("call_2", "add", {"a": 1, "b": 1}),
                                  ToolCall("", "now", {}))     # no id: the runtime gives one
    bad = out.tool_calls[3]                                     # bad JSON: the model is told
    assert (bad.id, bad.arguments) == ("call_4", {}) and "not valid JSON" in bad.error


def test_usage_is_read_and_a_missing_finish_reason_stays_none():
    with FakeOpenAI([completion("a", finish_reason=None, prompt_tokens=None),
                     completion("b", prompt_tokens=123, completion_tokens=45)]) as srv:
        llm = make_llm(srv)
        first, second = (llm.complete(ask(), CancelToken()) for _ in range(2))
    assert (first.usage, first.finish_reason) == (Usage(0, 0), None)
    assert (second.usage, second.finish_reason) == (Usage(123, 45), "stop")


@pytest.mark.parametrize("body, says", [
    ("<html>Bad Gateway</html>", "body is not JSON: '<html>Bad Gateway</html>'"),
    ({"object": "list", "data": []}, "has no 'choices'"),
    ({"error": {"message": "model overloaded"}}, "model overloaded"),
])
def test_a_200_that_is_not_a_completion_is_an_llm_error_quoting_it(body, says):
    with FakeOpenAI([{"status": 200, "body": body}]) as srv:
        with pytest.raises(LlmError, match="HTTP 200") as e:
            make_llm(srv).complete(ask(), CancelToken())
    assert says in str(e.value) and e.value.status_code == 200


# ---- 5. Retries, deadlines, HTTP errors ---------------------------------------------------------

def test_429_honours_retry_after_then_succeeds():
    busy = {"status": 429, "headers": {"Retry-After": "0.05"}, "body": {"error": "slow down"}}
    with FakeOpenAI([busy, "ok"]) as srv:
        t0 = time.monotonic()
        out = make_llm(srv, backoff_base_s=5.0).complete(ask(within=2), CancelToken())
        took = time.monotonic() - t0
    assert out.content == "ok" and len(srv.requests) == 2
    assert 0.05 <= took < 1.0


def test_retry_after_as_http_date_is_honoured():
    busy = {"status": 503, "headers": {"Retry-After": formatdate(time.time() - 5, usegmt=True)}}
    with FakeOpenAI([busy, "ok"]) as srv:
        assert make_llm(srv, backoff_base_s=5.0).complete(ask(), CancelToken()).content == "ok"


def test_retry_after_beyond_the_deadline_fails_at_once():
    busy = {"status": 429, "headers": {"Retry-After": "30"}, "body": {"error": "quota"}}
    with FakeOpenAI([busy, "never"]) as srv:
        t0 = time.monotonic()
        with pytest.raises(LlmError, match="no time left to retry") as e:
            make_llm(srv).complete(ask(within=1.0), CancelToken())
        assert time.monotonic() - t0 < 0.3 and len(srv.requests) == 1
    assert e.value.status_code == 429 and "quota" in str(e.value)


def test_500_is_retried_until_retries_run_out():
    boom = {"status": 500, "body": {"error": {"message": "internal oops"}}}
    with FakeOpenAI([boom] * 3) as srv:
        with pytest.raises(LlmError) as e:
            make_llm(srv, retry_max=2).complete(ask(), CancelToken())
        assert len(srv.requests) == 3
    msg = str(e.value)
    assert e.value.status_code == 500 and "internal oops" in e.value.body
    assert "HTTP 500" in msg and srv.url in msg and "internal oops" in msg and "3 tries" in msg


def test_401_is_not_retried_and_names_the_key_variable(monkeypatch):
    monkeypatch.setenv("BOB_TEST_KEY", KEY)
    refused = {"status": 401, "body": {"error": {"message": f"Incorrect API key: {KEY}"}}}
    with FakeOpenAI([refused, "never"]) as srv:
        llm = OpenAICompatLlm("test:m", base_url=srv.url, api_key_env="BOB_TEST_KEY")
        with pytest.raises(LlmError, match="BOB_TEST_KEY") as e:
            llm.complete(ask(), CancelToken())
        assert len(srv.requests) == 1
    assert e.value.status_code == 401
    assert KEY not in str(e.value) and KEY not in e.value.body and KEY not in repr(llm)


def test_403_with_a_key_given_directly_says_so():
    with FakeOpenAI([{"status": 403, "body": "forbidden"}]) as srv:
        with pytest.raises(LlmError, match="check the key in the api_key given"):
            make_llm(srv).complete(ask(), CancelToken())


def test_400_context_too_long_says_so():
    too_long = {"status": 400, "body": {"error": {
        "message": "This model's maximum context length is 8192 tokens.",
        "code": "context_length_exceeded"}}}
    with FakeOpenAI([too_long]) as srv:
        with pytest.raises(LlmError, match="max_history_messages") as e:
            make_llm(srv).complete(ask(), CancelToken())
    assert e.value.status_code == 400 and len(srv.requests) == 1


def test_connection_refused_is_an_llm_error_after_retries():
    srv = FakeOpenAI()
    llm = make_llm(srv, retry_max=1)
    srv.close()
    t0 = time.monotonic()
    with pytest.raises(LlmError, match="cannot reach .*Connection refused.*2 tries"):
        llm.complete(ask(), CancelToken())
    assert time.monotonic() - t0 < 0.5


def test_a_hanging_server_is_given_up_at_the_deadline():
    with FakeOpenAI([FakeOpenAI.HANG]) as srv:
        t0 = time.monotonic()
        with pytest.raises(LlmError, match="no answer in time from"):
            make_llm(srv).complete(ask(within=0.3), CancelToken())
        assert 0.25 < time.monotonic() - t0 < 0.8


# ---- 6. Cancellation ----------------------------------------------------------------------------

def test_cancel_aborts_a_hanging_request_and_the_adapter_still_works():
    with FakeOpenAI([FakeOpenAI.HANG, "after"]) as srv:
        llm = make_llm(srv)
        token, at = cancel_when(srv.arrived, delay=0.05)
        with pytest.raises(Cancelled):
            llm.complete(ask(within=10), token)
        assert time.monotonic() - at[0] < 0.1
        assert llm.complete(ask(), CancelToken()).content == "after"
        first, second = srv.requests
        assert first["client_port"] != second["client_port"]  # the hung connection was closed


def test_a_cancel_before_the_connection_is_taken_still_aborts_it():
    token = CancelToken()

    class CancelsWhileEncoded(dict):
        def items(self):   # json.dumps calls this while the body is built: before any socket
            token.cancel()
            return super().items()

    tool = ToolDescriptor("t", "t", CancelsWhileEncoded(type="object"))
    for warm in (False, True):   # a new connection, and one kept alive from an earlier call
        with FakeOpenAI(["warm"] * warm + [FakeOpenAI.HANG]) as srv:
            llm = make_llm(srv)
            if warm:
                assert llm.complete(ask(), CancelToken()).content == "warm"
            t0 = time.monotonic()
            with pytest.raises(Cancelled):
                llm.complete(ask(tools=[tool], mode="native", within=5), token)
            assert time.monotonic() - t0 < 0.5   # not the 5 s the hanging server would take
            token = CancelToken()


def test_cancel_aborts_a_slow_stream():
    slow = stream_reply([f"w{i} " for i in range(50)], delay_s=0.2)
    with FakeOpenAI([slow, stream_reply(["next"])]) as srv:
        llm = make_llm(srv, stream=True)
        first_delta = threading.Event()
        token, at = cancel_when(first_delta)
        deltas: list[str] = []
        with pytest.raises(Cancelled):
            llm.complete(ask(within=10), token, lambda d: (deltas.append(d), first_delta.set()))
        assert time.monotonic() - at[0] < 0.1 and len(deltas) < 5
        assert llm.complete(ask(), CancelToken()).content == "next"


def test_cancel_aborts_a_tls_handshake_with_a_silent_server():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never says a word
        accepted, held = threading.Event(), []
        threading.Thread(target=lambda: (held.append(silent.accept()), accepted.set()),
                         daemon=True).start()
        llm = OpenAICompatLlm("test:m", base_url=f"https://127.0.0.1:{silent.getsockname()[1]}")
        token, at = cancel_when(accepted, delay=0.05)
        with pytest.raises(Cancelled):
            llm.complete(ask(within=10), token)
        assert time.monotonic() - at[0] < 0.1
        held[0][0].close()


def test_an_already_cancelled_token_sends_nothing():
    with FakeOpenAI(["x"]) as srv:
        token = CancelToken()
        token.cancel()
        with pytest.raises(Cancelled):
            make_llm(srv).complete(ask(), token)
        assert srv.requests == []


def test_cancel_during_retry_backoff():
    busy = {"status": 503, "headers": {"Retry-After": "5"}}
    with FakeOpenAI([busy, "never"]) as srv:
        token, at = cancel_when(srv.arrived, delay=0.05)
        with pytest.raises(Cancelled):
            make_llm(srv).complete(ask(within=10), token)
        assert time.monotonic() - at[0] < 0.1 and len(srv.requests) == 1


# ---- 7. Streaming -------------------------------------------------------------------------------

def test_streamed_text_goes_to_on_delta():
    with FakeOpenAI([stream_reply(["Hel", "lo", " world"], usage=(7, 3))]) as srv:
        deltas: list[str] = []
        out = make_llm(srv, stream=True).complete(ask(), CancelToken(), deltas.append)
        body = srv.requests[0]["body"]
    assert deltas == ["Hel", "lo", " world"]
    assert (out.content, out.usage, out.finish_reason) == ("Hello world", Usage(7, 3), "stop")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_stream_usage_can_be_left_out():
    with FakeOpenAI([stream_reply(["a"], usage=None)]) as srv:
        out = make_llm(srv, stream=True, stream_usage=False).complete(ask(), CancelToken())
        assert "stream_options" not in srv.requests[0]["body"]
    assert out.usage == Usage(0, 0)


def test_streamed_tool_calls_are_assembled_by_index_with_repeated_names_and_ids():
    def tc(index, args, name="add", id=None):
        d = {"index": index, "type": "function", "function": {"name": name, "arguments": args}}
        return [d | ({"id": id} if id else {})]
    chunks = [chunk(role="assistant"),
              chunk(tool_calls=tc(0, "", id="c1")), chunk(tool_calls=tc(0, '{"a": 2,', id="c1")),
              chunk(tool_calls=tc(1, "", id="c2")), chunk(tool_calls=tc(0, ' "b": 3}')),
              chunk(tool_calls=tc(1, '{"a": 1, "b": 1}', id="c2")),
              chunk(finish_reason="tool_calls"),
              chunk(usage={"prompt_tokens": 11, "completion_tokens": 9})]
    with FakeOpenAI([{"stream": chunks}]) as srv:
        out = make_llm(srv, stream=True).complete(ask(tools=[ADD], mode="native"), CancelToken())
    assert out.tool_calls == (ToolCall("c1", "add", {"a": 2, "b": 3}),
                              ToolCall("c2", "add", {"a": 1, "b": 1}))
    assert (out.finish_reason, out.usage) == ("tool_calls", Usage(11, 9))


def test_streamed_arguments_sent_whole_as_an_object_are_taken_as_unstreamed_ones_are():
    # Some servers send a streamed call's arguments as one JSON object, not text: that was
    # "a bad stream event", though the same object in an unstreamed reply is accepted.
    call = {"index": 0, "id": "c1", "type": "function",
            "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    chunks = [chunk(role="assistant"), chunk(tool_calls=[call]), chunk(finish_reason="tool_calls")]
    with FakeOpenAI([{"stream": chunks}]) as srv:
        out = make_llm(srv, stream=True).complete(ask(tools=[ADD], mode="native"), CancelToken())
    assert out.tool_calls == (ToolCall("c1", "add", {"a": 2, "b": 3}),)


def test_a_cut_stream_with_partial_content_is_an_llm_error():
    cut = {"stream": [chunk("Hel"), chunk("lo")], "drop": True}
    with FakeOpenAI([cut]) as srv:
        with pytest.raises(LlmError, match="cut before it finished .5 chars"):
            make_llm(srv, stream=True).complete(ask(), CancelToken())
        assert len(srv.requests) == 1  # text was shown already: not tried again


def test_a_stream_ending_without_done_is_fine_once_finished():
    finished = {"stream": [chunk("ok"), chunk(finish_reason="stop")], "drop": True}
    unfinished = {"stream": [chunk("par")], "done": False}
    with FakeOpenAI([finished, unfinished]) as srv:
        llm = make_llm(srv, stream=True)
        assert llm.complete(ask(), CancelToken()).content == "ok"
        with pytest.raises(LlmError, match="cut"):
            llm.complete(ask(), CancelToken())


def test_a_stream_error_event_is_an_llm_error():
    with FakeOpenAI([{"stream": [chunk("a"), {"error": {"message": "overloaded"}}]}]) as srv:
        with pytest.raises(LlmError, match="overloaded"):
            make_llm(srv, stream=True).complete(ask(), CancelToken())


def test_a_server_ignoring_stream_gets_parsed_as_json():
    with FakeOpenAI(["plain"]) as srv:
        deltas: list[str] = []
        out = make_llm(srv, stream=True).complete(ask(), CancelToken(), deltas.append)
    assert out.content == "plain" and deltas == []


# ---- 8. Whole turns through AgentRuntime --------------------------------------------------------

def test_json_mode_turn_with_a_tool_call(tmp_path):
    trace = tmp_path / "trace.jsonl"
    replies = ['{"type":"tool_call","name":"add","arguments":{"a":2,"b":40}}',
               '{"type":"final","content":"42"}']
    with FakeOpenAI(replies) as srv:
        sink = JsonlEventSink(trace)
        rt = AgentRuntime(make_llm(srv), FunctionTools([add]), events=sink)
        result = rt.run(AgentRequest("2+40?"))
        sink.close()
        second = srv.requests[1]["body"]
    assert (result.content, result.finish_reason) == ("42", FinishReason.FINAL)
    assert (result.usage, result.steps, result.tool_calls) == (Usage(20, 10), 2, 1)
    assert "tools" not in second and second["response_format"]["type"] == "json_schema"
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    assert "42" in second["messages"][-1]["content"]
    text = trace.read_text()
    assert KEY not in text and "turn_completed" in text


def test_native_mode_turn_with_a_batch_of_tool_calls(tmp_path):
    trace = tmp_path / "trace.jsonl"
    replies = [tool_calls_reply([("add", {"a": 2, "b": 3}), ("add", {"a": 1, "b": 1})]),
               "The sums are 5 and 2."]
    with FakeOpenAI(replies) as srv:
        rt = AgentRuntime(make_llm(srv), FunctionTools([add]), events=JsonlEventSink(trace),
                          action_mode="native")
        result = rt.run(AgentRequest("sums?"))
        first, second = srv.requests[0]["body"], srv.requests[1]["body"]
    assert result.finish_reason == FinishReason.FINAL
    assert (result.usage, result.tool_calls) == (Usage(20, 10), 2)
    assert [t["function"]["name"] for t in first["tools"]] == ["add"]
    assert "response_format" not in first
    assistant, r1, r2 = second["messages"][-3:]
    assert assistant["content"] == "" and len(assistant["tool_calls"]) == 2
    assert (r1["role"], r1["tool_call_id"], r1["content"]) == ("tool", "call_1", "5")
    assert (r2["role"], r2["tool_call_id"], r2["content"]) == ("tool", "call_2", "2")
    assert [m.role for m in result.history] == ["user", "assistant", "tool", "tool", "assistant"]
    assert KEY not in trace.read_text()


def test_streamed_native_turn_emits_text_deltas():
    events = []

    class Sink:
        def emit(self, event):
            events.append(event)
    with FakeOpenAI([stream_reply(["Hi", " there"])]) as srv:
        rt = AgentRuntime(make_llm(srv, stream=True), events=Sink(), action_mode="native")
        result = rt.run(AgentRequest("hello"))
    assert result.content == "Hi there"
    assert [e.data["text"] for e in events if e.kind == "text_delta"] == ["Hi", " there"]


def test_cancelling_a_turn_while_the_server_hangs():
    with FakeOpenAI([FakeOpenAI.HANG, '{"type":"final","content":"later"}']) as srv:
        llm = make_llm(srv)
        rt = AgentRuntime(llm)
        token, at = cancel_when(srv.arrived, delay=0.05)
        result = rt.run(AgentRequest("hi"), cancel=token)
        assert time.monotonic() - at[0] < 0.1
        assert result.finish_reason == FinishReason.CANCELLED
        assert rt.run(AgentRequest("again")).content == "later"


def test_an_llm_error_reaches_the_caller_without_the_key(tmp_path):
    trace = tmp_path / "trace.jsonl"
    with FakeOpenAI([{"status": 403, "body": f"key {KEY} is not allowed"}]) as srv:
        sink = JsonlEventSink(trace)
        rt = AgentRuntime(make_llm(srv), events=sink)
        with pytest.raises(LlmError, match="HTTP 403") as e:
            rt.run(AgentRequest("hi"))
        sink.close()
    assert KEY not in str(e.value) and KEY not in trace.read_text()
    assert "error" in trace.read_text()


def test_a_stream_that_closes_before_any_data_is_retried():
    with FakeOpenAI([{"stream": [], "done": False}, "after"]) as srv:
        r = make_llm(srv, stream=True).complete(ask(), CancelToken())
        assert r.content == "after" and len(srv.requests) == 2


def test_credentials_in_base_url_stay_out_of_errors_repr_and_describe():
    llm = OpenAICompatLlm("test:x", base_url="http://user:s3cr3tpass@127.0.0.1:9/v1",
                          retry_max=0)
    with pytest.raises(LlmError) as err:
        llm.complete(ask(within=5), CancelToken())
    for text in (str(err.value), repr(llm), llm.describe()):
        assert "s3cr3tpass" not in text and "//***@127.0.0.1:9" in text


@pytest.mark.parametrize("name", ["a.b", "x" * 65, "", "ok\n", "sp ace"])
def test_a_tool_name_no_provider_takes_is_a_config_error_before_sending(srv, name):
    tool = ToolDescriptor(name, "d", {"type": "object", "properties": {}})
    with pytest.raises(ConfigError, match="cannot be sent to the model"):
        make_llm(srv).complete(ask(tools=[tool], mode="native"), CancelToken())
    assert srv.requests == []
    srv.push("fine")
    ok = ToolDescriptor("a-b_" + "x" * 60, "d", tool.input_schema)   # 64: the longest taken
    assert make_llm(srv).complete(ask(tools=[ok], mode="native"), CancelToken()).content == "fine"
