"""Emulations of OpenAI-compatible servers as their users meet them, for tests/test_servers.py.

Each function is one server's documented wire behaviour (its docs and the public issues of
clients that hit it), written as a FakeOpenAI reply: `serve(emulation)` runs it on a real
http.server on 127.0.0.1, answering every request with `emulation(body, headers)`.

    with serve(mistral) as srv:
        llm = make_llm(srv, stream=True)

What bob is known to work with is what this file names: Azure OpenAI, OpenRouter, Gemini,
Ollama, Mistral, DeepSeek, Groq, llama-cpp-python's server.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable

from fake_openai import FakeOpenAI, chunk, completion

AZURE_KEY = "azure-" + "k3y" * 6


def serve(emulation: Callable[[Any, Any], Any], requests: int = 20) -> FakeOpenAI:
    """A FakeOpenAI answering each of the next `requests` requests with the emulation."""
    srv = FakeOpenAI()
    srv.push(*[lambda body: emulation(body, srv.requests[-1]["headers"])] * requests)
    return srv


def _error(status: int, message: Any, kind: str = "invalid_request_error") -> dict:
    return {"status": status, "body": {"error": {"message": message, "type": kind}}}


def _stream_of_calls(calls: list[dict], **extra_per_call: Any) -> dict:
    """Each call in its own chunk, all at index 0 with its own id (Gemini, Ollama)."""
    chunks = [chunk(role="assistant", content="")]
    chunks += [chunk(tool_calls=[{"index": 0, "type": "function", **c}]) for c in calls]
    chunks.append(chunk(finish_reason="tool_calls"))
    return {"stream": chunks}


# ---- Azure OpenAI: the key goes in an `api-key` header, not Authorization ----------------------

def azure(body: Any, headers: Any) -> Any:
    """401 with Azure's words unless `api-key` holds the key."""
    if headers.get("api-key") != AZURE_KEY:
        return {"status": 401, "body": {"error": {"code": "401", "message": (
            "Access denied due to invalid subscription key or wrong API endpoint. Make sure to "
            "provide a valid key for an active subscription and use a correct regional API "
            "endpoint for your resource.")}}}
    return completion("hello from azure")


# ---- OpenRouter: attribution headers, provider routing, multi-line SSE data ---------------------

def openrouter(body: Any, headers: Any) -> Any:
    """Streams (when asked) one event whose JSON is split over several `data:` lines, as
    OpenRouter's docs warn clients; echoes the attribution headers and routing in the text."""
    text = json.dumps({"referer": headers.get("HTTP-Referer"), "title": headers.get("X-Title"),
                       "provider": body.get("provider")})
    if not body.get("stream"):
        return completion(text)
    event = json.dumps(chunk(text), indent=1)   # several lines
    split = "".join(f"data: {line}\n" for line in event.splitlines())
    return {"stream": [": OPENROUTER PROCESSING\n\n", split + "\n",
                       chunk(finish_reason="stop")]}


# ---- Gemini (OpenAI compatibility): parallel calls at index 0, thought signatures -------------

def gemini(body: Any, headers: Any) -> Any:
    """Two parallel calls streamed at index 0, each with its thought_signature; the next request
    must send each call's extra_content back, else 400 as Gemini 3 answers."""
    for m in body["messages"]:
        for c in m.get("tool_calls", []):
            if not c.get("extra_content", {}).get("google", {}).get("thought_signature"):
                return _error(400, "Function call is missing a thought_signature in "
                                   "functionCall parts. This is required for tools to work "
                                   "correctly.")
    if body["messages"][-1]["role"] == "tool":
        return {"stream": [chunk("It is sunny at noon."), chunk(finish_reason="stop")]}
    signed = [{"id": f"function-call-{i}", "function": {"name": n, "arguments": a},
               "extra_content": {"google": {"thought_signature": f"sig-{n}"}}}
              for i, (n, a) in enumerate([("get_weather", '{"city":"Paris"}'),
                                          ("get_time", '{"zone":"CET"}')])]
    return _stream_of_calls(signed)


# ---- Ollama: parallel calls each in its own chunk at index 0 ---------------------------------

def ollama(body: Any, headers: Any) -> Any:
    """Streams two calls at index 0 with distinct ids, then a text answer after the results."""
    if body["messages"][-1]["role"] == "tool":
        return {"stream": [chunk("done"), chunk(finish_reason="stop")]}
    return _stream_of_calls([
        {"id": "call_abc", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
        {"id": "call_def", "function": {"name": "get_time", "arguments": '{"zone":"CET"}'}}])


# ---- Mistral: strict body, 9-character ids, no user right after a tool --------------------------

MISTRAL_ID = re.compile(r"[a-zA-Z0-9]{9}")


def mistral(body: Any, headers: Any) -> Any:
    """422 for an unknown field (stream_options), 400 for an id that is not 9 letters/digits
    and for a user message right after a tool message; else a 9-character-id tool call."""
    if "stream_options" in body:
        return {"status": 422, "body": {"object": "error", "message": {"detail": [{
            "type": "extra_forbidden", "loc": ["body", "stream_options"],
            "msg": "Extra inputs are not permitted"}]}, "type": "invalid_request_error"}}
    messages = body["messages"]
    for m in messages:
        for i in [c["id"] for c in m.get("tool_calls", [])] + [m.get("tool_call_id")] * (
                m["role"] == "tool"):
            if not MISTRAL_ID.fullmatch(i or ""):
                return _error(400, f"Tool call id was {i} but must be a-z, A-Z, 0-9, with a "
                                   "length of 9.")
    for before, m in zip(messages, messages[1:]):
        if before["role"] == "tool" and m["role"] == "user":
            return _error(400, "Unexpected role 'user' after role 'tool'")
    if messages[-1]["role"] == "tool":
        return completion("Paris is sunny.")
    return {"id": "x", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "", "tool_calls": [{"id": "Ab3dE6gH9", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}}]}


# ---- DeepSeek thinking mode: reasoning_content must come back with tool calls -----------------

def deepseek(body: Any, headers: Any) -> Any:
    """A tool call with reasoning_content; 400 if an assistant tool-call message comes back
    without it."""
    for i, m in enumerate(body["messages"]):
        if m.get("tool_calls") and "reasoning_content" not in m:
            return _error(400, f"Missing `reasoning_content` field in the assistant message at "
                               f"message index {i}.")
    if body["messages"][-1]["role"] == "tool":
        return completion("12")
    reply = completion(None, tool_calls=[{"id": "call_00_x", "type": "function", "function": {
        "name": "add", "arguments": '{"a": 5, "b": 7}'}}], finish_reason="tool_calls")
    reply["choices"][0]["message"]["reasoning_content"] = "The user wants 5+7; use add."
    return reply


# ---- Groq: usage in x_groq, stream_options refused ----------------------------------------------

def groq(body: Any, headers: Any) -> Any:
    """400 for stream_options (an older Groq); streams usage only under `x_groq`."""
    if "stream_options" in body:
        return _error(400, "property 'stream_options' is unsupported")
    last = chunk(finish_reason="stop")
    last["x_groq"] = {"id": "req_1", "usage": {"prompt_tokens": 21, "completion_tokens": 3,
                                               "total_tokens": 24}}
    return {"stream": [chunk("hi"), last]}


# ---- llama-cpp-python 0.3.36's server: its own schema form, 500 for OpenAI's -----------------

def llama_cpp_python(body: Any, headers: Any) -> Any:
    """HTTP 500 (pydantic) for response_format json_schema; json_object with a schema is taken
    (the reply is what the constrained model writes)."""
    rf = body.get("response_format") or {}
    if rf.get("type") == "json_schema":
        return {"status": 500, "body": {"error": {"message": (
            "[{'type': 'literal_error', 'loc': ('body', 'response_format', 'type'), 'msg': "
            "\"Input should be 'text' or 'json_object'\", 'input': 'json_schema'}]"),
            "type": "internal_server_error"}}}
    return completion('{"type": "final", "content": "ok"}')


# ---- A small model (SmolLM2-135M) on llama-cpp-python, decoding held to the action's schema -----

def small_model_on_llama_cpp(body: Any, headers: Any) -> Any:
    """What bench/small_model.py measured: after a tool's result the model repeats its last
    call verbatim for as long as the schema offers that tool (its next-token preference for
    "tool" over "final" is ~5 nats, whatever the wording); when the tool is not offered it
    answers with the result's words. The first call takes "A plus B" from the question."""
    refused = llama_cpp_python(body, headers)
    if refused.get("status"):
        return refused
    forms = body["response_format"]["schema"]["anyOf"]
    offered = [f["properties"]["name"]["enum"][0] for f in forms if "name" in f["properties"]]
    said = [m["content"] for m in body["messages"] if m["role"] == "assistant"]
    if said and json.loads(said[-1])["name"] in offered:
        return completion(said[-1])
    if said:
        result = body["messages"][-1]["content"].split("Result:\n")[-1]
        return completion(json.dumps({"type": "final", "content": result}))
    a, b = re.search(r"(\d+) plus (\d+)", body["messages"][-1]["content"]).groups()
    return completion(json.dumps({"type": "tool_call", "name": offered[0],
                                  "arguments": {"a": int(a), "b": int(b)}}))
