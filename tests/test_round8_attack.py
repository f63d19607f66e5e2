"""Round 8, the attack on what changed: the adapter's refusals cut of the texts the request
sent (_unquoted, _http_failure), the savings that must not change behaviour (the request body
posted as a str), and the CLI's approval prompt handshake and main()'s one error handler.

A strict xfail is a break found (its reason: what breaks, what the user sees, where in the
code); a plain test is a promise that held under the attack. Real parts only: the fake HTTP
server, a raw socket for the bytes on the wire, the CLI as a subprocess and on a real pty.
Sections: 1. Learnt refusals  2. The body on the wire  3. The approval prompt  4. main's errors
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI, completion

import bob
from bob import CancelToken, LlmError, LlmRequest, Message, ToolCall
from conftest import CLI, Terminal, final, make_llm, write_config, xdg_env

RAW_SERVER = Path(__file__).resolve().parent / "mcp_raw_server.py"


# ---- 1. Learnt refusals: the texts the request sent cut out of the error ---------------------

REFUSAL = "Unrecognized request argument supplied: reasoning_content"


def history(asked: str, system: str = "You are bob.") -> list[Message]:
    """The user asked `asked`; the model (a thinking one) called a tool with its reasoning."""
    return [Message("system", system), Message("user", asked),
            Message("assistant", "", (ToolCall("call_1", "add", {"a": 2, "b": 3}),),
                    reasoning="The user wants 2+3; use add."),
            Message("tool", "5", tool_call_id="call_1", name="add"),
            Message("user", "and 4+4?")]


def reasoning_sent(messages: list[Message], *answers) -> list[bool]:
    """Ask twice (the first answer an error); whether each request carried the reasoning."""
    with FakeOpenAI([*answers, "ok", "ok"]) as srv:
        llm = make_llm(srv, retry_max=0)
        for _ in range(2):
            try:
                llm.complete(LlmRequest(messages, [], None, None), CancelToken())
            except LlmError:
                pass
        return ["reasoning_content" in r["body"]["messages"][2] for r in srv.requests]


def rejected(text: str, status: int = 400) -> dict:
    return {"status": status, "body": {"error": {"message": text}}}


LEARNT, NOT_LEARNT = [True, False, False], [True, True]


@pytest.mark.xfail(strict=True, reason=(
    "a message text that is a piece of the field's name (here '_content' or 'ng_content': a "
    "user's word, a tool's result) is cut out of the refusal, which then no longer names the "
    "field: 'reasoning_content' becomes 'reasonin'. The refusal is never learnt and every "
    "turn of the session fails with HTTP 400 (before this round: learnt). bob.py _unquoted "
    "cuts any text holding '_content'; cut only a text that holds the field's whole name"))
@pytest.mark.parametrize("said", ["_content", "ng_content"])
def test_a_refusal_is_learnt_when_a_message_is_a_piece_of_the_fields_name(said):
    assert reasoning_sent(history(said), rejected(REFUSAL)) == LEARNT


@pytest.mark.xfail(strict=True, reason=(
    "a refusal naming the field only after the error's first 4,096 chars (here a gateway's "
    "error echoing the request, a 5,000-char system prompt first) is not learnt: every turn "
    "fails with HTTP 400. Before this round the name was looked for in the whole error "
    "(`f in text`); now in _unquoted(text[:4096]) (bob.py _http_failure). Cutting the "
    "whole error instead costs 40 s of CPU for a 16 MiB error and 2,000 long messages "
    "naming the field: cut a bounded head (64 KiB), look for the name there"))
def test_a_refusal_naming_the_field_after_4_kib_of_echo_is_learnt():
    system = "Answer briefly. " * 320   # 5,120 chars
    echo = json.dumps({"messages": [{"role": "system", "content": system},
                                    {"role": "assistant", "reasoning_content": "..."}]})
    assert reasoning_sent(history("2+3?", system),
                          rejected(f"bad request {echo}: {REFUSAL}")) == LEARNT


@pytest.mark.xfail(strict=True, reason=(
    "a safety filter quoting a user's prompt longer than ~4 KiB that names reasoning_content "
    "in its head is still learnt as a refusal (the bug this round fixed, for long prompts): "
    "the error is cut to 4,096 chars before the quoted text is cut out of it, so the quote, "
    "cut short, no longer matches. The adapter stops sending reasoning for its life "
    "(DeepSeek's thinking mode then fails each turn with tool calls). bob.py _http_failure: "
    "_unquoted(text[:4096], ...) - cut the texts out first, of a bounded head"))
def test_a_long_quoted_prompt_naming_the_field_is_no_refusal():
    asked = "Please explain what reasoning_content is in this API doc:\n" + "text " * 1000
    flagged = rejected(f"Rejected by the safety system: the prompt '{asked}' may be unsafe")
    assert reasoning_sent(history(asked), flagged) == NOT_LEARNT


@pytest.mark.xfail(strict=True, reason=(
    "a JSON body that leaves non-ASCII as it is (Python's ensure_ascii=False: Starlette's "
    "JSONResponse, so FastAPI servers; pydantic's model_dump_json; Rust's serde_json) quotes "
    "a prompt with a quote or a line break and an accent in a form _unquoted does not cut "
    "(it cuts the text as sent and json.dumps' ASCII-only form): the safety filter's error is "
    "learnt as a refusal, reasoning is no longer sent. bob.py _unquoted: cut "
    "json.dumps(c, ensure_ascii=False)[1:-1] too"))
def test_a_prompt_quoted_by_a_json_body_keeping_non_ascii_is_no_refusal():
    asked = '¿qué es "reasoning_content"?\nY 2+3?'
    body = json.dumps({"error": {"message": f"the prompt '{asked}' may be unsafe"}},
                      ensure_ascii=False)
    assert reasoning_sent(history(asked), {"status": 400, "body": body,
                                           "headers": {"Content-Type": "application/json"}}
                          ) == NOT_LEARNT


ASKED = 'what does "reasoning_content" mean?\nand 2+3?'


@pytest.mark.parametrize("status, message", [
    (400, f"{REFUSAL}. Your prompt: '{ASKED}'"),
    (400, f"Additional properties are not allowed ('reasoning_content' was unexpected); "
          f"input: {json.dumps(ASKED)}"),
    (422, json.dumps({"detail": [
        {"type": "extra_forbidden", "loc": ["body", "messages", 2, "reasoning_content"],
         "msg": "Extra inputs are not permitted", "input": "The user wants 2+3; use add."},
        {"type": "string_too_short", "loc": ["body", "messages", 1, "content"],
         "msg": "too short", "input": ASKED}]})),
    (500, f"Please remove the reasoning_content. ({ASKED})"),
])
def test_a_refusal_quoting_the_users_text_too_is_still_learnt(status, message):
    assert reasoning_sent(history(ASKED), rejected(message, status)) == LEARNT


def test_a_refused_extra_content_beside_a_quoted_prompt_naming_it_is_learnt():
    asked = "what is extra_content?"
    messages = [Message("user", asked),
                Message("assistant", "", (ToolCall("c1", "add", {}, extra={
                    "extra_content": {"google": {"thought_signature": "sig"}}}),)),
                Message("tool", "5", tool_call_id="c1", name="add"), Message("user", "more")]
    refusal = rejected(f"Unknown name \"extra_content\" at 'messages[1].tool_calls[0]': "
                       f"prompt '{asked}'")
    with FakeOpenAI([refusal, "ok"]) as srv:
        llm = make_llm(srv, retry_max=0)
        assert llm.complete(LlmRequest(messages, [], None, None), CancelToken()).content == "ok"
        sent = ["extra_content" in r["body"]["messages"][1]["tool_calls"][0]
                for r in srv.requests]
    assert sent == [True, False]
