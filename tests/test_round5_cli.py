"""The CLI's known gaps closed in the fifth round: the REPL with stdout redirected (`bob >
answers.txt`) keeps line editing and history recall (at the approval prompt too), its answers
go to the file and nothing typed does (nor what its /commands print), its one-line displays
fit the terminal as it is resized, and a reader that left (`bob | head -1`) ends it with 141;
`/resume` of a session whose remembered flag fails says so as a remembered flag. Every run is a
real subprocess on a pty against fake_openai, HOME and XDG_* in a temp dir."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import struct
import sys
import termios
from pathlib import Path

from conftest import Terminal, final, write_config, xdg_env

LEFT, UP = b"\x1b[D", b"\x1b[A"
RAW_SERVER = Path(__file__).resolve().parent / "mcp_raw_server.py"


def redirected(tmp_path: Path, *args: str, columns: int = 200, **env: str) -> Terminal:
    """`bob ARGS > out.txt` on a pty `columns` wide: stdin and stderr are the terminal."""
    with open(tmp_path / "out.txt", "wb") as out:
        term = Terminal(tmp_path, *args, env=xdg_env(tmp_path, **env), stdout=out)
    fcntl.ioctl(term.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    return term


def user_messages(request: dict) -> list[str]:
    return [m["content"] for m in request["body"]["messages"] if m["role"] == "user"]


# ---- 1. stdout redirected: line editing, history, answers in the file ----

def test_a_redirected_repl_edits_lines_recalls_history_and_files_only_answers(tmp_path, srv):
    # input() used readline only with stdout a terminal: a left arrow went into the message
    # as "\x1b[D", and the up arrow recalled nothing.
    srv.push(final("ANSWER-ONE"), final("ANSWER-TWO"), final("ANSWER-THREE"))
    write_config(tmp_path, srv)
    term = redirected(tmp_path, TERM="xterm")   # xterm: bracketed paste, the status line
    try:   # a turn's end: its stats line, then the prompt (readline draws it again at times)
        seen = term.expect(b"bob> ", timeout=10)
        term.send(b"wrld" + LEFT * 3 + b"o\r")            # an edit in the middle of the line
        seen += term.expect(b"LLM calls", timeout=10) + term.expect(b"bob> ")
        term.send(b"typed then dropped")
        seen += term.expect(b"dropped")
        term.wait_blocked_reading()   # (CPython's readline misses a SIGINT just before select)
        term.send(b"\x03")                                  # Ctrl-C drops the line
        seen += term.expect(b"bob> ")
        term.send(UP + b" again\r")                         # the first line, recalled
        seen += term.expect(b"LLM calls", timeout=10) + term.expect(b"bob> ")
        term.send(b"\x1b[200~pasted one\npasted two\x1b[201~\r")   # a bracketed paste
        seen += term.expect(b"LLM calls", timeout=10) + term.expect(b"bob> ")
        term.send(b"\x04")                                  # Ctrl-D quits
        assert term.proc.wait(10) == 0
    finally:
        term.close()
    assert [user_messages(r)[-1] for r in srv.requests] == [
        "world", "world again", "pasted one\npasted two"]
    assert (tmp_path / "out.txt").read_bytes() == b"ANSWER-ONE\nANSWER-TWO\nANSWER-THREE\n"
    assert b"ANSWER" not in seen, seen                      # the answers are not on the terminal
    assert b"world" in seen and b"tool calls 0" in seen     # what was typed, the stats line are


def test_a_redirected_repl_edits_the_approval_prompts_answers_too(tmp_path, srv):
    # The approval prompt reads while the turn's worker waits for it: its reason is edited as
    # any line, and the turn's answer still goes to the file.
    call = json.dumps({"type": "tool_call", "name": "t__echo", "arguments": {"text": "x"}})
    srv.push(call, final("ANSWER"))
    write_config(tmp_path, srv, extra=(
        '[policy]\nask_tools = ["t__echo"]\n'
        f'[[mcp.servers]]\nid = "t"\ncommand = "{sys.executable}"\nargs = ["{RAW_SERVER}"]\n'))
    term = redirected(tmp_path)
    try:
        term.expect(b"bob> ", timeout=10)
        term.send(b"go\r")
        term.expect(b"this session? ", timeout=10)
        term.send(b"n\r")
        term.expect(b"(optional, told to the model) ")
        term.send(b"too risy" + LEFT + b"k\r")
        seen = term.expect(b"bob> ", timeout=10)
        term.send(b"\x04")
        assert term.proc.wait(10) == 0
    finally:
        term.close()
    assert "too risky" in json.dumps(srv.requests[1]["body"]["messages"])
    assert (tmp_path / "out.txt").read_bytes() == b"ANSWER\n"
    assert b"ANSWER" not in seen, seen


def test_a_redirected_repl_whose_reader_left_ends_as_one_shot_runs_do(tmp_path, srv):
    # `bob | head -1` that exited: the answer's print met the broken pipe, and the REPL said
    # `bob: error: [Errno 32] Broken pipe` after each turn (or, flushing before each prompt,
    # forever); -p ends with 141, saying nothing.
    srv.push(final("the answer"))
    write_config(tmp_path, srv)
    read, write = os.pipe()
    os.close(read)
    term = Terminal(tmp_path, env=xdg_env(tmp_path), stdout=write)
    os.close(write)
    try:
        term.expect(b"bob> ", timeout=10)
        term.send(b"hi\r")
        assert term.proc.wait(10) == 141
        rest = b""
        with contextlib.suppress(OSError):   # EIO: all read
            while chunk := os.read(term.fd, 4096):
                rest += chunk
    finally:
        term.close()
    assert b"bob: " not in rest, rest


def one_turn_into_a_full_disk(tmp_path, srv, *args: str) -> bytes:
    """A REPL whose stdout is /dev/full (a full disk): one turn, then Ctrl-D; what the terminal
    showed of the turn (test_round5_attack.py uses it too)."""
    write_config(tmp_path, srv)
    full = os.open("/dev/full", os.O_WRONLY)
    term = Terminal(tmp_path, *args, env=xdg_env(tmp_path), stdout=full)
    os.close(full)
    try:
        term.expect(b"bob> ", timeout=10)
        term.send(b"go\r")
        said = term.expect(b"bob> ", timeout=10)
        term.send(b"\x04")
        assert term.proc.wait(10) == 0
    finally:
        term.close()
    return said


def test_a_redirected_repl_whose_file_is_full_says_so_once_a_turn(tmp_path, srv):
    # `bob > file` on a full disk: the answer's print failed, and then the flush before each
    # prompt did too, and the REPL said `No space left on device` again and again, forever.
    srv.push(final("ANSWER"))
    said = one_turn_into_a_full_disk(tmp_path, srv)
    assert said.count(b"No space left on device") == 1, said
    assert b"ANSWER" in said   # shown rather than lost


def test_a_redirected_repls_commands_show_on_the_terminal_not_in_the_file(tmp_path, srv):
    # What the /commands print went to stdout: with it redirected, /help, /history, /model's
    # and /save's notes ended up in the file among the answers, and the terminal showed none.
    srv.push(final("ANSWER"))
    write_config(tmp_path, srv)
    term = redirected(tmp_path)
    commands = {   # each /command -> what it shows on the terminal
        "/help": "/tools         the tools the model may call", "/history": "user: hi",
        "/usage": "completion = ", "/tools": "no tools (MCP servers",
        "/sessions": "turns   1  hi", "/model openai:other": "model: openai:other",
        "/save t.md": "saved 2 messages to t.md", "/save": "/save needs an argument",
        "/nope": "unknown command '/nope'", "/resume gone": "no session gone in",
        "/reset": "new session cli-"}
    try:
        term.expect(b"bob> ", timeout=10)
        term.send(b"hi\r")
        term.expect(b"LLM calls", timeout=10)
        term.expect(b"bob> ")
        for line, shown in commands.items():
            term.send(line.encode() + b"\r")
            seen = term.expect(b"bob> ", timeout=10).decode()
            assert shown in seen, (line, seen)
        term.send(b"\x04")
        assert term.proc.wait(10) == 0
    finally:
        term.close()
    assert (tmp_path / "out.txt").read_bytes() == b"ANSWER\n"   # the answers, and only them
    assert (tmp_path / "t.md").read_text().startswith("# bob session cli-")


def event_lines(raw: bytes) -> list[str]:
    """The -v event lines drawn (`  [step] kind  data`), escape sequences left out."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.decode("utf-8", "replace"))
    return [line for line in re.split(r"[\r\n]", text) if line.startswith("  [")]


def test_a_redirected_repl_cuts_its_displays_to_the_terminal_as_it_is_resized(tmp_path, srv):
    # The one-line displays took stdout's width: with stdout a file, 80 columns, whatever the
    # terminal's. A resize (SIGWINCH) while a line is typed leaves the line, and the file, whole.
    long = "x" * 300
    srv.push(final(long), final(long))
    write_config(tmp_path, srv)
    term = redirected(tmp_path, "-v", columns=50)
    try:
        term.expect(b"bob> ", timeout=10)
        term.send(b"hi\r")
        narrow = event_lines(term.expect(b"bob> ", timeout=10))
        term.send(b"wor")
        term.expect(b"wor")
        fcntl.ioctl(term.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        term.send(b"ld\r")   # (the resize drew the prompt again: "bob> " is no sign here)
        wide = event_lines(term.expect(b"turn_completed", timeout=10))
        term.expect(b"bob> ", timeout=10)
        term.send(b"\x04")
        assert term.proc.wait(10) == 0
    finally:
        term.close()
    assert narrow and max(map(len, narrow)) == 50, narrow    # cut to the terminal, not to 80
    assert wide and max(map(len, wide)) == 120, wide
    assert [m for r in srv.requests for m in user_messages(r)][-1] == "world"
    assert (tmp_path / "out.txt").read_text() == f"{long}\n{long}\n"


# ---- 2. /resume of a session whose remembered flag fails ----

def test_resume_words_a_remembered_flag_that_fails_as_the_sessions(tmp_path, srv):
    # It read as if typed: `bob: error: --model: model 'x' must be 'provider:model', ...`.
    srv.push(final("one"), final("two"))
    write_config(tmp_path, srv)
    sessions = tmp_path / "xd" / "bob" / "sessions"
    term = Terminal(tmp_path, "--session", "s1", "--model", "local:m", env=xdg_env(tmp_path))
    try:
        term.expect(b"bob> ", timeout=10)
        term.send(b"the first message\r")
        term.expect(b"bob> ", timeout=10)
    finally:
        term.close()
    (sessions / "s1.flags").write_text(json.dumps({"model": "x"}))   # edited by hand
    term = Terminal(tmp_path, env=xdg_env(tmp_path))
    try:
        term.expect(b"bob> ", timeout=10)
        term.send(b"/resume s1\r")
        said = term.expect(b"bob> ").decode()
        term.send(b"again\r")
        term.expect(b"bob> ", timeout=10)
    finally:
        term.close()
    said = " ".join(said.split())
    assert "bob: resumed session s1 (2 messages)" in said, said
    assert "bob: error: model 'x' must be 'provider:model'" in said, said
    assert said.endswith("(session s1 remembers --model: the session goes on with the running "
                         "model: /model NAME, or --forget s1)"), said
    assert "the first message" in json.dumps(srv.requests[1]["body"]["messages"])   # resumed
    assert srv.requests[1]["body"]["model"] == "test"                # on the running model
