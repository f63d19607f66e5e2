"""Round 7, a hostile review of the day's changes (git diff 274d643 HEAD -- bob.py bob_mcp.py
bob_cli.py). Each test here was a break found, a strict xfail saying what broke, what the user
saw, where, and the fix suggested; all five are fixed, and plain tests now (with one more
case of the last: a call's error). Real parts only: the fake OpenAI server, a real stdio MCP
server (tests/mcp_raw_server.py, which starts in milliseconds), a small HTTP MCP server.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI

import bob
from bob import (AgentEvent, AgentRequest, AgentRuntime, FunctionTools, JsonlEventSink, Message,
                 ToolCall, TurnPolicy)
from bob_mcp import McpServerConfig, McpToolPort
from conftest import make_llm
from test_round7_attack import SECRET, _EchoHandler   # an HTTP MCP server echoing its token

RAW = str(Path(__file__).with_name("mcp_raw_server.py"))


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


HISTORY = [Message("user", "2+3?"),
           Message("assistant", "", (ToolCall("call_1", "add", {"a": 2, "b": 3}),),
                   reasoning="The user wants 2+3; use add."),
           Message("tool", "5", tool_call_id="call_1", name="add"),
           Message("user", "and 4+4?")]


# ---- bob.py: the adapter's words regex -----------------------------------------------------------

def test_escaped_line_breaks_after_the_field_name_do_not_hold_the_turn():
    body = '{"error": {"message": "reasoning_content' + "\\n" * 29 + '"}}'
    with FakeOpenAI([{"status": 400, "body": body}, "8"]) as srv:
        rt = AgentRuntime(make_llm(srv, retry_max=0), FunctionTools([add]), action_mode="native",
                          policy=TurnPolicy(turn_timeout_ms=200))
        t0 = time.monotonic()
        rt.run(AgentRequest("and 4+4?", history=HISTORY[:3]))
        took = time.monotonic() - t0
    assert took < 0.2 + 0.4, f"{took:.2f} s"


# ---- bob_mcp.py: _scrub's _INPUT_QUOTE over every text ---------------------------------------

FILE = """class Model(BaseModel):
    def check(self, input_value=None):   # a line of code the tool read
        return input_value
# ... the rest of the file the model asked for ...
raise ValueError(f"bad {x}, input_type={type(x)}")
"""


@pytest.fixture(scope="module")
def raw_port():
    with McpToolPort([McpServerConfig("r", command=sys.executable, args=(RAW,))]) as port:
        yield port


def test_a_tool_result_quoting_input_value_reaches_the_model_whole(raw_port):
    r = raw_port.call_tool(ToolCall("c1", "r__echo", {"text": FILE}), 5.0)
    assert r.content == FILE


def test_a_tool_result_full_of_input_value_does_not_hold_the_call(raw_port):
    text = "input_value=" * 3_400   # 41 KB
    t0 = time.monotonic()
    r = raw_port.call_tool(ToolCall("c2", "r__echo", {"text": text}), 0.2)
    took = time.monotonic() - t0
    assert r.content.startswith("input_value=")
    assert took < 0.2 + 0.4, f"{took:.2f} s"


class _EchoOnCallHandler(_EchoHandler):
    """An MCP server that starts and lists its tool as it should, then answers a call with no
    JSON-RPC message, echoing the request's Authorization header in it."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        method = body.get("method")
        if "id" not in body:
            return self._send(202)
        if method == "tools/call":
            return super()._send(200, json.dumps({"jsonrpc": "2.0", "id": body["id"], "result": 5,
                                                  "echo": self.headers.get("Authorization")}
                                                 ).encode(), "application/json")
        result = {"tools": [{"name": "t", "inputSchema": {"type": "object"}}]} if (
            method == "tools/list") else {"protocolVersion": body["params"]["protocolVersion"],
                                          "capabilities": {"tools": {}},
                                          "serverInfo": {"name": "echo", "version": "1"}}
        self._send(200, json.dumps({"jsonrpc": "2.0", "id": body["id"], "result": result}
                                   ).encode(), "application/json")


def test_a_secret_a_server_echoes_in_a_bad_call_answer_is_not_in_the_result():
    """The call's error is the SDK's validation error quoting the answer cut short: its
    input_value is left out there too (the tool result reaches the model and the trace)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EchoOnCallHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg = McpServerConfig("w", "streamable_http",
                          url=f"http://127.0.0.1:{server.server_address[1]}/mcp",
                          headers={"Authorization": f"Bearer {SECRET}"})
    try:
        with McpToolPort([cfg]) as port:
            r = port.call_tool(ToolCall("c1", "w__t", {}), 5.0)
    finally:
        server.shutdown()
        server.server_close()
    assert r.is_error and "input_value=(left out)" in r.content, r.content
    assert not [SECRET[i:i + 6] for i in range(len(SECRET) - 5) if SECRET[i:i + 6] in r.content]


# ---- bob_mcp.py: a secret through -v -------------------------------------------------------------
# (tests/test_round7_attack.py's run against the echoing server is a `-v` run: it checks this)


# ---- bob.py: JsonlEventSink after a stall ------------------------------------------------------

def test_a_reader_back_after_a_stall_gets_the_next_long_lines_whole(monkeypatch):
    monkeypatch.setattr(bob, "_SINK_WAIT_S", 0.05)
    r, w = os.pipe()
    fcntl.fcntl(r, 1031, 4096)   # F_SETPIPE_SZ: one page
    sink = JsonlEventSink(f"/dev/fd/{w}")
    with pytest.raises(OSError, match="did not take the line"):   # nobody reads yet: a stall
        sink.emit(AgentEvent("note", "s", 0, {"text": "a" * 10_000}, 0.0))
    got = []
    back = threading.Event()

    def reader():   # back, and reading all the time
        while piece := os.read(r, 65536):
            got.append(piece)
            back.set()
    t = threading.Thread(target=reader)
    t.start()
    assert back.wait(5)   # it took what the pipe held: the pipe is empty, the reader reading
    failed = []
    for step in range(1, 6):
        try:
            sink.emit(AgentEvent("note", "s", step, {"text": "b" * 10_000}, 0.0))
        except OSError as e:
            failed.append(f"step {step}: {e}")
    sink.close()
    os.close(w)
    t.join(5)
    os.close(r)
    assert not failed, failed
    lines = b"".join(got).splitlines()
    assert sum(b'"text": "' + b"b" * 10_000 + b'"' in line for line in lines) == 5
