"""The CLI's known gaps closed in the eighth round: the approval prompt of a turn whose time
runs out in the very instant the prompt comes up, and `bob -p ... > out.txt` when the sessions
directory is on that same full disk. Every run is a real subprocess (on a pty for the REPL)
against fake_openai, HOME and XDG_* in a temp dir; the full disk is a real one (a small tmpfs,
filled, in a mount namespace of its own)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import Terminal, write_config, xdg_env

RAW_SERVER = Path(__file__).resolve().parent / "mcp_raw_server.py"


# ---- 1. the approval prompt of a turn that ends as it comes up ----------------------------------

ROUNDS = 4


def test_an_approval_prompt_never_outlives_its_turn(tmp_path, srv):
    # The main thread looks for an approval to ask every 0.1 s, and once more when the turn
    # ends. A turn whose time ran out between the call being asked and that look (here: every
    # turn, 80 ms long, each asking in its first few ms) put the prompt up after the turn had
    # ended, and nothing took it down: "[y]es / [n]o / [a]lways ...?" waited for an answer
    # that went nowhere, the turn's end already shown above it.
    call = json.dumps({"type": "tool_call", "name": "t__echo", "arguments": {"text": "x"}})
    srv.push(*[call] * ROUNDS)
    write_config(tmp_path, srv, runtime="turn_timeout_ms = 80\n", extra=(
        '[policy]\nask_tools = ["t__echo"]\n'   # the hand-written server: no SDK to import
        f'[[mcp.servers]]\nid = "t"\ncommand = "{sys.executable}"\nargs = ["{RAW_SERVER}"]\n'))
    term = Terminal(tmp_path, env=xdg_env(tmp_path))
    try:
        term.expect(b"bob> ", timeout=10)
        term.send(b"/tools\r")
        term.expect(b"t__echo", timeout=10)   # the server is up: a turn's time is its own
        term.expect(b"bob> ")
        for _ in range(ROUNDS):
            term.send(b"go\r")
            ended = term.expect(b"bob> ", timeout=2)   # stuck at the prompt: never
            assert b"turn_timeout" in ended, ended
            # no Ctrl-C meant for the prompt lands on `bob> `: the line typed there is run
            term.send(b"/usage\r")
            assert b"tokens" in term.expect(b"bob> ")
    finally:
        term.close()
    assert len(srv.requests) == ROUNDS
