"""The CLI's known gaps closed in the eighth round: the approval prompt of a turn whose time
runs out in the very instant the prompt comes up, and `bob -p ... > out.txt` when the sessions
directory is on that same full disk. Every run is a real subprocess (on a pty for the REPL)
against fake_openai, HOME and XDG_* in a temp dir; the full disk is a real one (a small tmpfs,
filled, in a mount namespace of its own)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CLI, Terminal, final, write_config, xdg_env
from fake_openai import FakeOpenAI

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


# ---- 2. `bob -p ... > out.txt` with the sessions directory on that same full disk -------------

# Mounts a 64 KiB tmpfs on $XDG_DATA_HOME (where the sessions go), makes the sessions directory,
# fills the disk, then runs the command with stdout a file on it. In a user and mount namespace
# of its own (`unshare -rm`): no root needed, and the mount goes with the process.
ON_FULL_DISK = """set -e
mount -t tmpfs -o size=64k tmpfs "$XDG_DATA_HOME"
mkdir -p "$XDG_DATA_HOME/bob/sessions"
cat /dev/zero > "$XDG_DATA_HOME/fill" 2>/dev/null || true
exec "$@" > "$XDG_DATA_HOME/out.txt"
"""


def _can_mount_a_disk() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(not _can_mount_a_disk(), reason="needs unshare -rm (user namespaces)")
def test_an_answer_and_its_session_on_a_full_disk_are_both_said(tmp_path):
    # The answer's print failed before the line saying the session was not saved either: only
    # `bob: error: [Errno 28] No space left on device` was said, and the turn was gone with no
    # word (neither the answer nor the session holds it).
    (tmp_path / "xd").mkdir()
    with FakeOpenAI([final("the answer")]) as srv:
        write_config(tmp_path, srv)
        run = subprocess.run(["unshare", "-rm", "sh", "-c", ON_FULL_DISK, "sh", sys.executable,
                              str(CLI), "-p", "hi", "--session", "s1"], cwd=tmp_path,
                             env=xdg_env(tmp_path), stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=15, check=False)
    assert len(srv.requests) == 1
    lines = run.stderr.splitlines()
    assert len(lines) == 2, run.stderr   # one line each, no traceback
    session, answer = lines   # the answer is in no session: said first
    assert session.startswith("bob: error: could not save session s1: "), run.stderr
    assert session.endswith("s1.json: [Errno 28] No space left on device"), run.stderr
    assert answer == "bob: error: [Errno 28] No space left on device", run.stderr
    assert run.returncode == 1
