"""The CLI runs a real MCP tool end to end: -p, a real stdio MCP server (the hand-written one:
it starts in milliseconds, where the SDK's takes a second and a half of CPU), the fake OpenAI
server.

Pins that the CLI's MCP tool port takes the runtime's `cancel=` keyword (a port without it made
every MCP call from the CLI an "executor unavailable" error)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from fake_openai import FakeOpenAI
from conftest import final, run_cli, write_config

RAW_SERVER = Path(__file__).resolve().parent / "mcp_raw_server.py"


def test_an_mcp_tool_runs_from_a_one_shot_prompt(tmp_path):
    call = json.dumps({"type": "tool_call", "name": "t__echo", "arguments": {"text": "ping"}})
    with FakeOpenAI([call, final("done")]) as srv:
        write_config(tmp_path, srv, extra=(
            f'[[mcp.servers]]\nid = "t"\ncommand = "{sys.executable}"\n'
            f'args = ["{RAW_SERVER}"]\nstartup_timeout_ms = 20000\n'))
        out = run_cli(tmp_path, "-p", "echo ping")
        sent = json.dumps(srv.requests[-1]["body"]["messages"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"
    assert "Tool t__echo (call call_1) succeeded" in sent and "ping" in sent
    assert "executor unavailable" not in sent
