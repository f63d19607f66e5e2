"""The eighth round's last review: a break in its change (fixed: the test failed first) and
promises it makes that were checked and held.

1. The adapter's learnt refusals (`_unquoted`): a message whose text is the field's name alone
   cut that name out of a real refusal, which was then not learnt (before this round it was).
2. FunctionTools: a default JSON cannot hold is left out, and the request is strict JSON.
3. Replays side by side (the shared `_canonical` encoder, class defaults, `_cancel`, the
   caller's cancel through the port's on_interrupt) while a live runtime runs turns.

Real parts: the fake HTTP server, real runtimes and trace files.
"""
from __future__ import annotations

import json
import math
import threading

import pytest
from fake_openai import FakeOpenAI

import bob
from bob import (AgentRequest, AgentRuntime, CancelToken, FinishReason, FunctionTools,
                 LlmRequest, Message, ScriptedLlm)
from conftest import make_llm
from test_replay import big_run
from test_round8_refusal import reasoning_sent


# ---- 1. The adapter's learnt refusals -----------------------------------------------------------

UNRECOGNIZED = {"status": 400, "body": {"error": {
    "message": "Unrecognized request argument supplied: reasoning_content"}}}
# Mistral's (pydantic's) 422: the field's name only in `loc`, a JSON string of its own
EXTRA_FORBIDDEN = {"status": 422, "body": {"detail": [{
    "type": "extra_forbidden", "loc": ["body", "messages", 1, "reasoning_content"],
    "msg": "Extra inputs are not permitted", "input": "The user wants 2+3; use add."}]}}


@pytest.mark.parametrize("refusal", [UNRECOGNIZED, EXTRA_FORBIDDEN], ids=["openai", "mistral"])
def test_a_refusal_is_learnt_when_a_message_is_the_name_alone(refusal):
    assert reasoning_sent("reasoning_content", refusal) == [True, False, False]


def test_a_refusal_is_learnt_when_the_user_named_the_field_in_a_sentence():
    """Held: the user's sentence is not in the error, so nothing of it is cut."""
    asked = "is reasoning_content sent back?"
    assert reasoning_sent(asked, EXTRA_FORBIDDEN) == [True, False, False]


# ---- 2. FunctionTools: a default JSON cannot hold -----------------------------------------------

def test_defaults_json_cannot_hold_are_left_out_and_the_request_is_strict_json():
    """Held: math.inf, NaN and an int past Python's 4,300-digit limit are left out of the
    schema (each made every request invalid JSON, or failed to encode); the rest stay."""
    def scan(path: str, depth: float = math.inf, tolerance: float = math.nan,
             seed: int = 10 ** 5000, limit: int = 3, fast: bool = True,
             api_key: str = "sk-x") -> str:
        """Scan a path."""
        return path

    with FakeOpenAI(["ok"]) as srv:
        llm = make_llm(srv)
        tools = FunctionTools([scan]).list_tools()
        llm.complete(LlmRequest([Message("user", "hi")], tools, None, None), CancelToken())
        [req] = srv.requests
    params = req["body"]["tools"][0]["function"]["parameters"]
    json.dumps(params, allow_nan=False)   # strict JSON
    defaults = {k: p.get("default") for k, p in params["properties"].items()}
    assert defaults == {"path": None, "depth": None, "tolerance": None, "seed": None,
                        "limit": 3, "fast": True, "api_key": None}


# ---- 3. Replays side by side, while a live runtime runs turns ----------------------------------

def test_replays_in_threads_beside_a_live_runtime_all_report_the_same(tmp_path):
    """Held: four replays at once (their recorded cancel fired through each port's
    on_interrupt, `_canonical` shared) while one live runtime runs turns from two threads:
    every report is the recorded run's, every live turn its own."""
    path = tmp_path / "t.jsonl"
    big_run(path)
    expected = bob.replay(path).turns
    assert expected[-1].endswith("cancelled)")
    reports, live = [], []
    runtime = AgentRuntime(ScriptedLlm([f"answer {i}" for i in range(20)]), action_mode="native")

    def replays():
        reports.extend(bob.replay(path).turns for _ in range(2))

    def turns(name):
        live.extend(runtime.run(AgentRequest("hi", name)).finish_reason for _ in range(10))

    threads = [threading.Thread(target=replays) for _ in range(4)] + [
        threading.Thread(target=turns, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert reports == [expected] * 8
    assert live == [FinishReason.FINAL] * 20
