"""The OpenAI adapter's learnt refusals against errors that quote the user's own text.

An error naming `reasoning_content` (or `extra_content`) to a request whose messages carried it
is learnt as a refusal: the adapter stops sending the field. A safety filter quoting the
user's prompt names the field only because the user did: bob looks for the name in the error
with the texts the request sent cut out of it (as sent, and as a JSON error body escapes them),
and a real refusal is still learnt whatever the user wrote. Real parts: the fake HTTP server.
"""
from __future__ import annotations

import pytest
from fake_openai import FakeOpenAI

from bob import CancelToken, LlmError, LlmRequest, Message, ToolCall
from conftest import make_llm


def history(asked: str) -> list[Message]:
    """The user asked `asked`; the model (a thinking one) called a tool with its reasoning."""
    return [Message("user", asked),
            Message("assistant", "", (ToolCall("call_1", "add", {"a": 2, "b": 3}),),
                    reasoning="The user wants 2+3; use add."),
            Message("tool", "5", tool_call_id="call_1", name="add"),
            Message("user", "and 4+4?")]


def reasoning_sent(asked: str, *answers) -> list[bool]:
    """Ask twice (the first answer an error); whether each request carried the reasoning."""
    with FakeOpenAI([*answers, "ok", "ok"]) as srv:
        llm = make_llm(srv, retry_max=0)
        for _ in range(2):
            try:
                llm.complete(LlmRequest(history(asked), [], None, None), CancelToken())
            except LlmError:
                pass
        return ["reasoning_content" in r["body"]["messages"][1] for r in srv.requests]


def rejected(text: str) -> dict:
    return {"status": 400, "body": {"error": {"message": text}}}


def test_a_safety_filter_quoting_a_prompt_with_quotes_and_lines_is_no_refusal():
    """The quoted prompt reaches the error JSON-escaped (\\" and \\n): still the user's text."""
    asked = 'what does "reasoning_content" mean?\nand 2+3?'
    flagged = rejected(f"Rejected by the safety system: the prompt '{asked}' may be unsafe")
    assert reasoning_sent(asked, flagged) == [True, True]


@pytest.mark.parametrize("asked", [
    "what does reasoning_content mean?",   # named by the user, not quoted by the server
    "on",                                  # a text that is part of the field's name
])
def test_a_refusal_is_learnt_whatever_the_user_wrote(asked):
    refusal = rejected("Unrecognized request argument supplied: reasoning_content")
    assert reasoning_sent(asked, refusal) == [True, False, False]
