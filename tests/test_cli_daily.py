"""The CLI for daily use (issue 14): no config needed, flags and environment, pipes, sessions,
stats, approvals, multiline input, the REPL's session commands, -v. Every run is a real
subprocess (or a pty) against fake_openai, in an empty temp dir with HOME and XDG_* in it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path


import bob_cli
from fake_openai import FakeOpenAI, completion, stream_reply
from conftest import (CLI, KEY, Terminal, begun_early, child_env, cli_begun, collected, final,
                      messages_of, run_cli, write_config, xdg_env)


def work_config(tmp_path: Path, srv: FakeOpenAI, **kw: str) -> Path:
    (tmp_path / "work").mkdir(exist_ok=True)
    return write_config(tmp_path / "work", srv, **kw)


def bob(tmp_path: Path, *args: str, stdin: str | None = None,
        **env: str) -> subprocess.CompletedProcess[str]:
    """The CLI in tmp_path/work (created empty), stdin piped (empty unless given)."""
    return finished(started(tmp_path, *args, **env), stdin)


def started(tmp_path: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    """bob() begun, not waited for: finished() collects it (runs side by side on 2 cores)."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, str(CLI), *args], cwd=work, text=True,
                            env=xdg_env(tmp_path, **env), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finished(proc: subprocess.Popen[str], stdin: str | None = None
             ) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(stdin or "", timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# ---- 1. Start anywhere ----

def test_no_config_runs_on_defaults_against_a_local_server(tmp_path, srv):
    srv.push(final("hello from local"))
    r = bob(tmp_path, "--base-url", srv.url, "--model", "local:qwen", "-p", "hi")
    assert r.returncode == 0 and r.stdout == "hello from local\n", r.stderr
    assert r.stderr == "" and srv.requests[0]["body"]["model"] == "qwen"   # the notice: -v


def test_openai_environment_and_bob_model_are_honoured(tmp_path, srv):
    srv.push(final("ok"))
    r = bob(tmp_path, "-p", "hi", OPENAI_BASE_URL=srv.url, OPENAI_API_KEY=KEY,
            BOB_MODEL="openai:from-env")
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr
    assert srv.requests[0]["headers"]["authorization"] == f"Bearer {KEY}"
    assert srv.requests[0]["body"]["model"] == "from-env"


def test_the_xdg_config_is_found_and_the_local_one_wins(tmp_path, srv):
    srv.push(final("a"), final("b"))
    xdg = tmp_path / "xc" / "bob"
    xdg.mkdir(parents=True)
    write_config(xdg, srv, runtime='system_prompt = "XDG-PROMPT"\n')
    assert bob(tmp_path, "-p", "hi").returncode == 0
    assert "XDG-PROMPT" in messages_of(srv.requests[0])
    work_config(tmp_path, srv, runtime='system_prompt = "LOCAL-PROMPT"\n')
    r = bob(tmp_path, "-p", "hi")
    assert r.returncode == 0 and "LOCAL-PROMPT" in messages_of(srv.requests[1]), r.stderr
    assert r.stderr == ""


def test_a_missing_key_says_what_to_set_and_the_ways_around_it(tmp_path):
    r = bob(tmp_path, "-p", "hi")
    assert r.returncode == 2 and "OPENAI_API_KEY" in r.stderr
    assert "--base-url" in r.stderr and "--demo" in r.stderr and "Traceback" not in r.stderr


def test_version_system_max_steps_and_api_key_env(tmp_path, srv):
    base = ("--base-url", srv.url, "--model", "x:y", "--api-key-env", "MY_KEY")
    # the two runs that never reach the model, begun first: side by side with the others
    version, no_steps = started(tmp_path, "--version"), started(tmp_path, *base, "--max-steps",
                                                               "0", "-p", "hi")
    assert re.fullmatch(r"bob \d+\.\d+\.\d+\n", finished(version).stdout)
    srv.push(final("s"), json.dumps({"type": "tool_call", "name": "nope", "arguments": {}}))
    r = bob(tmp_path, *base, "--system", "SYS-TEXT", "-p", "hi", MY_KEY="k-1")
    assert r.returncode == 0 and "SYS-TEXT" in messages_of(srv.requests[0])
    assert srv.requests[0]["headers"]["authorization"] == "Bearer k-1"
    r = bob(tmp_path, *base, "--max-steps", "1", "-p", "hi", MY_KEY="k-1")
    assert r.returncode == 3 and "max_steps" in r.stderr
    assert finished(no_steps).returncode == 2


def test_stream_and_no_stream_override_the_config(tmp_path, srv):
    srv.push(stream_reply(['{"type": "final", ', '"content": "streamed"}']), final("plain"))
    work_config(tmp_path, srv)
    r = bob(tmp_path, "--stream", "-p", "hi")
    assert r.returncode == 0 and r.stdout == "streamed\n" and srv.requests[0]["body"]["stream"]
    work_config(tmp_path, srv, extra="stream_default = true\n")
    r = bob(tmp_path, "--no-stream", "-p", "hi")
    assert r.returncode == 0 and r.stdout == "plain\n"
    assert not srv.requests[1]["body"].get("stream")


# ---- 2. Pipes ----

def test_piped_text_follows_the_prompt_and_dash_reads_stdin(tmp_path, srv):
    srv.push(final("summary"), final("whole"))
    work_config(tmp_path, srv)
    empty = started(tmp_path, "-p", "")   # never reaches the model: side by side with the others
    r = bob(tmp_path, "-p", "summarize this", stdin="line one\nline two\n")
    assert r.returncode == 0 and r.stdout == "summary\n"
    assert len(srv.requests) == 1
    assert "summarize this\\n\\nline one\\nline two" in messages_of(srv.requests[0])
    r = bob(tmp_path, "-p", "-", stdin="the prompt from stdin")
    assert r.returncode == 0 and "the prompt from stdin" in messages_of(srv.requests[1])
    r = finished(empty)
    assert r.returncode == 2 and "-p needs a prompt" in r.stderr and r.stdout == ""


# ---- 3. Sessions ----

def test_sessions_persist_under_xdg_data_and_continue_resumes(tmp_path, srv):
    srv.push(final("one"), final("two"), final("three"))
    work_config(tmp_path, srv)
    assert bob(tmp_path, "--session", "s1", "-p", "first words").returncode == 0
    assert (tmp_path / "xd" / "bob" / "sessions" / "s1.json").is_file()
    r = bob(tmp_path, "--session", "s1", "-p", "second")
    assert "resumed session s1 (2 messages)" in r.stderr
    assert "first words" in messages_of(srv.requests[1])
    r = bob(tmp_path, "-c", "-p", "third")
    assert r.returncode == 0 and "resumed session s1 (4 messages)" in r.stderr
    assert "second" in messages_of(srv.requests[2])
    r = bob(tmp_path, "--sessions")
    assert r.returncode == 0 and re.fullmatch(r"s1  \S+ \S+  turns   3  first words\n", r.stdout)


def test_continue_without_sessions_starts_a_new_one(tmp_path, srv):
    srv.push(final("fresh"))
    work_config(tmp_path, srv)
    r = bob(tmp_path, "-c", "-p", "hi")
    assert r.returncode == 0 and r.stdout == "fresh\n" and "starting a new one" in r.stderr


def test_a_dangling_link_or_a_fifo_among_the_sessions_is_left_out(tmp_path, srv):
    srv.push(final("one"), final("two"))
    work_config(tmp_path, srv)
    assert bob(tmp_path, "--session", "s1", "-p", "first words").returncode == 0
    sessions = tmp_path / "xd" / "bob" / "sessions"
    (sessions / "gone.json").symlink_to(tmp_path / "nowhere")   # --sessions crashed on it
    os.mkfifo(sessions / "pipe.json")
    r = bob(tmp_path, "--sessions")
    assert r.returncode == 0 and re.fullmatch(r"s1  \S+ \S+  turns   1  first words\n", r.stdout)
    r = bob(tmp_path, "-c", "-p", "again")
    assert r.returncode == 0 and "resumed session s1 (2 messages)" in r.stderr, r.stderr


# ---- 4. After a turn: the length warning, the stats line ----

def test_a_reply_cut_by_the_token_limit_is_a_warning(tmp_path, srv):
    srv.push(completion(final("cut"), finish_reason="length"))
    work_config(tmp_path, srv)
    r = bob(tmp_path, "-p", "hi")
    assert r.returncode == 0 and r.stdout == "cut\n"
    assert "bob: warning: the reply was cut by the token limit; raise max_tokens" in r.stderr


def test_the_repl_shows_a_stats_line_with_unknown_tokens_as_a_question_mark(tmp_path, srv):
    srv.push(completion(final("counted"), prompt_tokens=7, completion_tokens=3),
             completion(final("uncounted"), prompt_tokens=None))
    write_config(tmp_path, srv)
    term = Terminal(tmp_path)
    try:
        term.expect(b"bob> ")
        term.send(b"hi\r")
        assert b"LLM calls 1, tool calls 0, tokens 7 in / 3 out" in term.expect(b"bob> ")
        term.send(b"again\r")
        assert b"tokens ? in / ? out" in term.expect(b"bob> ")
    finally:
        term.close()


# ---- 5. Tool calls: shown as they run, approved by a person ([policy] ask_tools) ----

# The hand-written stdio server: the approval is the CLI's, before any call reaches a server,
# and it starts in milliseconds (tests/mcp_server.py imports the MCP SDK: a second of CPU).
RAW_SERVER = Path(__file__).resolve().parent / "mcp_raw_server.py"


def echo_call(text: str) -> str:
    return json.dumps({"type": "tool_call", "name": "t__echo", "arguments": {"text": text}})


def mcp_config(dirpath: Path, srv: FakeOpenAI) -> Path:
    return write_config(dirpath, srv, extra=(
        '[policy]\nask_tools = ["t__echo"]\n'
        f'[[mcp.servers]]\nid = "t"\ncommand = "{sys.executable}"\nargs = ["{RAW_SERVER}"]\n'))


def begin_asking(tmp_path: Path, srv: FakeOpenAI) -> Terminal:
    srv.push(echo_call("x"), final("after"),
             echo_call("one"), final("did one"), echo_call("two"), final("did two"),
             echo_call("three"), final("did three"), echo_call("four"), final("did four"))
    mcp_config(tmp_path, srv)
    return Terminal(tmp_path)


def test_the_repl_asks_yes_no_with_a_reason_and_always_and_ctrl_c_cancels(early):
    # One REPL for the whole prompt (its CLI imports the MCP SDK: a second of CPU): Ctrl-C at
    # it cancels the turn, then yes, no with a reason, always.
    term, srv = early["asking"].run, early["asking"].srv
    try:
        term.expect(b"bob> ")
        term.send(b"go\r")
        term.expect(b"this session? ", timeout=10)
        term.wait_blocked_reading()
        term.send(b"\x03")
        assert b"turn cancelled" in term.expect(b"bob> ", timeout=5)
        term.send(b"again\r")
        assert b"after" in term.expect(b"bob> ", timeout=10)
        for text, keys in (("one", b"y\r"), ("two", b"n\rtoo risky\r"), ("three", b"a\r")):
            term.send(f"run {text}\r".encode())
            shown = term.expect(b"this session? ", timeout=10)
            assert b"t__echo wants to run with" in shown and text.encode() in shown
            term.send(keys)
            seen = term.expect(b"bob> ", timeout=10)
            assert f"did {text}".encode() in seen
        assert b"-> t__echo" in seen and re.search(rb"<- t__echo: three \(\d+ ms\)", seen), seen
        term.send(b"run four\r")                      # "always" holds for this session
        assert b"did four" in term.expect(b"bob> ", timeout=10)
        assert "too risky" in messages_of(srv.requests[5])
        assert "two" not in messages_of(srv.requests[5]).split("too risky")[1]
    finally:
        term.close()


def begin_declining(tmp_path: Path, srv: FakeOpenAI) -> subprocess.Popen[str]:
    srv.push(echo_call("a"), final("declined"))
    (tmp_path / "work").mkdir()
    mcp_config(tmp_path / "work", srv)
    return cli_begun(tmp_path / "work", "-p", "go", env=xdg_env(tmp_path))   # stdin: empty


def begin_allowing(tmp_path: Path, srv: FakeOpenAI) -> subprocess.Popen[str]:
    srv.push(echo_call("b"), final("allowed"))
    (tmp_path / "work").mkdir()
    mcp_config(tmp_path / "work", srv)
    return cli_begun(tmp_path / "work", "--yes", "-p", "go", env=xdg_env(tmp_path))


def test_one_shot_declines_without_yes_and_says_how_to_allow(early):
    # The two runs side by side (each imports the MCP SDK), each with its own model and dirs.
    r, r_yes = collected(early["declining"].run), collected(early["allowing"].run)
    srv, srv_yes = early["declining"].srv, early["allowing"].srv
    assert r.returncode == 0 and r.stdout == "declined\n", r.stderr
    assert "bob: warning: t__echo not run" in r.stderr and "--yes" in r.stderr
    assert "no one can approve" in messages_of(srv.requests[1])
    assert r_yes.returncode == 0 and r_yes.stdout == "allowed\n", r_yes.stderr
    assert "warning" not in r_yes.stderr
    assert "no one can approve" not in messages_of(srv_yes.requests[1])


def test_a_malformed_base_url_flag_or_environment_is_a_usage_error(tmp_path):
    flag = started(tmp_path, "--base-url", "localhost:8080", "--model", "x:y", "-p", "hi")
    environ = started(tmp_path, "-p", "hi", OPENAI_BASE_URL="ftp://h/v1", OPENAI_API_KEY=KEY)
    r = finished(flag)   # the two side by side
    assert r.returncode == 2 and "--base-url must be an http" in r.stderr
    r = finished(environ)
    assert r.returncode == 2 and "OPENAI_BASE_URL must be an http" in r.stderr


# ---- 6. The REPL: multiline input (issue 14) ----

def user_texts(request: dict) -> list[str]:
    return [m["content"] for m in request["body"]["messages"] if m["role"] == "user"]


def test_backslash_lines_triple_quote_blocks_and_pastes_are_one_message(tmp_path, srv):
    srv.push(final("a"), final("b"), final("c"))
    write_config(tmp_path, srv)
    term = Terminal(tmp_path)
    try:
        term.expect(b"bob> ")
        term.send(b"first \\\r")
        term.expect(b"... ")
        term.send(b"second\r")
        term.expect(b"bob> ", timeout=5)
        for line in (b'"""\r', b"  indented\r", b"ends in \\\r", b'"""\r'):
            term.send(line)
        term.expect(b"bob> ", timeout=5)
        term.send(b"\x1b[200~pasted one\npasted two\x1b[201~\r")   # a bracketed paste
        term.expect(b"bob> ", timeout=5)
    finally:
        term.close()
    assert [user_texts(r)[-1] for r in srv.requests] == [
        "first \nsecond", "  indented\nends in \\", "pasted one\npasted two"]


def test_the_repl_asks_the_terminal_for_bracketed_paste(tmp_path, srv):
    write_config(tmp_path, srv)
    term = Terminal(tmp_path, env=child_env(tmp_path, TERM="xterm"))
    try:
        assert b"\x1b[?2004h" in term.expect(b"bob> ")
    finally:
        term.close()


# ---- 7. The REPL: /sessions, /resume, /history, /model, /save (issue 14) ----

def test_session_commands_in_the_repl(tmp_path, srv):
    srv.push(final("one"), final("two"))
    write_config(tmp_path, srv)
    assert run_cli(tmp_path, "--session", "s1", "-p", "first words").returncode == 0
    term = Terminal(tmp_path)
    try:
        term.expect(b"bob> ")
        term.send(b"/sessions\r")
        assert re.search(rb"s1  \S+ \S+ +turns +1  first words", term.expect(b"bob> "))
        term.send(b"/resume nope\r")
        assert b"no session nope" in term.expect(b"bob> ")
        term.send(b"/resume s1\r")
        assert b"bob: resumed session s1 (2 messages)" in term.expect(b"bob> ")
        term.send(b"/history\r")
        shown = term.expect(b"bob> ").decode().replace("\r", "").splitlines()
        assert [x for x in shown if x] == ["/history", "user: first words", "assistant: one"]
        term.send(b"/model openai:other\r")
        assert b"model: " in term.expect(b"bob> ")
        term.send(b"second\r")
        assert b"two" in term.expect(b"bob> ", timeout=5)
        term.send(b"/save notes/s1.md\r")
        said = term.expect(b"bob> ")
        assert b"bob: error: " in said and b"No such file or directory" in said
        term.send(b"/save s1.md\r")
        assert b"saved 4 messages to s1.md" in term.expect(b"bob> ")
        config = (tmp_path / "agent.toml").read_text()
        term.send(b"/save agent.toml\r")           # a slip of the finger: it replaced the config
        said = term.expect(b"bob> ")
        assert b"bob: error: " in said and b"exists" in said
        assert (tmp_path / "agent.toml").read_text() == config
        term.send(b"/model\r")
        assert b"/model needs" in term.expect(b"bob> ")
        term.send(b"/model nocolon\r")                 # an error; the model stays
        assert b"model 'nocolon' must be 'provider:model'" in term.expect(b"bob> ")
    finally:
        term.close()
    assert srv.requests[1]["body"]["model"] == "other"
    assert user_texts(srv.requests[1]) == ["first words", "second"]
    saved = (tmp_path / "s1.md").read_text()
    assert saved.startswith("# bob session s1\n\n## user\n\nfirst words\n\n## assistant\n\none")
    assert saved.endswith("## assistant\n\ntwo\n")


def test_history_lines_are_cut_to_the_terminal_width(tmp_path, srv):
    srv.push(final("x" * 500))
    write_config(tmp_path, srv)
    term = Terminal(tmp_path)
    try:
        term.expect(b"bob> ")
        term.send(("long " * 100).encode() + b"\r")
        term.expect(b"bob> ", timeout=5)
        term.send(b"/history\r")
        lines = term.expect(b"bob> ").decode().replace("\r", "").splitlines()[1:]
        assert len(lines) == 2 and all(len(x) <= 200 and x.endswith("...") for x in lines), lines
    finally:
        term.close()


def test_model_text_cannot_drive_the_terminal_in_one_line_displays(tmp_path, srv):
    """/history, tool lines and /tools show text from the model and the servers: an escape
    sequence there (retitle the terminal, clear the screen) shows as U+FFFD, never raw."""
    srv.push(json.dumps({"type": "tool_call", "name": "x\x1b]0;pwned\x07", "arguments": {}}),
             final("hi \x1b]0;pwned\x07 \x1b[2J there"))
    write_config(tmp_path, srv)
    term = Terminal(tmp_path)
    try:
        term.expect(b"bob> ")
        term.send(b"go\r")
        shown = term.expect(b"hi ", timeout=5)   # up to the answer, which is the model's own
        assert "-> x\ufffd]0;pwned\ufffd {}".encode() in shown and b"\x07" not in shown, shown
        term.expect(b"bob> ")
        term.send(b"/history\r")
        shown = term.expect(b"bob> ")
        assert b"\x1b" not in shown and b"\x07" not in shown, shown
        assert "assistant: hi \ufffd]0;pwned\ufffd \ufffd[2J there".encode() in shown, shown
    finally:
        term.close()


# ---- 8. bob --init, and -v (issue 14) ----

def test_init_writes_a_commented_config_that_loads_and_never_overwrites(tmp_path):
    in_proc = subprocess.Popen([sys.executable, str(CLI), "--init"], cwd="/proc", text=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=xdg_env(tmp_path))   # no writes
    r = bob(tmp_path, "--init")   # side by side with the one in /proc
    path = tmp_path / "work" / "agent.toml"
    assert r.returncode == 0 and r.stdout == "" and f"wrote {path}" in r.stderr, r.stderr
    text = path.read_text()
    assert text.startswith("# bob's agent.toml") and "[[mcp.servers]]" in text
    assert bob_cli.load_config(path, environ={}) == bob_cli.Config(path)   # all the defaults
    path.write_text("# mine\n")
    r = bob(tmp_path, "--init")
    assert r.returncode == 2 and "agent.toml exists here already" in r.stderr
    assert path.read_text() == "# mine\n"
    r = finished(in_proc)
    assert r.returncode == 1 and r.stderr.startswith("bob: error: cannot write agent.toml in "
                                                     "this directory: "), r.stderr


def test_verbose_shows_each_event_once_on_one_short_line(tmp_path, srv):
    srv.push(final("ok " * 200))
    work_config(tmp_path, srv)
    demo = started(tmp_path, "--demo", "-v", COLUMNS="100")   # side by side with the -p run
    r = bob(tmp_path, "-v", "-p", "hi " * 200, COLUMNS="100")
    assert r.returncode == 0 and r.stdout == "ok " * 200 + "\n", r.stderr
    lines = r.stderr.splitlines()
    kinds = [x.split()[1] for x in lines if x.startswith("  [")]
    assert kinds[:2] == ["session_loaded", "turn_started"] and kinds[-1] == "turn_completed", lines
    assert kinds.count("turn_completed") == 1 and "llm_call_completed" in kinds
    assert all(len(x) <= 100 for x in lines), max(lines, key=len)
    demo = finished(demo)
    assert demo.returncode == 0 and demo.stdout.count("turn_completed") == 1, demo.stderr
    assert "turn_completed" not in demo.stderr


# ---- issue 22: a server dying while the REPL waits ----

def test_a_server_dying_at_the_prompt_does_not_overwrite_it(tmp_path, srv):
    write_config(tmp_path, srv, extra=(
        f'[[mcp.servers]]\nid = "r"\ncommand = "{sys.executable}"\n'
        f'args = ["{RAW_SERVER}", "die-soon"]\n'))
    term = Terminal(tmp_path)
    try:
        term.expect(b"bob> ")
        term.send(b"typed")
        warning = term.expect(b"on the next turn", timeout=10)
        assert b"exited (code 3)" in warning and not warning.startswith(b"typed bob:"), warning
        assert warning.startswith(b"typed\r\n") or warning.startswith(b"\r"), warning
        term.expect(b"bob> typed")   # the prompt again, with what was typed
    finally:
        term.close()


# The runs above whose CLI starts an MCP server and imports the MCP SDK (a second of CPU
# each), begun together
early = begun_early({"asking": begin_asking, "declining": begin_declining,
                     "allowing": begin_allowing})
