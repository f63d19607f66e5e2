"""Hostile inputs to the CLI (issue 11, items 7-10): config values that must fail at load time,
text no terminal can print, a store that cannot save, and one voice on stderr.
Every run is a real subprocess (or a pty) against fake_openai, in a temp dir with HOME in it."""
from __future__ import annotations

import json
import re
import resource
import signal
import subprocess
import sys
import threading

import pytest
from fake_openai import FakeOpenAI, stream_reply
from conftest import CLI, Terminal, final, run_cli, write_config, xdg_env


# ---- 1. Config values that fail at load time (exit 2, key and file named) ----

MCP_HTTP = '[[mcp.servers]]\nid = "web"\ntransport = "streamable_http"\nurl = "{}"\n'
MCP_STDIO = '[[mcp.servers]]\nid = "fs"\ncommand = "true"\n{}\n'


@pytest.mark.parametrize("extra, key", [
    ('[store]\npath = "~nosuchuser_bob/sessions"\n', "[store] path"),
    ('[store]\npath = "a\\u0000b"\n', "[store] path"),
    (MCP_STDIO.format('cwd = "~nosuchuser_bob"'), "cwd"),
    (MCP_STDIO.format('roots = ["x\\u0000"]'), "roots"),
    (MCP_STDIO.format("startup_timeout_ms = " + "1" + "0" * 30), None),
    (MCP_STDIO.format("tool_timeout_ms = 100000000000"), "tool_timeout_ms"),
    (MCP_HTTP.format("127.0.0.1:8080/mcp"), "url"),
    (MCP_HTTP.format("ftp://127.0.0.1/mcp"), "url"),
    (MCP_HTTP.format("http:///mcp"), "url"),
    (MCP_HTTP.format("http://127.0.0.1:99999/mcp"), "url"),
    ("x = " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
])
def test_a_bad_value_is_a_config_error_at_load_time(tmp_path, extra, key):
    path = write_config(tmp_path, None)
    path.write_text(path.read_text().replace("[llm]", extra + "\n[llm]", 1))
    proc = run_cli(tmp_path, "-p", "hi", env=xdg_env(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("bob: error: ") and str(path) in proc.stderr
    assert key is None or key in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("url", ["localhost:8080/v1", "file:///etc/passwd", "https://",
                                 "http://k:sk-abc@:80/v1"])
def test_a_malformed_base_url_is_a_config_error_that_hides_the_url(tmp_path, url):
    path = write_config(tmp_path, None)
    path.write_text(re.sub(r'base_url = ".*"', f'base_url = "{url}"', path.read_text()))
    proc = run_cli(tmp_path, "-p", "hi", env=xdg_env(tmp_path))
    assert proc.returncode == 2 and "[llm] base_url" in proc.stderr and str(path) in proc.stderr
    assert "sk-abc" not in proc.stderr


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/v1?api-key=s3cretvalue",
                                 "http://127.0.0.1:9/v1#s3cretvalue"])
def test_a_base_url_with_a_query_is_a_usage_error_that_hides_it(tmp_path, url):
    # It was sent as .../v1?api-key=...//chat/completions and the error showed the key.
    proc = run_cli(tmp_path, "--base-url", url, "--model", "local:x", "-p", "hi",
                   env=xdg_env(tmp_path))
    assert proc.returncode == 2 and "query" in proc.stderr, proc.stderr
    assert "s3cretvalue" not in proc.stderr


def test_a_config_path_with_an_unknown_user_is_a_usage_error(tmp_path):
    proc = run_cli(tmp_path, "--config", "~nosuchuser_bob/agent.toml", "-p", "hi",
                   env=xdg_env(tmp_path))
    assert proc.returncode == 2 and proc.stderr.startswith("bob: error: --config")


def test_an_endless_config_file_is_refused_at_a_size_limit(tmp_path):
    # /dev/zero as the config once took all memory (the OOM killer ended bob, not bob).
    proc = run_cli(tmp_path, "--config", "/dev/zero", "-p", "hi", env=xdg_env(tmp_path))
    assert proc.returncode == 2 and proc.stderr.startswith("bob: error: "), proc.stderr
    assert "/dev/zero" in proc.stderr and "1 MiB" in proc.stderr, proc.stderr


@pytest.mark.parametrize("args", [["-p", "-"], ["-p", "summarize"], []])
def test_endless_stdin_is_refused_at_a_size_limit(tmp_path, srv, args):
    # `bob < /dev/zero` (one line with no end) once took all memory, in -p and piped mode alike.
    write_config(tmp_path, srv)
    with open("/dev/zero", "rb") as zero:
        proc = subprocess.run([sys.executable, str(CLI), *args], cwd=tmp_path, stdin=zero,
                              env=xdg_env(tmp_path), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "stdin" in proc.stderr and "16 MiB" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and srv.requests == []


# ---- 2. Any text the model sends is printable ----

CUT = final("half an emoji: \ud83d!").replace("\\ud83d", "\\ud83d")   # a lone high surrogate


def test_a_lone_surrogate_prints_as_a_replacement_char_and_the_trace_keeps_it(tmp_path, srv):
    assert "\\ud83d" in CUT
    srv.push(CUT, CUT)
    write_config(tmp_path, srv)
    proc = run_cli(tmp_path, "-p", "hi", "--trace", "t.jsonl", env=xdg_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "half an emoji: \ufffd!\n"
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert "turn_completed" in kinds
    proc = run_cli(tmp_path, stdin="hi\n", env=xdg_env(tmp_path))
    assert proc.returncode == 0 and proc.stdout == "half an emoji: \ufffd!\n", proc.stderr


def test_a_lone_surrogate_streamed_prints_too(tmp_path, srv):
    srv.push(stream_reply(['{"type": "final", "content": "cut \\ud83d', ' here"}']))
    write_config(tmp_path, srv, extra="stream_default = true\n")
    proc = run_cli(tmp_path, "-p", "hi", env=xdg_env(tmp_path))
    assert proc.returncode == 0 and proc.stdout == "cut \ufffd here\n", proc.stderr


def test_the_repl_prints_a_lone_surrogate_and_goes_on(tmp_path, srv):
    srv.push(CUT, final("still-here"))
    write_config(tmp_path, srv)
    term = Terminal(tmp_path)
    try:
        term.expect(b"bob> ")
        term.send(b"hi\r")
        assert "\ufffd".encode() in term.expect(b"bob> ")
        term.send(b"again\r")
        assert b"still-here" in term.expect(b"bob> ")
    finally:
        term.close()


# ---- 3. A session that could not be saved is always reported ----

def test_a_failed_save_is_an_error_and_exit_1_without_v(tmp_path, srv):
    srv.push(final("the answer"))
    write_config(tmp_path, srv, extra='[store]\npath = "sessions"\n')
    def no_file_writes() -> None:   # a full disk, as far as bob can tell: writes fail (EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    proc = subprocess.run([sys.executable, str(CLI), "-p", "hi", "--session", "s1"],
                          cwd=tmp_path, env=xdg_env(tmp_path), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=15, check=False,
                          preexec_fn=no_file_writes)  # noqa: PLW1509 - two syscalls
    assert proc.returncode == 1 and proc.stdout == "the answer\n"   # shown, then the error
    assert proc.stderr.startswith("bob: error: could not save session s1: "), proc.stderr


def test_two_clis_on_one_session_lose_no_turn(tmp_path, srv):
    """Both CLIs load the same history and ask the model at once (a barrier in the server):
    the first save wins; the other shows its answer, then says it was not stored (exit 1)."""
    both_asked = threading.Barrier(2, timeout=10)
    def answer(body: dict) -> str:
        both_asked.wait()
        return final("re: " + body["messages"][-1]["content"])
    srv.push(answer, answer)
    write_config(tmp_path, srv, extra='[store]\npath = "sessions"\n')
    procs = [subprocess.Popen([sys.executable, str(CLI), "-p", f"turn {k}", "--session", "s"],
                              cwd=tmp_path, env=xdg_env(tmp_path), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(2)]
    outs = [(p.communicate(timeout=20), p.returncode) for p in procs]
    assert sorted(code for _, code in outs) == [0, 1], outs
    (lost_out, lost_err), _ = next(o for o in outs if o[1] == 1)
    assert lost_out.startswith("re: turn ") and "changed by another turn" in lost_err, lost_err
    stored = json.loads((tmp_path / "sessions" / "s.json").read_text())["messages"]
    kept = next(out for (out, _), code in outs if code == 0)
    assert [m["content"] for m in stored] == [kept.strip().removeprefix("re: "), kept.strip()]


# ---- 4. One voice ----

def test_ctrl_c_in_a_repl_turn_prints_one_line(tmp_path, srv):
    srv.push(FakeOpenAI.HANG, final("after"))
    write_config(tmp_path, srv)
    term = Terminal(tmp_path)
    try:
        term.expect(b"bob> ")
        term.send(b"wait\r")
        assert srv.wait_for_requests(1)
        term.expect(b"wait\r\n")   # TERM=dumb: no status line (issue 22)
        term.send(b"\x03")
        seen = term.expect(b"bob> ").decode()
        shown = [x.split("\r")[-1] for x in seen.replace("\x1b[K", "").split("\r\n")]
        lines = [x for x in shown if x.strip()]   # what stays on screen
        assert lines == ["bob: warning: turn cancelled; the session is kept"], seen
    finally:
        srv.release()
        term.close()


def test_warnings_from_the_library_speak_in_bobs_voice(tmp_path, srv):
    srv.push(final("ok"))
    write_config(tmp_path, srv, extra=MCP_STDIO.format("required = false").replace(
        'command = "true"', 'command = "/nonexistent/bob-server"'))
    proc = run_cli(tmp_path, "-p", "hi", env=xdg_env(tmp_path))
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr
    lines = proc.stderr.splitlines()
    assert lines and all(x.startswith(("bob: warning: ", "bob: error: ")) for x in lines), lines
    assert subprocess.run([sys.executable, str(CLI), "--help"], capture_output=True,
                          check=False).returncode == 0
