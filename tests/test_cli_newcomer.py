"""The CLI a newcomer keeps open (issue 22): a closed stdout, the --init path to a local server,
notices, owner-only files, TERM=dumb / NO_COLOR, the README's known gaps, small things. Every
run is a real subprocess (or a pty) against fake_openai, HOME and XDG_* in a temp dir."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from conftest import CLI, KEY, Terminal, final, run_cli, write_config, xdg_env
from fake_openai import completion


def bob(tmp_path: Path, *args: str, stdin: str | None = "", **env: str
        ) -> subprocess.CompletedProcess[str]:
    """The CLI in tmp_path, XDG dirs inside it, stdin piped (empty unless given)."""
    return subprocess.run([sys.executable, str(CLI), *args], cwd=tmp_path, input=stdin,
                          env={**xdg_env(tmp_path), **env}, capture_output=True, text=True,
                          timeout=15, check=False)


def repl(tmp_path: Path, **env: str) -> Terminal:
    term = Terminal(tmp_path, env=xdg_env(tmp_path, **env))
    term.expect(b"bob> ")
    return term


# ---- output that cannot be lost, notices worth reading ----

def test_a_closed_stdout_is_exit_1_and_says_so(tmp_path, srv):
    srv.push(final("the answer"))
    write_config(tmp_path, srv)
    r = subprocess.run(f"{sys.executable} {CLI} -p hi >&-", shell=True, cwd=tmp_path,
                       env=xdg_env(tmp_path), capture_output=True, text=True, timeout=15)
    assert r.returncode == 1 and "stdout is closed" in r.stderr, (r.returncode, r.stderr)
    assert not srv.requests   # no turn was spent on an answer nobody could read


def test_init_then_its_local_server_lines_reach_a_local_server(tmp_path, srv):
    srv.push(final("local answer"))
    assert bob(tmp_path, "--init").returncode == 0
    config = (tmp_path / "agent.toml").read_text()
    # the template's two local-server lines, uncommented as it invites
    config = config.replace('# base_url = "http://127.0.0.1:8080/v1"', f'base_url = "{srv.url}"')
    config = config.replace('# default_model = "local:', 'default_model = "local:')
    (tmp_path / "agent.toml").write_text(config)
    r = bob(tmp_path, "-p", "hi")
    assert r.returncode == 0 and r.stdout == "local answer\n", r.stderr


def test_no_key_with_a_base_url_says_to_change_the_provider(tmp_path, srv):
    r = bob(tmp_path, "--base-url", srv.url, "-p", "hi")
    assert r.returncode == 2 and "local:NAME" in r.stderr, r.stderr
    assert "pass --base-url" not in r.stderr


def test_the_no_config_notice_is_shown_only_with_verbose(tmp_path, srv):
    srv.push(final("a"), final("b"))
    r = bob(tmp_path, "--base-url", srv.url, "--model", "local:m", "-p", "hi")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = bob(tmp_path, "--base-url", srv.url, "--model", "local:m", "-v", "-p", "hi")
    assert "no agent.toml" in r.stderr


# ---- owner-only files, plain terminals ----

def test_sessions_traces_and_history_are_owner_only(tmp_path, srv):
    srv.push(final("a"), final("b"))
    write_config(tmp_path, srv)
    assert bob(tmp_path, "--trace", "t.jsonl", "-p", "hi").returncode == 0
    sessions = tmp_path / "xd" / "bob" / "sessions"
    assert stat.S_IMODE(sessions.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "t.jsonl").stat().st_mode) == 0o600
    term = repl(tmp_path)
    try:
        term.send(b"/exit\r")
        term.proc.wait(5)
    finally:
        term.close()
    assert stat.S_IMODE((tmp_path / ".bob_history").stat().st_mode) == 0o600


def test_no_color_and_dumb_terminals_get_no_escape_sequences(tmp_path, srv):
    srv.push(final("plain"), final("plain"))
    write_config(tmp_path, srv)
    for env in ({"TERM": "dumb"}, {"TERM": "xterm", "NO_COLOR": "1"}):
        term = repl(tmp_path, **env)
        try:
            term.send(b"hi\r")
            shown = term.expect(b"bob> ", timeout=5)
            assert b"plain" in shown and b"1 LLM calls," in shown, shown
            assert b"\x1b[K" not in shown and b"\x1b[2m" not in shown, (env, shown)
            if env["TERM"] == "dumb":
                assert b"\x1b" not in shown, shown
        finally:
            term.close()


# ---- the known gaps ----

def test_an_empty_stdin_for_dash_p_is_a_usage_error(tmp_path, srv):
    write_config(tmp_path, srv)
    r = bob(tmp_path, "-p", "-", stdin="  \n")
    assert r.returncode == 2 and "stdin" in r.stderr and not srv.requests, r.stderr


def test_commands_without_their_argument_say_what_they_need(tmp_path, srv):
    write_config(tmp_path, srv)
    term = repl(tmp_path)
    try:
        for command in (b"/save", b"/resume", b"/model"):
            term.send(command + b"\r")
            said = term.expect(b"bob> ")
            assert command + b" needs an argument" in said, said
    finally:
        term.close()


def test_ctrl_d_inside_a_block_sends_what_was_typed(tmp_path, srv):
    srv.push(final("got the block"))
    write_config(tmp_path, srv)
    term = repl(tmp_path)
    try:
        term.send(b'"""\rline one\rline two\r')
        term.expect(b"... line two")
        term.send(b"\x04")
        assert b"got the block" in term.expect(b"bob> ", timeout=5)
    finally:
        term.close()
    assert "line one\\nline two" in str(srv.requests[0]["body"]["messages"])


def test_reset_forgets_the_pending_question_prompt(tmp_path, srv):
    srv.push(completion('{"type": "ask_user", "question": "Which file?"}'))
    write_config(tmp_path, srv)
    term = repl(tmp_path)
    try:
        term.send(b"edit it\r")
        term.expect(b"your answer to bob's question> ", timeout=5)
        term.send(b"/reset\r")
        assert b"new session" in term.expect(b"bob> ")
    finally:
        term.close()


def test_a_relative_xdg_data_home_is_ignored(tmp_path, srv):
    srv.push(final("a"))
    write_config(tmp_path, srv)
    r = bob(tmp_path, "-p", "hi", XDG_DATA_HOME="rel")
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "rel").exists()
    assert list((tmp_path / ".local" / "share" / "bob" / "sessions").glob("*.json"))


# ---- small things ----

def test_help_names_the_key_variable_the_commands_and_the_sessions(tmp_path):
    out = bob(tmp_path, "--help").stdout
    assert "OPENAI_API_KEY" in out and "/help" in out and "bob/sessions" in out
