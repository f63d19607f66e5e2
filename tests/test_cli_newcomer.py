"""The CLI a newcomer keeps open (issue 22): a closed stdout, the --init path to a local server,
notices, owner-only files, TERM=dumb / NO_COLOR, the README's known gaps, small things. Every
run is a real subprocess (or a pty) against fake_openai, HOME and XDG_* in a temp dir."""
from __future__ import annotations

import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (CLI, Terminal, cli_begun, collected, final, messages_of, write_config,
                      xdg_env)
from fake_openai import FakeOpenAI, completion


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
    flags = ("--base-url", srv.url, "--model", "local:m")
    quiet = cli_begun(tmp_path, *flags, "-p", "hi", env=xdg_env(tmp_path))
    verbose = cli_begun(tmp_path, *flags, "-v", "-p", "hi", env=xdg_env(tmp_path))
    r = collected(quiet)   # the two side by side (either answer will do)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = collected(verbose)
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
            assert b"plain" in shown and b"LLM calls 1," in shown, shown
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


@pytest.mark.parametrize("typed, shown, sent", [
    (b'"""\rline one\rline two\r', b"line two\r\n... ", "line one\\nline two"),  # in a block
    (b"first line \\\r", b"... ", "first line")])   # on the line after a trailing backslash
def test_ctrl_d_on_a_continuation_line_sends_what_was_typed(tmp_path, srv, typed, shown, sent):
    srv.push(final("got it"))
    write_config(tmp_path, srv)
    term = repl(tmp_path)
    try:
        term.send(typed)
        term.expect(shown)   # the continuation prompt is up: a Ctrl-D typed ahead of it is no EOF
        term.send(b"\x04")   # Ctrl-D on the continuation line
        assert b"got it" in term.expect(b"bob> ", timeout=5)
    finally:
        term.close()
    assert sent in messages_of(srv.requests[0])


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
    assert "--forget" in out


# ---- flags stick to a session; failed runs and pruning ----

def sessions_in(tmp_path: Path) -> list[str]:
    return sorted(p.stem for p in (tmp_path / "xd" / "bob" / "sessions").glob("*.json"))


def test_a_session_remembers_its_model_and_endpoint_and_flags_given_again_win(tmp_path, srv):
    srv.push(final("one"), final("two"), final("three"))
    first = bob(tmp_path, "--base-url", srv.url, "--model", "local:first", "-p", "hi")
    assert first.returncode == 0, first.stderr
    again = bob(tmp_path, "-c", "-p", "and again")   # no flags, no config, no key
    assert again.returncode == 0 and again.stdout == "two\n", again.stderr
    assert srv.requests[1]["body"]["model"] == "first"
    assert "hi" in messages_of(srv.requests[1])
    other = bob(tmp_path, "-c", "--model", "local:second", "-p", "more")
    assert other.returncode == 0, other.stderr
    assert srv.requests[2]["body"]["model"] == "second"
    assert len(sessions_in(tmp_path)) == 1
    (flags,) = (tmp_path / "xd" / "bob" / "sessions").glob("*.flags")
    assert stat.S_IMODE(flags.stat().st_mode) == 0o600   # owner-only, as the session


def test_a_failed_first_turn_keeps_no_session_and_forget_prunes(tmp_path, srv):
    write_config(tmp_path, srv)
    srv.push({"status": 400, "body": {"error": {"message": "bad model"}}})
    failed = bob(tmp_path, "-p", "hi")
    assert failed.returncode == 1 and "bad model" in failed.stderr, failed.stderr
    assert sessions_in(tmp_path) == []
    srv.push(final("kept"), final("kept too"))
    kept = cli_begun(tmp_path, "-p", "hi", env=xdg_env(tmp_path))
    flagged = cli_begun(tmp_path, "--base-url", srv.url, "--model", "local:x", "-p", "x",
                        env=xdg_env(tmp_path))   # the two side by side (either answer will do)
    assert collected(kept).returncode == 0
    assert collected(flagged).returncode == 0
    sessions = tmp_path / "xd" / "bob" / "sessions"
    (two,) = [p.stem for p in sessions.glob("*.flags")]   # the run with flags
    (one,) = set(sessions_in(tmp_path)) - {two}
    forget = bob(tmp_path, "--forget", two)
    assert forget.returncode == 0 and one in forget.stdout and two not in forget.stdout
    assert sessions_in(tmp_path) == [one]
    assert [p.name for p in sessions.iterdir()] == [f"{one}.json"]   # the flags went too
    unknown = bob(tmp_path, "--forget", two)
    assert unknown.returncode == 2 and "--sessions" in unknown.stderr, unknown.stderr
    # --forget in --help: test_help_names_the_key_variable_the_commands_and_the_sessions


def test_without_a_key_the_repl_offers_a_local_server_and_the_demo(tmp_path, srv):
    srv.push(final("local answer"))
    term = Terminal(tmp_path, env=xdg_env(tmp_path))
    try:
        said = term.expect(b"(Enter quits)> ")
        assert b"--demo" in said and b"local:NAME" in said and b"URL" in said, said
        term.send(srv.url.encode() + b" qwen\r")
        term.expect(b"bob> ")
        term.send(b"hi\r")
        assert b"local answer" in term.expect(b"bob> ", timeout=5)
    finally:
        term.close()
    assert srv.requests[0]["body"]["model"] == "qwen"


def test_without_a_key_dash_p_is_still_exit_2_saying_what_to_do(tmp_path):
    r = bob(tmp_path, "-p", "hi")
    assert r.returncode == 2 and "OPENAI_API_KEY" in r.stderr and "--demo" in r.stderr, r.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_mid_turn_keeps_the_users_message(tmp_path, srv, signum):
    write_config(tmp_path, srv)
    srv.push(FakeOpenAI.HANG)
    proc = subprocess.Popen([sys.executable, str(CLI), "-p", "remember this line"], cwd=tmp_path,
                            env=xdg_env(tmp_path), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert srv.wait_for_requests(1, timeout=10)
        proc.send_signal(signum)
        assert proc.wait(10) == 128 + signum
    finally:
        proc.kill()
        proc.communicate()
    (session,) = sessions_in(tmp_path)
    stored = (tmp_path / "xd" / "bob" / "sessions" / f"{session}.json").read_text()
    assert "remember this line" in stored


# ---- small things, continued ----

def test_help_exit_quit_without_a_slash_are_commands_not_messages(tmp_path, srv):
    write_config(tmp_path, srv)
    term = repl(tmp_path)
    try:
        term.send(b"help\r")
        assert b"/tools" in term.expect(b"bob> ")
        term.send(b"quit\r")
        assert term.proc.wait(5) == 0
    finally:
        term.close()
    assert not srv.requests


def test_counts_save_twice_and_an_empty_history_read_well(tmp_path, srv):
    srv.push(final("an answer"))
    write_config(tmp_path, srv)
    term = repl(tmp_path)
    try:
        term.send(b"/history\r")
        assert b"empty" in term.expect(b"bob> ")
        term.send(b"hi\r")
        said = term.expect(b"bob> ", timeout=5)
        assert b"LLM calls 1, tool calls 0" in said, said
        term.send(b"/save notes.md\r")
        assert b"saved 2 messages" in term.expect(b"bob> ")
        term.send(b"/save notes.md\r")
        said = term.expect(b"bob> ")
        assert b"exists" in said and b"Errno" not in said, said
    finally:
        term.close()
    listed = bob(tmp_path, "--sessions").stdout
    assert "turns   1 " in listed, listed


def test_a_redirected_stdout_gets_answers_but_no_prompts(tmp_path, srv):
    srv.push(final("the answer"))
    write_config(tmp_path, srv)
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        term = Terminal(tmp_path, env=xdg_env(tmp_path), stdout=stdout)
    try:   # each typed at its prompt: readline reads raw, and a Ctrl-D typed ahead is a NUL
        term.expect(b"bob> ")
        term.send(b"hi\n")
        term.expect(b"bob> ", timeout=10)
        term.send(b"\x04")
        assert term.proc.wait(10) == 0
    finally:
        term.close()
    assert out.read_text() == "the answer\n"


def test_a_shell_on_any_session_store_still_runs_turns(capsys):
    import bob
    import bob_cli
    runtime = bob.AgentRuntime(bob.ScriptedLlm(['{"type": "final", "content": "in memory"}']))
    assert bob_cli.Shell(runtime, "s1").turn("hi").content == "in memory"   # the public Shell
    assert capsys.readouterr().out == "in memory\n"
