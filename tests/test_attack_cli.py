"""Attacks on the CLI (bob_cli.py) by a helper: each test showed a break of one of bob's promises
(no internal error, no secret shown, the terminal not driven by others' text), on a real
subprocess or pty against fake_openai, and failed before its fix."""
from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (CLI, Terminal, begun_together, cli_begun, collected, final, write_config,
                      xdg_env)
from fake_openai import FakeOpenAI
from mcp_http_server import McpHttpServer


def bob(tmp_path: Path, *args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess:
    """The CLI in tmp_path, stdin piped, HOME and XDG_* inside tmp_path."""
    return subprocess.run([sys.executable, str(CLI), *args], cwd=tmp_path, input=stdin,
                          env=xdg_env(tmp_path, **env), capture_output=True, text=True,
                          timeout=15, check=False)


def rest(term: Terminal, secs: float = 3.0) -> bytes:
    """What the terminal shows until the CLI exits or `secs` pass (for a CLI that may die)."""
    end = time.monotonic() + secs
    while time.monotonic() < end and term.proc.poll() is None or select.select(
            [term.fd], [], [], 0)[0]:
        if select.select([term.fd], [], [], 0.05)[0]:
            try:
                data = os.read(term.fd, 65536)
            except OSError:
                break
            if not data:
                break
            term.seen += data
    out, term.seen = term.seen, b""
    return out


def test_save_to_an_unknown_users_home_is_an_error_line_and_the_repl_goes_on(tmp_path, srv):
    write_config(tmp_path, srv)
    term = Terminal(tmp_path, env=xdg_env(tmp_path))
    try:
        term.expect(b"bob> ")
        term.send(b"/save ~nosuchuser-bob/x.md\r")
        try:
            shown = term.expect(b"bob> ")         # the prompt again: the REPL went on
        except AssertionError:                  # no prompt: what it showed, and how it ended
            shown = rest(term, 2.0)
        assert term.proc.poll() is None, f"the REPL died (exit {term.proc.poll()}): {shown!r}"
        assert b"bob: error: " in shown and b"internal error" not in shown, shown
    finally:
        term.close()


@pytest.mark.parametrize("args", [("--sessions",), ("-c", "-p", "hi")])
def test_a_dangling_file_in_the_sessions_directory_is_no_internal_error(tmp_path, srv, args):
    srv.push(final("ok"))
    write_config(tmp_path, srv)
    sessions = tmp_path / "xd" / "bob" / "sessions"
    sessions.mkdir(parents=True)
    (sessions / "gone.json").symlink_to(tmp_path / "moved-away.json")
    r = bob(tmp_path, *args)
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 0, r.stderr


STDERR_ESCAPES = ('import sys; sys.stderr.write("up \\x1b]0;pwned\\x07 \\x1b[2J boom\\n"); '
                  'sys.exit(1)')   # an MCP server that retitles and clears the terminal, then dies


def begin_escapes(tmp_path: Path, srv: FakeOpenAI) -> subprocess.Popen:
    write_config(tmp_path, srv, extra=(f'[[mcp.servers]]\nid = "t"\ncommand = "{sys.executable}"'
                                       f"\nargs = ['-c', '{STDERR_ESCAPES}']\n"))
    return cli_begun(tmp_path, "-p", "hi", env=xdg_env(tmp_path))


def test_an_mcp_servers_stderr_cannot_drive_the_terminal_through_an_error_line(early):
    r = collected(early["escapes"].run)
    assert r.returncode == 1 and "failed to start" in r.stderr, r.stderr
    assert "\x1b" not in r.stderr and "\x07" not in r.stderr, repr(r.stderr)


def test_the_session_list_cannot_be_driven_by_piped_text(tmp_path, srv):
    srv.push(final("summary"))
    write_config(tmp_path, srv)
    r = bob(tmp_path, "--session", "s1", "-p", "-", stdin="notes \x1b]0;pwned\x07 \x1b[2J end\n")
    assert r.returncode == 0, r.stderr
    r = bob(tmp_path, "--sessions")
    assert r.returncode == 0 and r.stdout.startswith("s1 "), r.stdout
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout, repr(r.stdout)


def test_init_in_a_directory_removed_meanwhile_is_a_clear_error(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    r = subprocess.run(["sh", "-c", 'cd "$1" && rmdir "$1" && shift && exec "$@"', "sh", str(gone),
                        sys.executable, str(CLI), "--init"], env=xdg_env(tmp_path),
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=15)
    assert r.returncode == 1 and r.stderr.startswith("bob: error: cannot write agent.toml"), (
        r.stderr)


def test_save_never_silently_replaces_an_existing_file(tmp_path, srv):
    srv.push(final("one"))
    config = write_config(tmp_path, srv)
    before = config.read_text()
    (tmp_path / "notes.md").write_text("my own notes\n")
    term = Terminal(tmp_path, env=xdg_env(tmp_path))
    try:
        term.expect(b"bob> ")
        term.send(b"hello\r")
        term.expect(b"bob> ", timeout=8)
        said = b""
        for name in (b"notes.md", b"agent.toml"):
            term.send(b"/save " + name + b"\r")
            said += term.expect(b"bob> ")
    finally:
        term.close()
    kept = (tmp_path / "notes.md").read_text() == "my own notes\n" and config.read_text() == before
    assert kept or said.count(b"overwr") + said.count(b"exists") >= 2, said


def test_a_closed_stderr_keeps_stdout_clean_and_the_turn_runs(tmp_path, srv):
    srv.push(final("ok"))
    r = subprocess.run(["sh", "-c", 'exec "$0" "$@" 2>&-', sys.executable, str(CLI),
                        "--base-url", srv.url, "--model", "local:m", "-p", "hi"], cwd=tmp_path,
                       env=xdg_env(tmp_path), stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=15)
    assert (r.returncode, r.stdout) == (0, "ok\n"), (r.returncode, r.stdout)


def test_a_one_shot_with_stdin_closed_runs(tmp_path, srv):
    srv.push(final("ok"))
    r = subprocess.run(["sh", "-c", 'exec "$0" "$@" <&-', sys.executable, str(CLI),
                        "--base-url", srv.url, "--model", "local:m", "-p", "hi"], cwd=tmp_path,
                       env=xdg_env(tmp_path), capture_output=True, text=True, timeout=15)
    assert (r.returncode, r.stdout) == (0, "ok\n"), (r.returncode, r.stderr)


def begin_token(tmp_path: Path, srv: FakeOpenAI, http_url: str) -> subprocess.Popen:
    # The MCP server: tests/mcp_http_server.py, in a thread (the SDK's own server cost a
    # second of import, and the URL is bob's, not the server's)
    srv.push(final("ok"))
    url = f"{http_url}?token=${{MCP_TOKEN}}"
    write_config(tmp_path, srv, extra=('[[mcp.servers]]\nid = "h"\n'
                                       f'transport = "streamable_http"\nurl = "{url}"\n'))
    return cli_begun(tmp_path, "-v", "-p", "hi",
                     env=xdg_env(tmp_path, MCP_TOKEN="tok-s3cret-0123456789"))


def test_verbose_never_shows_a_token_in_an_mcp_url(early):
    r = collected(early["token"].run)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr[-2000:]
    leaks = [x for x in r.stderr.splitlines() if "s3cret" in x]
    assert not leaks, leaks[:3]


def test_an_empty_session_id_is_a_usage_error(tmp_path, srv):
    srv.push(final("one"), final("two"))
    write_config(tmp_path, srv)
    first = bob(tmp_path, "--session", "", "-p", "remember 42")
    second = bob(tmp_path, "--session", "", "-p", "what number?")
    assert first.returncode == 2 and "--session" in first.stderr, (
        first.returncode, first.stderr, second.returncode)


def lone_surrogates(text: str) -> list[str]:
    return [c for c in text if "\ud800" <= c <= "\udfff"]


def test_stdin_that_is_not_utf8_is_refused_or_replaced(tmp_path, srv):
    srv.push(final("ok"))
    write_config(tmp_path, srv)
    r = subprocess.run([sys.executable, str(CLI), "-p", "describe"], cwd=tmp_path,
                       input=b"caf\xe9 \x89PNG\r\n\x1a\n\xff\xfe", env=xdg_env(tmp_path),
                       capture_output=True, timeout=15, check=False)
    sent = "".join(m["content"] for q in srv.requests for m in q["body"]["messages"])
    refused = r.returncode == 2 and b"UTF-8" in r.stderr and not srv.requests
    assert refused or (r.returncode == 0 and not lone_surrogates(sent)), (
        r.returncode, r.stderr, [hex(ord(c)) for c in lone_surrogates(sent)])


def test_history_and_save_mask_secret_arguments_as_the_tool_line_does(tmp_path, srv):
    srv.push(json.dumps({"type": "tool_call", "name": "deploy",
                         "arguments": {"api_key": "sk-live-0123456789abcdef"}}), final("done"))
    write_config(tmp_path, srv)
    term = Terminal(tmp_path, env=xdg_env(tmp_path))
    try:
        term.expect(b"bob> ")
        term.send(b"deploy it\r")
        tool_line = term.expect(b"bob> ", timeout=8)
        term.send(b"/history\r")
        history = term.expect(b"bob> ")
        term.send(b"/save s.md\r")
        term.expect(b"bob> ")
    finally:
        term.close()
    assert b"sk-live" not in tool_line and b"-> deploy" in tool_line, tool_line   # masked here
    saved = (tmp_path / "s.md").read_text()
    assert b"sk-live" not in history and "sk-live" not in saved, (history, saved)


# The hand-written stdio server: the approval is the CLI's, before any call reaches a server,
# and it starts in milliseconds (tests/mcp_server.py imports the MCP SDK: a second of CPU).
RAW_SERVER = Path(__file__).resolve().parent / "mcp_raw_server.py"


def approval_config(tmp_path: Path, srv, runtime: str = "") -> None:
    write_config(tmp_path, srv, runtime=runtime, extra=(
        '[policy]\nask_tools = ["t__echo"]\n'
        f'[[mcp.servers]]\nid = "t"\ncommand = "{sys.executable}"\nargs = ["{RAW_SERVER}"]\n'))


def begin_typed_ahead(tmp_path: Path, srv: FakeOpenAI) -> Terminal:
    srv.push(json.dumps({"type": "tool_call", "name": "t__echo", "arguments": {"text": "rm"}}),
             final("done"))
    approval_config(tmp_path, srv)
    return Terminal(tmp_path, env=xdg_env(tmp_path))


def test_typed_ahead_text_does_not_approve_a_call(early):
    # "go" then "yes" typed while the turn ran: the prompt read "yes" and ran a call unseen.
    term = early["typed_ahead"].run
    try:
        term.expect(b"bob> ")
        term.send(b"go\ryes\r")          # "yes" typed while the turn runs, as a message
        term.expect(b"this session? ", timeout=10)
        term.send(b"n\r\r")              # the person's own answer, and no reason
        shown = term.expect(b"bob> ", timeout=10)
        before = shown.partition(b"why not? ")[0]   # a call run on "yes" shows before the answer
        assert b"<- t__echo" not in before, f"the call ran without the person's answer: {shown!r}"
        assert b"declined" in shown, shown
    finally:
        term.close()


def begin_always(tmp_path: Path, srv: FakeOpenAI) -> Terminal:
    call = json.dumps({"type": "tool_call", "name": "t__echo", "arguments": {"text": "x"}})
    srv.push(final("other"), call, final("one"), call, final("two"), call, final("three"))
    write_config(tmp_path, srv)             # session "other" needs no MCP server (seconds)
    assert bob(tmp_path, "--session", "other", "-p", "hi").returncode == 0
    approval_config(tmp_path, srv)
    return Terminal(tmp_path, env=xdg_env(tmp_path))


def test_always_holds_for_one_session_only(early):
    # "[a]lways for this tool this session" approved the tool in every session switched to.
    # Both switches in one REPL (its CLI imports the MCP SDK: a second of CPU): /reset, then
    # /resume of another session, each after an "always".
    term = early["always"].run
    try:
        term.expect(b"bob> ")
        term.send(b"first\r")
        term.expect(b"this session? ", timeout=10)
        for switch in (b"/reset", b"/resume other"):
            term.send(b"a\r")
            term.expect(b"bob> ", timeout=10)
            term.send(switch + b"\r")
            term.expect(b"bob> ")
            term.send(b"next\r")
            shown = term.expect(b"this session? ", timeout=10)   # asked again, in the new session
            assert b"<- t__echo" not in shown, switch
    finally:
        term.close()


# ---- the runs whose CLI imports the MCP SDK, begun together ----

@pytest.fixture(scope="module")
def early(tmp_path_factory):
    """The four runs above whose CLI starts an MCP server (a second of CPU each), begun
    together (conftest.begun_together)."""
    with McpHttpServer() as http, begun_together(tmp_path_factory, {
            "escapes": begin_escapes, "token": functools.partial(begin_token, http_url=http.url),
            "typed_ahead": begin_typed_ahead, "always": begin_always}) as runs:
        yield runs
