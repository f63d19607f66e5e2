"""Round 6, the adapter: what one server attached to a reply (a tool call's `extra`, Gemini's
`extra_content`; a message's `reasoning`, DeepSeek's `reasoning_content`) meets another server
after `/model`, or in a script that gives a session another adapter; and json mode's refused
forms of `response_format`, forgotten by a new adapter.

All against real HTTP servers on 127.0.0.1 (tests/fake_openai.py, tests/servers.py).
"""
from __future__ import annotations

import logging

import pytest
from fake_openai import FakeOpenAI, completion, tool_calls_reply
from servers import serve

from conftest import make_llm, run_cli, write_config, xdg_env
from bob import (AgentRequest, AgentRuntime, CancelToken, ConfigError, FinishReason,
                 FunctionTools, InMemorySessionStore, LlmError, LlmRequest, Message,
                 OpenAICompatLlm, ToolCall)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


SIGNATURE = {"google": {"thought_signature": "sig-add"}}
THOUGHT = "The user wants 2+3; use add."


def thinking_server_reply() -> dict:
    """A tool call carrying both things a server may want back: Gemini's extra_content on the
    call, DeepSeek's reasoning_content on the message."""
    reply = tool_calls_reply([("add", {"a": 2, "b": 3})])
    message = reply["choices"][0]["message"]
    message["tool_calls"][0]["extra_content"] = SIGNATURE
    message["reasoning_content"] = THOUGHT
    return reply


def openai_strict(body, headers):
    """OpenAI's answer to a property its schema does not know, in a message or a tool call:
    400 naming the first one (the error names one field at a time)."""
    for i, m in enumerate(body["messages"]):
        if "reasoning_content" in m:
            return {"status": 400, "body": {"error": {"message": (
                f"Additional properties are not allowed ('reasoning_content' was unexpected) - "
                f"'messages.{i}'"), "type": "invalid_request_error", "param": None}}}
        for j, c in enumerate(m.get("tool_calls", [])):
            if "extra_content" in c:
                return {"status": 400, "body": {"error": {"message": (
                    f"Additional properties are not allowed ('extra_content' was unexpected) - "
                    f"'messages.{i}.tool_calls.{j}'"), "type": "invalid_request_error"}}}
    return completion(f"answer {len(body['messages'])}")


def session_from_the_thinking_server(store) -> list[Message]:
    """A finished native-mode turn whose tool call came with extra_content and reasoning."""
    with FakeOpenAI([thinking_server_reply(), "5"]) as srv:
        rt = AgentRuntime(make_llm(srv), FunctionTools([add]), store=store,
                          action_mode="native")
        result = rt.run(AgentRequest("2+3?"))
    assert result.finish_reason is FinishReason.FINAL and result.content == "5"
    return result.history


def sent_back(message: dict) -> tuple:
    """What of the two a wire message carries: its reasoning, its calls' extra_content."""
    return (message.get("reasoning_content"),
            [c.get("extra_content") for c in message.get("tool_calls", [])])


# ---- 1. A strict server after /model: the fields go, the turn goes on, the history keeps them --

def test_a_strict_server_refusing_what_another_server_attached_still_answers_the_turn(caplog):
    store = InMemorySessionStore()
    history = session_from_the_thinking_server(store)
    assert history[1].reasoning == THOUGHT   # on the wire: messages[2], after the system's
    assert history[1].tool_calls[0].extra == {"extra_content": SIGNATURE}
    with caplog.at_level(logging.WARNING, logger="bob"), serve(openai_strict) as srv:
        rt = AgentRuntime(make_llm(srv, retry_max=0), FunctionTools([add]), store=store,
                          action_mode="native")   # /model: a new adapter, the same session
        first = rt.run(AgentRequest("and 4+4?"))
        second = rt.run(AgentRequest("and 5+5?"))
        sent = [r["body"]["messages"][2] for r in srv.requests]
    # the turn succeeds, retry_max=0 notwithstanding: the two refusals cost no retry
    assert first.finish_reason is FinishReason.FINAL and first.content == "answer 6"
    assert second.finish_reason is FinishReason.FINAL and second.content == "answer 8"
    # requests: reasoning refused, extra_content refused, answered; the next turn: answered
    assert len(sent) == 4
    assert [sent_back(m) for m in sent] == [
        (THOUGHT, [SIGNATURE]), (None, [SIGNATURE]), (None, [None]), (None, [None])]
    assert sent[3]["tool_calls"][0]["id"] == history[1].tool_calls[0].id  # the call itself goes
    # a warning once per field, naming it
    warned = [r.getMessage() for r in caplog.records if r.name == "bob"]
    assert len(warned) == 2, warned
    assert "rejected reasoning_content; this adapter no longer sends it" in warned[0]
    assert "rejected extra_content; this adapter no longer sends it" in warned[1]
    # nothing lost: the history still holds both, and an adapter that takes them gets them
    kept = second.history[1]
    assert kept.reasoning == THOUGHT and kept.tool_calls[0].extra == {"extra_content": SIGNATURE}
    with FakeOpenAI(["back"]) as srv:
        rt = AgentRuntime(make_llm(srv), FunctionTools([add]), store=store,
                          action_mode="native")   # /model back to the first server
        assert rt.run(AgentRequest("thanks")).content == "back"
        assert sent_back(srv.requests[0]["body"]["messages"][2]) == (THOUGHT, [SIGNATURE])


def thinker_or_strict(body, headers):
    """One server, two models as the CLI's --model names them: `thinker` calls t__echo with
    extra_content and reasoning_content, then answers; `strict` is openai_strict. The CLI has
    no such tool (no MCP server: each would cost its process a second of MCP SDK import): the
    call's result is an error ("unknown tool"), and the call, extra_content and reasoning are
    in the session all the same, which is what the three processes pass on."""
    if body["model"] == "strict":
        return openai_strict(body, headers)
    if body["messages"][-1]["role"] == "tool":
        return completion("echoed")
    reply = thinking_server_reply()
    reply["choices"][0]["message"]["tool_calls"][0]["function"] = {
        "name": "t__echo", "arguments": '{"text": "hi"}'}
    return reply


def test_the_cli_switching_a_session_to_a_strict_model_and_back_loses_nothing(tmp_path):
    """As a user meets it: one session, three processes, each a new adapter (`--model`, as
    `/model` in the REPL builds one)."""
    with serve(thinker_or_strict) as srv:
        write_config(tmp_path, srv, runtime='action_mode = "native"\n')

        def turn(model, prompt):
            return run_cli(tmp_path, "--model", f"local:{model}", "--session", "s", "-p", prompt,
                           env=xdg_env(tmp_path))
        first = turn("thinker", "echo hi")
        assert (first.returncode, first.stdout) == (0, "echoed\n"), first.stderr
        assert "unknown tool 't__echo'" in srv.requests[1]["body"]["messages"][-1]["content"]
        strict = turn("strict", "again")
        assert strict.returncode == 0, strict.stderr
        assert strict.stdout == "answer 6\n"   # system, user, call, result, answer, user
        assert len(srv.requests) == 2 + 3       # reasoning refused, extra_content refused, ok
        assert strict.stderr.count("rejected reasoning_content") == 1, strict.stderr
        assert strict.stderr.count("rejected extra_content") == 1, strict.stderr
        back = turn("thinker", "thanks")
        assert (back.returncode, back.stdout) == (0, "echoed\n"), back.stderr
        sent = [sent_back(r["body"]["messages"][2]) for r in srv.requests[2:6]]
    assert sent == [(THOUGHT, [SIGNATURE]), (None, [SIGNATURE]), (None, [None]),
                        (THOUGHT, [SIGNATURE])]


REFUSALS = {   # how servers refuse reasoning_content in an input message
    "openai 400": {"status": 400, "body": {"error": {"message": (
        "Additional properties are not allowed ('reasoning_content' was unexpected) - "
        "'messages.2'")}}},
    "mistral 422": {"status": 422, "body": {"object": "error", "message": {"detail": [{
        "type": "extra_forbidden", "loc": ["body", "messages", 2, "assistant",
                                           "reasoning_content"],
        "msg": "Extra inputs are not permitted"}]}, "type": "invalid_request_error"}},
    "deepseek-reasoner 400": {"status": 400, "body": {"error": {"message": (
        "The reasoning_content is an intermediate result for display purposes only and will "
        "not be included in the context for inference. Please remove the reasoning_content "
        "from your message to reduce network traffic."), "type": "invalid_request_error"}}},
}


def a_request(messages) -> LlmRequest:
    return LlmRequest(list(messages), [], None, None)


THINKING_HISTORY = [
    Message("user", "2+3?"),
    Message("assistant", "", (ToolCall("call_1", "add", {"a": 2, "b": 3}),), reasoning=THOUGHT),
    Message("tool", "5", tool_call_id="call_1", name="add"),
    Message("user", "and 4+4?")]


@pytest.mark.parametrize("refusal", REFUSALS.values(), ids=list(REFUSALS))
def test_reasoning_refused_in_any_servers_words_is_dropped_at_once_and_uncounted(refusal):
    with FakeOpenAI([refusal, "8", "9"]) as srv:
        llm = make_llm(srv, retry_max=0)
        assert llm.complete(a_request(THINKING_HISTORY), CancelToken()).content == "8"
        assert llm.complete(a_request(THINKING_HISTORY), CancelToken()).content == "9"
        sent = ["reasoning_content" in r["body"]["messages"][1] for r in srv.requests]
    assert sent == [True, False, False]


# ---- 2. A server that wants them is not taken for one that refuses them ------------------------

@pytest.mark.parametrize("wants", [
    "Missing `reasoning_content` field in the assistant message at message index 3. For more "
    "information, please refer to https://api-docs.deepseek.com/guides/thinking_mode#tool-calls",
    "The `reasoning_content` in the thinking mode must be passed back to the API."])
def test_deepseek_asking_for_reasoning_content_does_not_make_the_adapter_drop_it(wants):
    """DeepSeek names reasoning_content when a message lacks it (one from another server):
    that turn fails as before, and the adapter keeps sending the reasoning it has."""
    history = [*THINKING_HISTORY[:3], Message("assistant", "", (ToolCall(
        "call_2", "add", {"a": 4, "b": 4}),)), Message("tool", "8", tool_call_id="call_2",
                                                        name="add")]
    with FakeOpenAI([{"status": 400, "body": {"error": {"message": wants}}}, "ok"]) as srv:
        llm = make_llm(srv, retry_max=0)
        with pytest.raises(LlmError, match="HTTP 400"):
            llm.complete(a_request(history), CancelToken())
        assert llm.complete(a_request(THINKING_HISTORY), CancelToken()).content == "ok"
        sent = ["reasoning_content" in r["body"]["messages"][1] for r in srv.requests]
    assert sent == [True, True]


# ---- 3. The key: printable ASCII only ----------------------------------------------------------

@pytest.mark.parametrize("key", ["sk-abc def", "sk-abc\n", "sk-abc\x01", "sk-äbc"])
def test_a_key_with_spaces_control_or_non_ascii_characters_is_a_config_error(key):
    with pytest.raises(ConfigError, match="contains spaces or control or non-ASCII"):
        OpenAICompatLlm("openai:gpt-x", api_key=key)


# ---- 4. json mode: a refused response_format form is the adapter's, a new one starts over ----

def test_a_refused_response_format_form_is_forgotten_by_a_new_adapter():
    refusal = {"status": 400, "body": {"error": {
        "message": "'response_format.type' must be 'json_schema' or 'text'"}}}
    json_request = LlmRequest([Message("user", "hi")], [], "json", None)
    with FakeOpenAI([refusal, "one", "two", "three"]) as srv:
        llm = make_llm(srv, retry_max=0)
        llm.complete(json_request, CancelToken())
        llm.complete(json_request, CancelToken())
        make_llm(srv, retry_max=0).complete(json_request, CancelToken())  # /model, a new process
        forms = [r["body"]["response_format"]["type"] for r in srv.requests]
    assert forms == ["json_schema", "json_object", "json_object", "json_schema"]
