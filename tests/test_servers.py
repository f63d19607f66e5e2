"""bob against emulations of the OpenAI-compatible servers people run (tests/servers.py).

Sections:
    1. Headers and body fields a user must send (Azure, OpenRouter, the CLI)
    2. Streams: parallel calls at one index (Gemini, Ollama), malformed indexes, SSE, usage
    3. What a server attaches and wants back (Gemini thought signatures, DeepSeek reasoning)
    4. Mistral's strict history
    5. json mode: the action's schema, and fallbacks (llama-cpp-python, OpenAI, LM Studio)
"""
from __future__ import annotations

import json

import pytest
from fake_openai import FakeOpenAI, chunk, completion, tool_calls_reply
from servers import (AZURE_KEY, azure, deepseek, gemini, groq, llama_cpp_python, mistral, ollama,
                     openrouter, serve, small_model_on_llama_cpp)

from conftest import KEY, child_env, make_llm, run_cli, write_config
from bob import (ActionParseError, AgentRequest, AgentRuntime, CallTools, CancelToken,
                 ConfigError, Final, FinishReason, FunctionTools, GuardReason,
                 JsonFileSessionStore, JsonlEventSink, LlmError, LlmRequest, Message,
                 OpenAICompatLlm, ToolCall, ToolDescriptor, TurnPolicy, parse_action, replay)


def ask(*messages: Message, tools=(), json_mode: bool = False) -> LlmRequest:
    msgs = list(messages) or [Message("system", "sys"), Message("user", "hi")]
    return LlmRequest(msgs, list(tools), "json" if json_mode else None, None)


def weather_tools() -> FunctionTools:
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    def get_time(zone: str) -> str:
        """The time in a zone."""
        return f"12:00 {zone}"
    return FunctionTools([get_weather, get_time])


# ---- 1. Headers and body fields -----------------------------------------------------------------

def test_azure_gets_its_api_key_header_and_a_wrong_one_is_named_not_blamed_on_a_key():
    with serve(azure) as srv:
        good = OpenAICompatLlm("azure:gpt-4o", base_url=srv.url, headers={"api-key": AZURE_KEY})
        assert good.complete(ask(), CancelToken()).content == "hello from azure"
        bad = OpenAICompatLlm("azure:gpt-4o", base_url=srv.url, retry_max=0,
                              headers={"api-key": "wrong-" + AZURE_KEY})
        with pytest.raises(LlmError) as err:
            bad.complete(ask(), CancelToken())
    assert err.value.status_code == 401
    message = str(err.value)
    assert "header" in message and "'api-key'" in message, message
    assert "api_key_env" not in message and AZURE_KEY not in message
    assert AZURE_KEY not in repr(bad) and AZURE_KEY not in bad.describe()


def test_a_secret_header_echoed_by_a_server_is_masked_in_the_error():
    token = "gw-" + "t0ken" * 4
    echo = {"status": 403, "body": f"forbidden for X-Gateway-Token {token}"}
    with FakeOpenAI([echo]) as srv:
        llm = make_llm(srv, retry_max=0, headers={"X-Gateway-Token": token, "X-Team": "blue"})
        with pytest.raises(LlmError) as err:
            llm.complete(ask(), CancelToken())
    assert token not in str(err.value) and token not in err.value.body
    assert "'X-Gateway-Token'" in str(err.value)


def test_openrouter_gets_attribution_headers_and_routing_in_the_body():
    routing = {"order": ["anthropic"], "allow_fallbacks": False}
    with serve(openrouter) as srv:
        llm = make_llm(srv, headers={"HTTP-Referer": "https://example.org", "X-Title": "bob"},
                       extra_body={"provider": routing, "reasoning_effort": "low"})
        reply = llm.complete(ask(), CancelToken())
        body = srv.requests[0]["body"]
        auth = srv.requests[0]["headers"]["Authorization"]
    assert json.loads(reply.content) == {"referer": "https://example.org", "title": "bob",
                                         "provider": routing}
    assert body["reasoning_effort"] == "low" and auth == f"Bearer {KEY}"


@pytest.mark.parametrize("kw, says", [
    ({"headers": {"X-A": 1}}, "headers"), ({"headers": ["X-A"]}, "headers"),
    ({"headers": {"X-A": "a\nb"}}, "headers"), ({"extra_body": ["x"]}, "extra_body"),
    ({"extra_body": {"x": float("nan")}}, "extra_body")])
def test_bad_headers_or_extra_body_are_config_errors(kw, says):
    with pytest.raises(ConfigError, match=says):
        OpenAICompatLlm("ollama:x", **kw)


@pytest.mark.parametrize("name", ["Content-Type", "content-type"])
def test_a_content_type_header_is_a_config_error_not_a_replaced_body_type(name):
    # Given in headers, it replaced bob's "application/json": a server that reads the type
    # (text/plain) then refused or misread every request, and nothing said why.
    with FakeOpenAI(["hi"]) as srv:
        with pytest.raises(ConfigError, match="Content-Type"):
            OpenAICompatLlm("openai:x", base_url=srv.url, api_key="k",
                            headers={name: "text/plain"})


def test_llm_headers_and_extra_body_from_agent_toml(tmp_path):
    with FakeOpenAI(['{"type":"final","content":"hi"}']) as srv:
        write_config(tmp_path, srv, '[llm.headers]\nX-Title = "bob"\n'
                                    'api-key = "${AZURE_OPENAI_API_KEY}"\n'
                                    '[llm.extra_body]\nchat_template_kwargs = '
                                    '{ enable_thinking = false }\n')
        r = run_cli(tmp_path, "-p", "hi", env=child_env(tmp_path, AZURE_OPENAI_API_KEY="az-1"))
        assert r.returncode == 0, r.stderr
        req = srv.requests[0]
    assert req["headers"]["X-Title"] == "bob" and req["headers"]["api-key"] == "az-1"
    assert req["body"]["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("extra, says", [
    ("headers = 5\n", "[llm] headers must be a table of strings"),
    ("headers = { X-A = 1 }\n", "[llm] headers must be a table of strings"),
    ('extra_body = "x"\n', "[llm] extra_body must be a table"),
    ('headers = { api-key = "${NOT_SET_24}" }\n', "NOT_SET_24 is not set")])
def test_llm_headers_and_extra_body_of_a_wrong_type_exit_2_naming_key_and_file(
        tmp_path, extra, says):
    path = write_config(tmp_path, None, extra)
    r = run_cli(tmp_path, "-p", "hi")
    assert r.returncode == 2 and says in r.stderr and str(path) in r.stderr, r.stderr


# ---- 2. Streams ---------------------------------------------------------------------------------

@pytest.mark.parametrize("emulation", [gemini, ollama], ids=["gemini", "ollama"])
def test_parallel_calls_streamed_at_one_index_are_separate_calls(emulation):
    with serve(emulation) as srv:
        reply = make_llm(srv, stream=True).complete(ask(), CancelToken())
    assert [(c.name, c.error) for c in reply.tool_calls] == [
        ("get_weather", None), ("get_time", None)]
    assert len({c.id for c in reply.tool_calls}) == 2


@pytest.mark.parametrize("calls", [
    [{"index": 0, "id": "a", "function": {"name": "f", "arguments": "{}"}},
     {"index": "1", "id": "b", "function": {"name": "g", "arguments": "{}"}}],
    [{"index": None, "id": "a", "function": {"name": "f", "arguments": "{}"}},
     {"index": 0, "id": "b", "function": {"name": "g", "arguments": "{}"}}],
    [{"index": 0, "id": "a", "function": []}],
    [{"index": 0, "id": "a", "function": [{"name": "f"}]}]],
    ids=["int-and-str", "null-and-int", "empty-list-function", "list-function"])
def test_malformed_streamed_tool_calls_are_llm_errors(calls):
    stream = {"stream": [chunk(tool_calls=[c]) for c in calls] + [
        chunk(finish_reason="tool_calls")]}
    with FakeOpenAI([stream]) as srv:
        with pytest.raises(LlmError, match="bad stream event"):
            make_llm(srv, stream=True, retry_max=0).complete(ask(), CancelToken())


def test_a_tool_call_whose_function_is_a_list_is_an_llm_error_unstreamed():
    body = completion(None, tool_calls=[{"id": "a", "type": "function", "function": []}])
    with FakeOpenAI([body]) as srv:
        with pytest.raises(LlmError, match="function"):
            make_llm(srv, retry_max=0).complete(ask(), CancelToken())


def test_openrouter_event_over_several_data_lines_is_one_event():
    with serve(openrouter) as srv:
        reply = make_llm(srv, stream=True, headers={"X-Title": "bob"}).complete(
            ask(), CancelToken())
    assert json.loads(reply.content)["title"] == "bob"


def test_groq_usage_under_x_groq_is_read_after_stream_options_is_dropped():
    with serve(groq) as srv:
        llm = make_llm(srv, stream=True, retry_max=0)
        reply = llm.complete(ask(), CancelToken())
    assert reply.content == "hi" and (reply.usage.prompt_tokens, reply.usage.completion_tokens
                                      ) == (21, 3)


# ---- 3. What a server attaches and wants back ---------------------------------------------------

def test_gemini_thought_signatures_are_kept_in_history_store_and_trace_and_sent_back(tmp_path):
    with serve(gemini) as srv:
        rt = AgentRuntime(make_llm(srv, stream=True), weather_tools(), action_mode="native",
                          store=JsonFileSessionStore(tmp_path / "s"),
                          events=JsonlEventSink(tmp_path / "trace.jsonl"))
        result = rt.run(AgentRequest("Weather and time in Paris?"))
        sent = srv.requests[1]["body"]["messages"]
    assert result.finish_reason is FinishReason.FINAL, result.content
    assert result.content == "It is sunny at noon." and result.tool_calls == 2
    calls = result.history[1].tool_calls
    assert [c.extra for c in calls] == [
        {"extra_content": {"google": {"thought_signature": "sig-get_weather"}}},
        {"extra_content": {"google": {"thought_signature": "sig-get_time"}}}]
    assert [c["extra_content"] for c in sent[2]["tool_calls"]] == [
        {"google": {"thought_signature": "sig-get_weather"}},
        {"google": {"thought_signature": "sig-get_time"}}]
    assert Message.from_dict(result.history[1].to_dict()) == result.history[1]
    assert "sig-get_time" in (tmp_path / "s" / "default.json").read_text()
    assert "sig-get_time" in (tmp_path / "trace.jsonl").read_text()


def test_deepseek_reasoning_content_of_a_tool_call_is_sent_back(tmp_path):
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b
    with serve(deepseek) as srv:
        rt = AgentRuntime(make_llm(srv), FunctionTools([add]), action_mode="native",
                          store=JsonFileSessionStore(tmp_path))
        result = rt.run(AgentRequest("5+7?"))
        sent = srv.requests[1]["body"]["messages"][2]
    assert result.content == "12", result.content
    assert sent["reasoning_content"] == "The user wants 5+7; use add."
    assert result.history[1].reasoning == "The user wants 5+7; use add."
    assert "use add" in (tmp_path / "default.json").read_text()


# ---- 4. Mistral ---------------------------------------------------------------------------------

def test_mistral_refusing_stream_options_with_422_gets_it_dropped_without_a_retry():
    with serve(mistral) as srv:
        llm = OpenAICompatLlm("mistral:mistral-small", base_url=srv.url, api_key=KEY,
                              stream=True, retry_max=0)
        reply = llm.complete(ask(), CancelToken())
        reply = llm.complete(ask(), CancelToken())
        sent = ["stream_options" in r["body"] for r in srv.requests]
    assert reply.tool_calls[0].name == "get_weather" and sent == [True, False, False]


def test_mistral_takes_a_history_from_another_server_and_a_user_after_tool_results():
    """Ids from another server (after /model) and a turn that ended on a guard right after
    tool results: Mistral gets 9-character ids, consistent, and an assistant note between."""
    other = [ToolCall("call_f1a2b3c4d5e6f7a8b9c0", "get_weather", {"city": "Rome"}),
             ToolCall("toolu_01XYZ", "get_time", {"zone": "CET"})]
    history = [Message("system", "sys"), Message("user", "weather?"),
               Message("assistant", "", tuple(other)),
               Message("tool", "sunny", tool_call_id=other[0].id, name="get_weather"),
               Message("tool", "12:00", tool_call_id=other[1].id, name="get_time"),
               Message("user", "and in Paris?")]
    with serve(mistral) as srv:
        llm = OpenAICompatLlm("mistral:mistral-small", base_url=srv.url, api_key=KEY,
                              retry_max=0)
        reply = llm.complete(ask(*history), CancelToken())
        sent = srv.requests[0]["body"]["messages"]
    assert reply.tool_calls[0].id == "Ab3dE6gH9"
    ids = [c["id"] for c in sent[2]["tool_calls"]]
    assert ids == [sent[3]["tool_call_id"], sent[4]["tool_call_id"]] and len(set(ids)) == 2
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool", "tool",
                                         "assistant", "user"]


def test_mistral_turn_after_a_guard_ended_on_tool_results():
    with serve(mistral) as srv:
        llm = OpenAICompatLlm("mistral:mistral-small", base_url=srv.url, api_key=KEY,
                              retry_max=0)
        rt = AgentRuntime(llm, weather_tools(), action_mode="native",
                          policy=TurnPolicy(max_steps=1))
        first = rt.run(AgentRequest("Weather in Paris?"))
        second = rt.run(AgentRequest("Thanks. Again?"))
    assert first.finish_reason is FinishReason.GUARD_EXCEEDED
    assert second.finish_reason is FinishReason.GUARD_EXCEEDED, second.content


# ---- 5. json mode -------------------------------------------------------------------------------

TOOLS = [ToolDescriptor("get_sum", "Add two numbers.", {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"]}), ToolDescriptor("echo", "Echo.", {"type": "object"})]


def test_json_mode_sends_the_actions_json_schema():
    with FakeOpenAI(['{"type":"final","content":"hi"}']) as srv:
        make_llm(srv).complete(ask(tools=TOOLS, json_mode=True), CancelToken())
        rf = srv.requests[0]["body"]["response_format"]
    assert rf["type"] == "json_schema" and "tools" not in srv.requests[0]["body"]
    forms = rf["json_schema"]["schema"]["anyOf"]
    kinds = [f["properties"]["type"]["const"] for f in forms]
    assert kinds == ["final", "ask_user", "tool_call", "tool_call"]
    assert [f["properties"]["name"]["enum"] for f in forms[2:]] == [["get_sum"], ["echo"]]
    assert forms[2]["properties"]["arguments"] == TOOLS[0].input_schema


def test_llama_cpp_python_500_on_json_schema_falls_back_to_its_own_form_without_a_retry():
    with serve(llama_cpp_python) as srv:
        llm = make_llm(srv, retry_max=0)
        for _ in range(2):
            assert llm.complete(ask(tools=TOOLS, json_mode=True), CancelToken()).content
        forms = [r["body"]["response_format"] for r in srv.requests]
    assert [f["type"] for f in forms] == ["json_schema", "json_object", "json_object"]
    assert forms[1]["schema"] == forms[0]["json_schema"]["schema"] == forms[2]["schema"]


def test_json_mode_falls_back_to_json_object_then_plain_text_once_per_endpoint():
    def refuse(body):
        if "response_format" in body:
            return {"status": 400, "body": {"error": {"message": "unknown response_format"}}}
        return '{"type":"final","content":"plain"}'
    with FakeOpenAI([refuse] * 6) as srv:
        llm = make_llm(srv, retry_max=0)
        assert llm.complete(ask(tools=TOOLS, json_mode=True), CancelToken()).content
        assert llm.complete(ask(tools=TOOLS, json_mode=True), CancelToken()).content
        forms = [r["body"].get("response_format") for r in srv.requests]
    assert forms[2] == {"type": "json_object"} and forms[3:] == [None, None]


@pytest.mark.parametrize("text, action", [
    ('{&#34;type&#34;: &#34;final&#34;, &#34;content&#34;: &#34;42&#34;}', Final("42")),
    ('{&quot;type&quot;:&quot;final&quot;,&quot;content&quot;:&quot;a &amp; b&quot;}',
     Final("a & b")),
    ('{"type": "tool_call", "name": "get_sum", "arguments": {"a": 1, "b": 2}}\n'
     'I will now add the numbers.', CallTools((ToolCall("c", "get_sum", {"a": 1, "b": 2}),))),
    ('{"type": "final", "content": "x"} Hope this helps!', Final("x"))])
def test_sloppy_but_unambiguous_json_actions_are_read(text, action):
    assert parse_action(text, "c") == action


@pytest.mark.parametrize("text", [
    '{"type": "final", "content": "a"} {"type": "final", "content": "b"}',
    '{"type": "final", "content": "unterminated',
    'Sure! {"type": "final", "content": "x"}'])
def test_ambiguous_json_actions_still_get_the_corrective_re_prompt(text):
    with pytest.raises(ActionParseError):
        parse_action(text)


def sum_tools() -> FunctionTools:
    def get_sum(a: float, b: float) -> str:
        """Add two numbers."""
        return f"The sum of {a:g} and {b:g} is {a + b:g}."

    def echo(text: str) -> str:
        """Echo the text."""
        return text
    return FunctionTools([get_sum, echo])


def offered(request) -> list[str]:
    """The tool names a request's action schema offers."""
    rf = request["body"]["response_format"]   # OpenAI's json_schema, or llama.cpp's form
    forms = rf.get("schema", rf.get("json_schema", {}).get("schema"))["anyOf"]
    return [f["properties"]["name"]["enum"][0] for f in forms if "name" in f["properties"]]


def test_a_small_model_that_repeats_its_call_after_the_result_is_led_to_answer(tmp_path):
    # SmolLM2-135M held to the schema repeats a call after its result until LOOP_DETECTED; a
    # call repeated up to the loop limit leaves its tool out of the next step's schema
    trace = tmp_path / "trace.jsonl"
    with serve(small_model_on_llama_cpp) as srv:
        rt = AgentRuntime(make_llm(srv), sum_tools(), action_mode="json",
                          events=JsonlEventSink(trace))
        result = rt.run(AgentRequest("What is 93 plus 51? Use the get_sum tool."))
        sent = [r for r in srv.requests if r["body"]["response_format"]["type"] != "json_schema"]
    assert result.finish_reason is FinishReason.FINAL, result.content
    assert result.content == "The sum of 93 and 51 is 144."
    assert [offered(r) for r in sent] == [["get_sum", "echo"], ["get_sum", "echo"], ["echo"]]
    # the system message still lists every tool; only the schema leaves one out, for one step
    assert "- get_sum:" in sent[2]["body"]["messages"][0]["content"]
    assert [m.tool_calls[0].name for m in result.history if m.tool_calls] == ["get_sum"] * 2
    assert replay(trace).ok   # the step's schema is in its digest; a replay hides it too


def test_a_repeated_call_is_offered_again_after_another_action_and_guards_still_end_the_turn():
    calls = [{"type": "tool_call", "name": "get_sum", "arguments": {"a": 1, "b": 2}}] * 2 + [
        {"type": "tool_call", "name": "echo", "arguments": {"text": "x"}}] + [
        {"type": "tool_call", "name": "get_sum", "arguments": {"a": 1, "b": 2}}]
    with FakeOpenAI([json.dumps(c) for c in calls]) as srv:
        rt = AgentRuntime(make_llm(srv), sum_tools(), action_mode="json")
        result = rt.run(AgentRequest("add"))
        schemas = [offered(r) for r in srv.requests]
    assert schemas == [["get_sum", "echo"], ["get_sum", "echo"], ["echo"], ["get_sum", "echo"]]
    assert result.guard_reason is GuardReason.LOOP_DETECTED   # a server that ignores the schema


def test_native_mode_and_a_higher_loop_limit_keep_every_tool_offered():
    call = tool_calls_reply([("get_sum", {"a": 1, "b": 2})])
    with FakeOpenAI([call] * 2 + ["3"]) as srv:
        rt = AgentRuntime(make_llm(srv), sum_tools(), action_mode="native")
        assert rt.run(AgentRequest("add")).content == "3"
        assert all(len(r["body"]["tools"]) == 2 for r in srv.requests)
    same = json.dumps({"type": "tool_call", "name": "get_sum", "arguments": {"a": 1, "b": 2}})
    with FakeOpenAI([same] * 3 + ['{"type": "final", "content": "3"}']) as srv:
        rt = AgentRuntime(make_llm(srv), sum_tools(), action_mode="json",
                          policy=TurnPolicy(max_repeated_batches=3))
        assert rt.run(AgentRequest("add")).content == "3"
        assert [len(offered(r)) for r in srv.requests] == [2, 2, 2, 1]
