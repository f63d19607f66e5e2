"""The CLI, fourth round's attack on what the round changed: one-line displays cut in terminal
cells (terminals 1-2 columns wide, bidi controls in a model's or server's text), the flags a
session remembers (/model, /resume: a login in --base-url), `--stream` into a reader that left
(the session, its flags and the trace keep the turn). Every run is a real subprocess or a pty
against fake_openai, HOME and XDG_* in a temp dir."""
from __future__ import annotations

import json
from pathlib import Path

from conftest import KEY, Terminal, begun_early, final, write_config, xdg_env
from fake_openai import FakeOpenAI, stream_reply
from test_round4_cli import (LONG_REPLY, assert_fits, bob, echo_config, narrow, screen_lines,
                             status_redraws, streamed_to_a_reader_that_leaves)


def sessions(tmp_path: Path) -> Path:
    return tmp_path / "xd" / "bob" / "sessions"


# ---- 1. one-line displays ----

def test_the_status_line_fits_a_terminal_narrower_than_its_ellipsis(tmp_path, srv):
    # On a 2-column terminal the status line was cut to "..." (3 columns): it wrapped, and each
    # redraw (10 a second) added a line.
    seen = status_redraws(tmp_path, srv, 2, b"\x1b[K", 6)
    assert b"." in seen
    assert_fits(seen, 2)


BIDI = "\u202e\u2066\u2067\u2068\u2069\u202a\u202b\u202c\u202d\u200e\u200f\u061c"


EVIL = f"{BIDI}gnp.exe"


def begin_bidi(tmp_path: Path, srv: FakeOpenAI) -> Terminal:
    call = json.dumps({"type": "tool_call", "name": "t__echo", "arguments": {"text": EVIL}})
    srv.push(final("first"), call, final("done"))
    write_config(tmp_path, srv)       # the one-shot calls no tool: no MCP server (a second)
    assert bob(tmp_path, "--session", "bidi", "-p", EVIL).returncode == 0
    echo_config(tmp_path, srv, runtime="turn_timeout_ms = 20000\n")   # the MCP server starts
    return narrow(tmp_path, 200)


def test_bidi_controls_from_the_model_or_a_server_never_reach_the_terminal(early):
    # A tool line, /history or /sessions showing U+202E (right-to-left override) let the model
    # or an MCP server draw the rest of bob's line backwards (Trojan Source): "<- t__echo:
    # {RLO}txt.exe" reads as "exe.txt".
    term = early["bidi"].run
    try:
        term.expect(b"bob> ")
        term.send(b"/resume bidi\r")
        seen = term.expect(b"bob> ")
        term.send(b"go\r")
        seen += term.expect(b"this session? ", timeout=10)   # the approval prompt
        term.send(b"y\r")
        seen += term.expect(b"bob> ", timeout=10)            # the tool call lines
        for command in (b"/history", b"/sessions"):
            term.send(command + b"\r")
            seen += term.expect(b"bob> ")
    finally:
        term.close()
    assert seen.count(b"gnp.exe") >= 5, seen   # prompt, call, result, history, sessions
    assert not [c for c in BIDI if c.encode() in seen], seen


def begin_zalgo(tmp_path: Path, srv: FakeOpenAI) -> Terminal:
    zalgo = "e" + "\u0301" * 200_000
    call = json.dumps({"type": "tool_call", "name": "t__echo", "arguments": {"text": zalgo}})
    srv.push(call, final("done"))
    echo_config(tmp_path, srv, runtime="turn_timeout_ms = 20000\n")
    return narrow(tmp_path, 80)


def test_a_line_of_combining_marks_is_cut_too(early):
    # Combining marks take no column, so a line of them was never cut: an argument of 200,000
    # (a hostile model's) was written whole to the terminal by the approval prompt, the tool
    # line and /history (1 MB of them: a second each, on the turn's time).
    term = early["zalgo"].run
    try:
        term.expect(b"bob> ")
        term.send(b"go\r")
        seen = term.expect(b"this session? ", timeout=10)   # the approval prompt
        term.send(b"y\r")
        seen += term.expect(b"bob> ", timeout=10)            # the tool call lines
        term.send(b"/history\r")
        seen += term.expect(b"bob> ", timeout=10)
    finally:
        term.close()
    lines = [line for line in screen_lines(seen) if "\u0301" in line]
    assert len(lines) >= 4, seen[-2000:]   # prompt, call, result, history
    assert max(map(len, lines)) <= 4 * 80, [len(line) for line in lines]


# ---- 2. the flags a session remembers ----

def test_a_login_in_base_url_is_never_saved_with_the_session(tmp_path, srv):
    # --base-url http://user:KEY@host/v1 was written, key and all, to the session's .flags.
    srv.push(final("one"), final("two"))
    url = srv.url.replace("http://", f"http://user:{KEY}@")
    first = bob(tmp_path, "--base-url", url, "--model", "local:m", "--session", "s", "-p", "hi")
    assert first.returncode == 0 and first.stdout == "one\n", first.stderr
    assert sorted(p.name for p in sessions(tmp_path).iterdir()) == ["s.flags", "s.json"]
    for path in sessions(tmp_path).iterdir():
        assert KEY not in path.read_text(), path
    assert json.loads((sessions(tmp_path) / "s.flags").read_text()) == {"model": "local:m"}
    again = bob(tmp_path, "--base-url", url, "-c", "-p", "again")   # the login given again
    assert again.returncode == 0 and again.stdout == "two\n", again.stderr
    assert srv.requests[1]["body"]["model"] == "m"
    assert KEY not in again.stderr


def test_a_model_name_with_an_at_sign_is_remembered(tmp_path, srv):
    # Vertex AI's model names hold "@" (claude-3-5-sonnet@20240620): only a login in
    # --base-url is kept off the disk, never such a model.
    srv.push(final("one"), final("two"))
    assert bob(tmp_path, "--base-url", srv.url, "--model", "local:claude@20240620",
               "--session", "s", "-p", "hi").returncode == 0
    again = bob(tmp_path, "--base-url", srv.url, "-c", "-p", "again")
    assert again.returncode == 0 and again.stdout == "two\n", again.stderr
    assert srv.requests[1]["body"]["model"] == "claude@20240620"


def test_resume_says_what_it_did_when_the_remembered_flags_do_not_work(tmp_path, srv):
    # /resume of a session whose remembered key variable is not set said "resumed session s",
    # then the error, and the next turns went to the session the person had just left.
    srv.push(final("one"), final("two"))
    assert bob(tmp_path, "--base-url", srv.url, "--model", "local:m", "--session", "s",
               "-p", "the first message").returncode == 0
    (sessions(tmp_path) / "s.flags").write_text(json.dumps({"api_key_env": "NOT_SET_KEY"}))
    term = Terminal(tmp_path, "--base-url", srv.url, "--model", "local:m",
                    env=xdg_env(tmp_path))
    try:
        term.expect(b"bob> ")
        term.send(b"/resume s\r")
        said = term.expect(b"bob> ")
        term.send(b"again\r")
        term.expect(b"bob> ", timeout=10)
    finally:
        term.close()
    assert b"resumed session s" in said and b"NOT_SET_KEY" in said, said
    assert "the first message" in json.dumps(srv.requests[1]["body"]["messages"])   # resumed
    assert srv.requests[1]["body"]["model"] == "m"                   # on the running flags


# ---- 3. --stream into a reader that left ----

def test_a_stream_whose_reader_left_keeps_the_turn_its_flags_and_its_trace(tmp_path, srv):
    # The session held the turn, but its flags were written after the answer's print, which
    # met the broken pipe: `bob -c` went back to the default model.
    srv.push(stream_reply(LONG_REPLY), final("again"))
    streamed_to_a_reader_that_leaves(tmp_path, "--base-url", srv.url, "--model", "local:kept",
                                     "--session", "s", "--trace", "t.jsonl", "-p", "hi")
    state = json.loads((sessions(tmp_path) / "s.json").read_text())
    assert [m["role"] for m in state["messages"]] == ["user", "assistant"]
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "t.jsonl").open()]
    assert "turn_started" in kinds and kinds[-1] == "turn_completed"
    again = bob(tmp_path, "-c", "-p", "more")   # no flags: the session's own
    assert again.returncode == 0 and again.stdout == "again\n", again.stderr
    assert srv.requests[1]["body"]["model"] == "kept"


# The REPLs above that start an MCP server (their CLI imports the MCP SDK: a second of CPU),
# begun together
early = begun_early({"bidi": begin_bidi, "zalgo": begin_zalgo})
