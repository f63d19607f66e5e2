"""Tests of bob_cli: the CLI as a real subprocess against a real local HTTP server (fake_openai).

Sections:
    1. Helpers: config files, runs, a pseudo terminal
    2. Configuration (in process: load_config)
    3. One-shot, piped, sessions, trace, guards, demo
    4. Configuration errors and their exit codes
    5. The REPL through a pseudo terminal
    6. MCP servers never outlive the CLI
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI, stream_reply

import bob
import bob_cli
from conftest import (CLI, KEY, MCP_SERVER, REPO, Terminal, begun_early, child_env, final,
                      messages_of, run_cli, write_config)



# ---- 2. Configuration (in process: load_config) ----

def test_repository_agent_toml_is_a_working_example():
    cfg = bob_cli.load_config(REPO / "agent.toml", environ={"HOME": "/home/x"})
    assert cfg.default_model.startswith("openai:")
    assert cfg.mcp_servers and all(s.required is False for s in cfg.mcp_servers)
    assert cfg.store_path == REPO / ".bob" / "sessions"


def test_load_config_reads_every_table(tmp_path):
    (tmp_path / "work").mkdir()
    (tmp_path / "agent.toml").write_text(
        '[runtime]\ndefault_model = "openai:m"\naction_mode = "native"\nmax_steps = 4\n'
        'max_tool_output_chars = 500\nsystem_prompt = "Be brief."\n'
        '[llm]\nstream_default = true\ntemperature = 0.5\nseed = 7\nmax_tokens = 99\n'
        '[store]\npath = "s"\n[policy]\ndeny_tools = ["fs__write_*"]\n'
        '[[mcp.servers]]\nid = "fs"\ncommand = "run-${WHO}"\nargs = ["--root", "${ROOT}"]\n'
        'env = { TOKEN = "${TOKEN}" }\nheaders = { Authorization = "Bearer ${TOKEN}" }\n'
        'cwd = "work"\nrequired = false\n')
    cfg = bob_cli.load_config(tmp_path / "agent.toml",
                              environ={"WHO": "me", "ROOT": "/r", "TOKEN": "tok-secret"})
    assert (cfg.default_model, cfg.action_mode, cfg.system_prompt) == ("openai:m", "native",
                                                                       "Be brief.")
    assert cfg.policy == bob.TurnPolicy(max_steps=4, max_tool_output_chars=500)
    assert cfg.llm == {"stream_default": True, "temperature": 0.5, "seed": 7, "max_tokens": 99}
    assert cfg.store_path == tmp_path / "s" and cfg.deny_tools == ("fs__write_*",)
    server = cfg.mcp_servers[0]
    assert server.command == "run-${WHO}"   # only args, env, headers and url are expanded
    assert server.args == ("--root", "/r") and server.env == {"TOKEN": "tok-secret"}
    assert server.headers == {"Authorization": "Bearer tok-secret"}
    assert server.cwd == str(tmp_path / "work")
    assert "tok-secret" not in repr(cfg)


def test_load_config_of_an_empty_file_gives_the_defaults(tmp_path):
    (tmp_path / "agent.toml").write_text("")
    cfg = bob_cli.load_config(tmp_path / "agent.toml")
    assert cfg.policy == bob.TurnPolicy() and cfg.store_path is None and not cfg.mcp_servers


@pytest.mark.parametrize("text, words", [
    ("[runtime]\nmax_step = 3\n", ["[runtime]", "'max_step'", "did you mean 'max_steps'"]),
    ("[runtim]\n", ["'runtim'", "did you mean 'runtime'"]),
    ("[llm]\nstream_default = 1\n", ["[llm] stream_default must be a boolean"]),
    ("[runtime]\nmax_steps = 0\n", ["[runtime]", "max_steps", "at least 1"]),
    ("[llm]\ntemperature = 9\n", ["[llm] temperature", "between 0 and 2"]),
    ('[runtime]\naction_mode = "xml"\n', ["action_mode", '"json" or "native"']),
    ("[[mcp.servers]]\ncommand = 'x'\n", ["[[mcp.servers]] #1", "required key 'id'"]),
    ("[[mcp.servers]]\nid = 'a b'\ncommand = 'x'\n", ["#1", "'id'", "letters, digits"]),
    ("[[mcp.servers]]\nid = 'a'\nenv = { K = 5 }\n", ["env must be a table of strings"]),
    ("[[mcp.servers]]\nid = 'a'\nwhat = 1\n", ["unknown key 'what'", "valid keys: id,"]),
    ("[[mcp.servers]]\nid = 'a'\ncommand = 'x'\ntool_timeout_ms = 0\n",
     ["id='a'", "tool_timeout_ms must be between 1 and"]),
    ("[[mcp.servers]]\nid = 'a'\ntransport = 'streamable_http'\nurl = 'ftp://x'\n",
     ["id='a'", "url must be an http"]),
    ("[[mcp.servers]]\nid = 'a'\ncommand = 'x'\ncwd = 'nowhere'\n",
     ["id='a'", "nowhere is not a directory"]),
    # issue 22: they failed at server start (exit 1), or in the HTTP client
    ("[[mcp.servers]]\nid = 'a'\ncommand = 'x'\nenv = { 'K=V' = 'x' }\n",
     ["id='a'", "env name 'K=V'", "'='"]),
    ("[[mcp.servers]]\nid = 'a'\ncommand = 'x'\nenv = { \"K\\u0000\" = 'x' }\n",
     ["id='a'", "env name 'K\\x00'", "NUL"]),
    ("[[mcp.servers]]\nid = 'a'\ntransport = 'streamable_http'\nurl = 'http://h:1/mcp'\n"
     "headers = { 'X Key' = 'v' }\n", ["id='a'", "headers name 'X Key'", "ASCII letters"]),
    ("[[mcp.servers]]\nid = 'a'\ntransport = 'streamable_http'\nurl = 'http://h:1/mcp'\n"
     "headers = { 'X-Clé' = 'v' }\n", ["id='a'", "headers name 'X-Clé'", "ASCII letters"]),
    ("[[mcp.servers]]\nid = 'a'\ncommand = \"run\\u0000me\"\n", ["id='a'", "command", "NUL"]),
    ("[[mcp.servers]]\nid = 'a'\ncommand = 'x'\nargs = [\"\\u0000\"]\n", ["id='a'", "args", "NUL"]),
])
def test_config_errors_name_file_table_and_key(tmp_path, text, words):
    (tmp_path / "agent.toml").write_text(text)
    with pytest.raises(bob.ConfigError) as err:
        bob_cli.load_config(tmp_path / "agent.toml", environ={})
    for word in [str(tmp_path / "agent.toml"), *words]:
        assert word in str(err.value)


def test_a_shell_default_is_used_when_the_variable_is_unset_or_empty(tmp_path):
    (tmp_path / "agent.toml").write_text(
        "[[mcp.servers]]\nid = 'a'\ncommand = 'x'\n"
        "args = ['${UNSET:-fallback}', '${EMPTY:-d2}', '${SET:-unused}', '${SET}']\n")
    cfg = bob_cli.load_config(tmp_path / "agent.toml", environ={"EMPTY": "", "SET": "yes"})
    assert cfg.mcp_servers[0].args == ("fallback", "d2", "yes", "yes")


def test_a_bad_env_name_is_exit_2_naming_it_and_the_file(tmp_path):
    (tmp_path / "agent.toml").write_text(
        "[[mcp.servers]]\nid = 'a'\ncommand = 'x'\nenv = { 'K=V' = 'secret' }\n")
    r = run_cli(tmp_path, "-p", "hi")
    assert r.returncode == 2 and "env name 'K=V'" in r.stderr, r.stderr
    assert str(tmp_path / "agent.toml") in r.stderr and "secret" not in r.stderr


# ---- 3. One-shot, piped, sessions, trace, guards, demo ----

def test_one_shot_prints_only_the_answer(tmp_path, srv):
    srv.push(final("Hello from the fake model."))
    write_config(tmp_path, srv)
    r = run_cli(tmp_path, "-p", "Say hello")
    assert (r.returncode, r.stdout, r.stderr) == (0, "Hello from the fake model.\n", "")
    body = srv.requests[0]["body"]
    assert body["model"] == "test" and "Say hello" in messages_of(srv.requests[0])
    assert srv.requests[0]["headers"]["Authorization"] == f"Bearer {KEY}"


def test_model_flag_overrides_the_config(tmp_path, srv):
    srv.push(final("ok"))
    write_config(tmp_path, srv)
    assert run_cli(tmp_path, "-p", "hi", "--model", "openai:other").returncode == 0
    assert srv.requests[0]["body"]["model"] == "other"


def test_piped_lines_are_turns_of_one_session(tmp_path, srv):
    srv.push(final("First answer 1111."), final("Second answer 2222."))
    write_config(tmp_path, srv)
    r = run_cli(tmp_path, stdin="hi\n\nand again\n")
    assert (r.returncode, r.stdout) == (0, "First answer 1111.\nSecond answer 2222.\n")
    assert len(srv.requests) == 2
    assert "First answer 1111." in messages_of(srv.requests[1])


def test_piped_lines_starting_with_a_slash_are_prompts(tmp_path, srv):
    srv.push(final("not a command"))
    write_config(tmp_path, srv)
    r = run_cli(tmp_path, stdin="/exit\n")
    assert (r.returncode, r.stdout) == (0, "not a command\n")
    assert "/exit" in messages_of(srv.requests[0])


def test_session_is_resumed_by_a_second_process(tmp_path, srv):
    srv.push(final("Noted, Ann-4242."), final("You are Ann-4242."))
    write_config(tmp_path, srv, extra='[store]\npath = "sessions"\n')
    assert run_cli(tmp_path, "--session", "s1", "-p", "I am Ann-4242").returncode == 0
    assert (tmp_path / "sessions" / "s1.json").exists()
    r = run_cli(tmp_path, "--session", "s1", "-p", "Who am I?")
    assert (r.returncode, r.stdout) == (0, "You are Ann-4242.\n")
    assert "Noted, Ann-4242." in messages_of(srv.requests[1])


def test_trace_holds_every_event_and_no_key(tmp_path, srv):
    srv.push(final("traced"))
    write_config(tmp_path, srv)
    r = run_cli(tmp_path, "-p", "hi", "--trace", "trace.jsonl", "-v")
    assert r.returncode == 0 and r.stdout == "traced\n"
    text = (tmp_path / "trace.jsonl").read_text()
    kinds = [json.loads(line)["kind"] for line in text.splitlines()]
    assert {"turn_started", "llm_call_started", "llm_call_completed", "turn_completed"} <= set(
        kinds)
    assert "turn_completed" in r.stderr  # -v logs the events
    assert KEY not in text and KEY not in r.stderr


def test_guard_trip_prints_the_notice_and_exits_3(tmp_path, srv):
    srv.push(json.dumps({"type": "tool_call", "name": "nothing", "arguments": {}}))
    write_config(tmp_path, srv, runtime="max_steps = 1\n")
    r = run_cli(tmp_path, "-p", "loop")
    assert r.returncode == 3 and r.stdout.strip()
    assert "max_steps" in r.stderr and "raise max_steps under [runtime] in agent.toml" in r.stderr


def test_turn_timeout_prints_the_notice_and_exits_3(tmp_path, srv):
    srv.push(FakeOpenAI.HANG)
    write_config(tmp_path, srv, runtime="turn_timeout_ms = 300\n")
    try:
        r = run_cli(tmp_path, "-p", "hang", "--config", "agent.toml")
    finally:
        srv.release()
    assert r.returncode == 3 and "turn_timeout" in r.stdout + r.stderr
    assert "raise turn_timeout_ms under [runtime] in agent.toml" in r.stderr


def test_llm_error_is_one_line_and_exits_1(tmp_path, srv):
    srv.push({"status": 400, "body": {"error": {"message": "bad model"}}})
    write_config(tmp_path, srv)
    r = run_cli(tmp_path, "-p", "hi")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("bob: error: ") and r.stderr.count("\n") == 1
    assert "Traceback" not in r.stderr


def test_streamed_json_answer_is_printed_once_as_plain_text(tmp_path, srv):
    pieces = ['{"type": "fin', 'al", "content": "Hel', 'lo \\"wor', 'ld\\" \\u00e9 \\ud83d',
              '\\ude00"}']                                    # an emoji split in two
    srv.push(stream_reply(pieces))
    write_config(tmp_path, srv, extra="stream_default = true\n")
    r = run_cli(tmp_path, "-p", "hi")
    assert (r.returncode, r.stdout, r.stderr) == (0, 'Hello "world" \u00e9 \U0001f600\n', "")
    assert srv.requests[0]["body"]["stream"] is True


def test_sigint_cancels_a_one_shot_turn_with_exit_3(tmp_path, srv):
    srv.push(FakeOpenAI.HANG)
    write_config(tmp_path, srv)
    proc = subprocess.Popen([sys.executable, str(CLI), "-p", "hang"], cwd=tmp_path,
                            env=child_env(tmp_path), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert srv.wait_for_requests(1, timeout=5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=5)
        assert proc.returncode == 3 and "bob: warning: turn cancelled" in err and out == ""
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.release()


def test_sighup_ends_a_turn_with_exit_129(tmp_path, srv):
    srv.push(FakeOpenAI.HANG)
    write_config(tmp_path, srv)
    proc = subprocess.Popen([sys.executable, str(CLI), "-p", "hang"], cwd=tmp_path,
                            env=child_env(tmp_path), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert srv.wait_for_requests(1, timeout=5)
        proc.send_signal(signal.SIGHUP)          # what a closed terminal sends
        assert proc.wait(5) == 128 + signal.SIGHUP
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=5)
        srv.release()


def test_bad_session_id_is_a_usage_error(tmp_path, srv):
    write_config(tmp_path, srv, extra='[store]\npath = "s"\n')
    r = run_cli(tmp_path, "--session", "../escape", "-p", "hi")
    assert r.returncode == 2 and "invalid session id" in r.stderr and not srv.requests


def test_demo_runs_without_config_or_key(tmp_path):
    env = child_env(tmp_path)
    del env["BOB_TEST_KEY"]
    r = run_cli(tmp_path, "--demo", env=env)
    assert r.returncode == 0, r.stderr
    for text in ("start -> build_prompt", "llm_infer -> parse_action", "call_tool -> build_prompt",
                 "parse_action -> done", '"name": "word_count"', "answer> ", "42"):
        assert text in r.stdout


def test_help_names_the_flags_and_imports_neither_mcp_nor_requests(tmp_path):
    r = subprocess.run([sys.executable, "-X", "importtime", str(CLI), "--help"], check=False,
                       cwd=tmp_path, env=child_env(tmp_path), capture_output=True, text=True,
                       timeout=15)
    assert r.returncode == 0
    for flag in ("--config", "-p", "--session", "--model", "--trace", "-v", "--demo"):
        assert flag in r.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines()}
    assert "bob" in imported and not imported & {"mcp", "requests", "bob_mcp"}


# ---- 4. Configuration errors and their exit codes ----

def test_missing_config_file_says_how_to_start(tmp_path):
    r = run_cli(tmp_path, "--config", "agent.toml", "-p", "hi")
    assert r.returncode == 2
    assert "agent.toml not found" in r.stderr and "--config" in r.stderr
    assert "site-packages" not in r.stderr and "cp " not in r.stderr


def test_toml_syntax_error_gives_line_and_column(tmp_path):
    (tmp_path / "agent.toml").write_text("[runtime]\nmax_steps = = 3\n")
    r = run_cli(tmp_path, "-p", "hi")
    assert r.returncode == 2 and "line 2" in r.stderr and "column" in r.stderr


def test_unknown_key_suggests_the_right_one(tmp_path):
    write_config(tmp_path, None, runtime="max_tool_call = 3\n")
    r = run_cli(tmp_path, "-p", "hi")
    assert r.returncode == 2 and "did you mean 'max_tool_calls'" in r.stderr


def test_wrong_type_names_the_key(tmp_path):
    write_config(tmp_path, None, runtime='max_steps = "12"\n')
    r = run_cli(tmp_path, "-p", "hi")
    assert r.returncode == 2 and "[runtime] max_steps must be an integer" in r.stderr


def test_missing_api_key_names_the_variable(tmp_path, srv):
    write_config(tmp_path, srv)
    env = child_env(tmp_path)
    del env["BOB_TEST_KEY"]
    r = run_cli(tmp_path, "-p", "hi", env=env)
    assert r.returncode == 2 and "BOB_TEST_KEY" in r.stderr and not srv.requests


def test_unset_variable_in_mcp_entry_is_named(tmp_path):
    write_config(tmp_path, None, extra='[[mcp.servers]]\nid = "x"\ncommand = "true"\n'
                                       'env = { T = "${BOB_UNSET_VAR_42}" }\n')
    r = run_cli(tmp_path, "-p", "hi")
    assert r.returncode == 2 and "BOB_UNSET_VAR_42" in r.stderr and "is not set" in r.stderr


def test_a_control_character_in_a_secret_is_refused_without_showing_it(tmp_path):
    write_config(tmp_path, None, extra='[[mcp.servers]]\nid = "h"\n'
                 'transport = "streamable_http"\nurl = "http://127.0.0.1:9/mcp"\n'
                 'headers = { Authorization = "Bearer ${BOB_TOK}" }\n')
    r = run_cli(tmp_path, "-p", "hi", env={**child_env(tmp_path), "BOB_TOK": "TOPSECRET-123\r"})
    assert r.returncode == 2 and "headers.Authorization holds a control" in r.stderr
    assert "TOPSECRET" not in r.stderr + r.stdout


def test_an_unwritable_trace_file_is_a_usage_error(tmp_path, srv):
    write_config(tmp_path, srv)
    r = run_cli(tmp_path, "--trace", str(tmp_path / "no" / "such" / "dir.jsonl"), "-p", "hi")
    assert r.returncode == 2 and "--trace" in r.stderr and "cannot write it" in r.stderr
    assert "Traceback" not in r.stderr and srv.requests == []


def test_a_reader_that_leaves_early_ends_bob_quietly(tmp_path, srv):
    reader_gone = threading.Event()
    srv.push(final("first"), lambda body: (reader_gone.wait(5), final("second"))[1])
    write_config(tmp_path, srv)
    proc = subprocess.Popen([sys.executable, str(CLI)], cwd=tmp_path, env=child_env(tmp_path),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdin.write("one\ntwo\n")
    proc.stdin.close()
    assert proc.stdout.readline() == "first\n"
    proc.stdout.close()                 # like `| head -1`
    reader_gone.set()
    assert proc.wait(10) == 141
    assert proc.stderr.read() == ""


def test_usage_error_exits_2(tmp_path):
    assert run_cli(tmp_path, "--no-such-flag").returncode == 2


# ---- 5. The REPL through a pseudo terminal ----

def test_repl_answers_cancels_on_ctrl_c_and_quits_on_ctrl_d(tmp_path, srv):
    srv.push(final("first-reply"), FakeOpenAI.HANG, final("after-cancel"))
    write_config(tmp_path, srv)
    term = Terminal(tmp_path)
    try:
        term.expect(b"bob> ")
        term.send(b"hello\r")
        assert b"first-reply" in term.expect(b"bob> ")
        term.send(b"wait for me\r")
        assert srv.wait_for_requests(2)
        term.send(b"\x03")                           # Ctrl-C while the model hangs
        assert b"cancelled" in term.expect(b"bob> ")
        srv.release()
        term.send(b"typed then dropped")             # Ctrl-C at the prompt clears the line
        term.expect(b"dropped")
        term.wait_blocked_reading()
        term.send(b"\x03")
        term.expect(b"bob> ")
        term.send(b"again\r")
        assert b"after-cancel" in term.expect(b"bob> ")
        assert "wait for me" in messages_of(srv.requests[2])   # the session is intact
        assert "typed then dropped" not in messages_of(srv.requests[2])
        term.send(b"/usage\r")
        assert b"tokens" in term.expect(b"bob> ")
        term.send(b"/tools\r")
        assert b"no tools" in term.expect(b"bob> ")
        term.send(b"\x04")                           # Ctrl-D quits
        assert term.proc.wait(5) == 0
    finally:
        term.close()
    assert (tmp_path / ".bob_history").exists()


def test_repl_exit_command_and_ask_user(tmp_path, srv):
    srv.push(json.dumps({"type": "ask_user", "question": "Which city?"}), final("Paris it is."))
    write_config(tmp_path, srv)
    term = Terminal(tmp_path)
    try:
        term.expect(b"bob> ")
        term.send(b"weather please\r")
        assert b"Which city?" in term.expect(b"your answer to bob's question> ")
        term.send(b"Paris\r")
        assert b"Paris it is." in term.expect(b"bob> ")
        assert "Which city?" in messages_of(srv.requests[1])
        term.send(b"/exit\r")
        assert term.proc.wait(5) == 0
    finally:
        term.close()


# ---- 6. MCP servers never outlive the CLI ----

RAW_SERVER = REPO / "tests" / "mcp_raw_server.py"


def processes_with(marker: str) -> list[int]:
    """Pids whose command line carries the marker."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


MARKER = f"bob-test-{uuid.uuid4().hex}"   # the server of the sigterm test below


def begin_sigterm(tmp_path: Path, srv: FakeOpenAI) -> Terminal:
    marker = MARKER
    srv.push(json.dumps({"type": "tool_call", "name": "t__echo", "arguments": {"text": "ping-77"}}),
             final("echoed"), FakeOpenAI.HANG)
    write_config(tmp_path, srv, extra=(
        '[policy]\ndeny_tools = ["t__crash"]\n'
        f'[[mcp.servers]]\nid = "t"\ncommand = "{sys.executable}"\n'
        f'args = ["{RAW_SERVER}", "child", "{marker}"]\nenv = {{ MARKER = "{marker}" }}\n'))
    return Terminal(tmp_path)


def test_mcp_tools_in_the_repl_and_no_server_outlives_sigterm(early):
    # The hand-written server and its grandchild (it starts in milliseconds; the CLI with the
    # SDK's own server: tests/test_cli_mcp_call.py).
    marker, term, srv = MARKER, early["sigterm"].run, early["sigterm"].srv
    try:
        term.expect(b"bob> ")
        term.send(b"/tools\r")                     # waits for the server, started in background
        listing = term.expect(b"bob> ", timeout=10).decode()
        assert re.search(r"t__echo +t ", listing) and not re.search(r"t__echo .*denied", listing)
        assert re.search(r"t__crash .*\(denied by \[policy\]\)", listing)
        term.send(b"echo please\r")
        assert b"echoed" in term.expect(b"bob> ")
        assert "ping-77" in messages_of(srv.requests[1])   # the tool's result reached the model
        assert "t__crash" not in json.dumps(srv.requests[0]["body"])  # denied: never offered
        term.send(b"hang now\r")
        assert srv.wait_for_requests(3), "the turn never reached the model"
        assert len(processes_with(marker)) == 2, "the MCP server and its grandchild run"
        term.proc.send_signal(signal.SIGTERM)
        assert term.proc.wait(5) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 3
        while processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_with(marker) == []
    finally:
        term.close()
        srv.release()


def test_ctrl_c_while_mcp_servers_start_brings_the_prompt_back(tmp_path, srv):
    # Not begun early: "hello" must reach the turn before the server runs (seen as its marker)
    marker = f"bob-test-{uuid.uuid4().hex}"
    write_config(tmp_path, srv, extra=(
        f'[[mcp.servers]]\nid = "slow"\ncommand = "{sys.executable}"\nstartup_timeout_ms = 20000\n'
        f'args = ["{MCP_SERVER}", "--hang", "--marker", "{marker}"]\n'))
    term = Terminal(tmp_path)
    try:
        term.expect(b"bob> ")
        term.send(b"hello\r")
        deadline = time.monotonic() + 5
        while not processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert processes_with(marker), "the MCP server never started"
        term.send(b"\x03")                   # the turn waits for the server's handshake
        assert b"cancelled" in term.expect(b"bob> ", timeout=2.5)
        term.send(b"\x04")
        assert term.proc.wait(10) == 0
    finally:
        term.close()
    assert not srv.requests and processes_with(marker) == []


def begin_failing(tmp_path: Path, srv: FakeOpenAI) -> Terminal:
    write_config(tmp_path, srv, extra=(
        f'[[mcp.servers]]\nid = "bad"\ncommand = "{sys.executable}"\n'
        f'args = ["{MCP_SERVER}", "--fail"]\n'))
    return Terminal(tmp_path)


def test_a_required_mcp_server_that_fails_stops_the_repl_with_exit_1(early):
    term, srv = early["failing"].run, early["failing"].srv
    try:
        term.expect(b"bob> ")
        term.send(b"hello\r")
        said = term.expect(b"cannot open database", timeout=8)
        assert b"MCP server 'bad' failed to start" in said
        assert term.proc.wait(10) == 1
    finally:
        term.close()
    assert srv.requests == []


# Two REPLs above that start an MCP server (their CLI imports the MCP SDK: a second of CPU),
# begun together
early = begun_early({"sigterm": begin_sigterm, "failing": begin_failing})
