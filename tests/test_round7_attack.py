"""The seventh round's attack on bob_cli.py and bob_mcp.py as hostile peers: a trace handed to
`bob replay` (a bug report's attachment), signals while `bob replay --live-tools` runs MCP
servers, a `--trace` file that cannot be written, an agent.toml whose `[store] path` is no
directory. Each test failed before its fix (or is a strict xfail saying why it is not fixed);
every run is a real subprocess against fake_openai or a real MCP server process."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import termios
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import bob
from conftest import (CLI, Terminal, begun_early, cli_begun, collected, final, marked_pids,
                      run_cli, wait_until, write_config, xdg_env)
from fake_openai import FakeOpenAI

# What drives a terminal: an OSC retitling it (ESC ] ... BEL), a CSI clearing it, a bidi override
DRIVING = "\x1b]0;PWNED\x07\x1b[2J\u202e"


def _trace(path: Path, replies) -> list[dict]:
    """A real trace of one turn (ScriptedLlm, no tools), as its events."""
    bob.AgentRuntime(bob.ScriptedLlm(replies), events=[bob.JsonlEventSink(path)]).run(
        bob.AgentRequest("hello", session_id="s"))
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, events: list[dict]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


# ---- 1. `bob replay` of a hostile trace: its report cannot drive the terminal ----------------

def test_a_replay_report_of_a_hostile_trace_cannot_drive_the_terminal(tmp_path):
    # A field replay does not compare (the turn's step count) is shown in the report's line
    # as the trace has it: "turn 1: same (ESC]0;PWNED BEL ESC[2J LLM calls, ...)" retitled
    # and cleared the terminal of whoever replayed a trace someone sent them.
    events = _trace(tmp_path / "t.jsonl", [final("hi")])
    for e in events:
        if e["kind"] == "turn_completed":
            e["data"]["steps"] = DRIVING
    _write(tmp_path / "hostile.jsonl", events)
    run = run_cli(tmp_path, "replay", "hostile.jsonl", env=xdg_env(tmp_path))
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("turn 1: same ("), run.stdout
    assert not set("\x1b\x07\u202e") & set(run.stdout), repr(run.stdout)


def test_a_replay_whose_reader_left_ends_quietly_with_141(tmp_path):
    # `bob replay run.jsonl | head -1` on a long trace: the report's print met the closed pipe
    # and Python's traceback came out (exit 1); `-p` in the same place ends quietly with 141.
    _trace(tmp_path / "t.jsonl", [final("hi")])
    proc = subprocess.Popen([sys.executable, str(CLI), "replay", "t.jsonl"], cwd=tmp_path,
                            env=xdg_env(tmp_path), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()   # the reader left before the report came
    err = proc.stderr.read()
    assert proc.wait(15) == 141 and err == "", (proc.returncode, err)


# ---- 2. Signals while `bob replay --live-tools` runs MCP servers -------------------------------

MARKER = f"31.{os.getpid()}"   # the argument of the MCP server's child: found in /proc by it


def begin_replay_live(path: Path, srv: FakeOpenAI) -> subprocess.Popen[str]:
    """`bob replay --live-tools` on a config of MCP servers that never answer the handshake,
    each with a child deaf to SIGTERM in its process group (as a tool's worker may be): six,
    started together, so that a signal as the first appears finds others spawning."""
    server = f"(trap '' TERM HUP; exec sleep {MARKER}) & exec cat > /dev/null"
    (path / "agent.toml").write_text("".join(
        f'[[mcp.servers]]\nid = "slow{n}"\ncommand = "sh"\nargs = ["-c", "{server}"]\n'
        for n in range(6)))
    _write(path / "t.jsonl", _trace(path / "r.jsonl", [final("hi")]))
    return cli_begun(path, "replay", "t.jsonl", "--live-tools", env=xdg_env(path))


def test_sigterm_to_replay_live_tools_leaves_no_mcp_process(early):
    # `bob replay --live-tools` starts the config's MCP servers, but SIGTERM (or SIGHUP) killed
    # it outright: the handlers that stop the servers first were set only for the other modes,
    # and the servers' children outlived bob. Then (bob_mcp.py) a stop that landed while a
    # server was spawning killed its pid alone (asyncio's doing), never its group: its child
    # outlived bob (1 run in 4 or so here before the fix; 2 in 15 with one server).
    proc = early["replay_live"].run
    try:
        assert wait_until(lambda: marked_pids(MARKER), 10), "the MCP server never started"
        proc.send_signal(signal.SIGTERM)
        run = collected(proc)
        assert run.returncode == 128 + signal.SIGTERM, run
        assert wait_until(lambda: not marked_pids(MARKER), 3), "an MCP process outlived bob"
    finally:
        for pid in marked_pids(MARKER):   # this test's own: a break leaves it behind
            os.kill(pid, signal.SIGKILL)


# ---- 3. A --trace file that takes the first line but not the next -----------------------------

def test_a_trace_that_cannot_be_written_says_which_file(tmp_path):
    # --trace /dev/full (a full disk, a pipe whose reader stalled): the check before the turn
    # opens it fine, every write fails. bob said only `bob: warning: event sink
    # <bob.JsonlEventSink object at 0x7f...> failed on session_loaded; ignored`: not which
    # file. (Its cause is not added: a library record's cause may quote a server's answer,
    # a secret in it unmasked; see the echo test below.)
    with FakeOpenAI([final("the answer")]) as srv:
        write_config(tmp_path, srv)
        run = run_cli(tmp_path, "-p", "hi", "--trace", "/dev/full", env=xdg_env(tmp_path))
    assert run.returncode == 0 and run.stdout == "the answer\n", run
    assert run.stderr.startswith("bob: warning: "), run.stderr
    assert "--trace /dev/full" in run.stderr, run.stderr   # (why: -v's traceback says)
    assert "object at 0x" not in run.stderr and run.stderr.count("\n") == 1, run.stderr


# ---- 4. agent.toml: a [store] path that is no directory ---------------------------------------

def test_a_store_path_naming_a_file_is_a_config_error_naming_the_key(tmp_path):
    # `[store] path = "notes.txt"` (a file): the turn failed at its start with exit 1, `could
    # not save session ID: cannot read session file .../notes.txt/ID.json: Not a directory`:
    # not the key to fix, nor a config error (exit 2).
    (tmp_path / "notes.txt").write_text("my notes\n")
    path = write_config(tmp_path, None, runtime="")
    path.write_text(path.read_text() + '[store]\npath = "notes.txt"\n')
    for args in (["-p", "hi"], ["--sessions"]):
        run = run_cli(tmp_path, *args, env=xdg_env(tmp_path))
        assert run.returncode == 2, (args, run.stderr)
        assert run.stderr.startswith("bob: error: ") and run.stderr.count("\n") == 1, run.stderr
        assert "[store] path" in run.stderr and str(path) in run.stderr, run.stderr
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"


def test_a_trace_into_a_pipe_keeps_every_line_whole(tmp_path):
    # `bob --trace >(gzip > t.gz)`: the trace is a pipe, and its reader takes a moment. An
    # answer of 300 KB (one llm_call_completed line) came out cut at the pipe's 64 KB, and no
    # event after it. The reader here begins once half the pipe is taken (or bob is done): a
    # blocking write waits for it, a non-blocking one fails at once.
    reader_end, writer_end = os.pipe()
    answer = (tmp_path / "answer.txt").open("w")
    with FakeOpenAI([final("x" * 300_000)]) as srv:
        write_config(tmp_path, srv)
        proc = subprocess.Popen([sys.executable, str(CLI), "-p", "hi", "--trace",
                                 f"/dev/fd/{writer_end}"], cwd=tmp_path, env=xdg_env(tmp_path),
                                stdin=subprocess.DEVNULL, stdout=answer, stderr=subprocess.PIPE,
                                text=True, pass_fds=[writer_end])
        os.close(writer_end)
        with os.fdopen(reader_end, "rb") as trace:
            def queued() -> int:
                return struct.unpack("i", fcntl.ioctl(trace, termios.FIONREAD, b"    "))[0]
            wait_until(lambda: queued() >= 32768 or proc.poll() is not None, 15)
            lines = trace.read().decode().splitlines()   # to its end: bob's exit closes it
        err = proc.communicate(timeout=15)[1]
    answer.close()
    assert proc.returncode == 0 and err == "", err
    assert (tmp_path / "answer.txt").stat().st_size == 300_001
    events = [json.loads(line) for line in lines]   # each line whole
    assert events[-1]["kind"] == "turn_completed"


# ---- 5. A sessions directory with something planted in it ----------------------------------

def test_a_symlink_planted_as_a_sessions_flags_file_is_not_written_through(tmp_path):
    # The store never writes through a symlink planted in its directory (README, "Sessions and
    # stores"), but the CLI's ID.flags beside it was written with open(..., "w"): a `.flags`
    # symlink (a cloned repository's `.bob/sessions`, as its agent.toml's [store] path says)
    # had its target, any file of the user's, replaced by {"model": ...}.
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    victim = tmp_path / "notes.txt"
    victim.write_text("my notes\n")
    (sessions / "s1.flags").symlink_to("../notes.txt")
    with FakeOpenAI([final("hi")]) as srv:
        path = write_config(tmp_path, srv)
        path.write_text(path.read_text() + '[store]\npath = "sessions"\n')
        run = run_cli(tmp_path, "--session", "s1", "--model", "openai:other", "-p", "hi",
                      env=xdg_env(tmp_path))
    assert run.returncode == 0 and run.stdout == "hi\n", run.stderr
    assert victim.read_text() == "my notes\n"
    assert json.loads((sessions / "s1.flags").read_text()) == {"model": "openai:other"}


# ---- 6. A real terminal: NO_COLOR means no escape sequence at all -----------------------------

def test_no_color_turns_off_bracketed_paste_too(tmp_path):
    # README: "With TERM=dumb or NO_COLOR set, bob writes no escape sequences". With NO_COLOR
    # on an xterm, the REPL still turned readline's bracketed paste on: ESC[?2004h before each
    # prompt (shown as ^[[?2004h by a terminal log, an editor's shell buffer, `script`).
    write_config(tmp_path, None)
    term = Terminal(tmp_path, env=xdg_env(tmp_path, TERM="xterm", NO_COLOR="1"))
    try:
        shown = term.expect(b"bob> ")
        term.send(b"/help\r")
        shown += term.expect(b"bob> ")
    finally:
        term.close()
    assert b"/save FILE" in shown and b"\x1b" not in shown, shown


# ---- 7. A Streamable HTTP MCP server whose words reach -v's log lines -------------------------

class _SseHandler(BaseHTTPRequestHandler):
    """An MCP server answering each request as an SSE stream whose first event has a name that
    drives a terminal (the MCP SDK logs `Unknown SSE event: NAME` and goes on), then the answer."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, data: bytes = b"", kind: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Mcp-Session-Id", "s1")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(405)

    do_DELETE = do_GET

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        if "id" not in body:
            return self._send(202)
        result = {"initialize": {"protocolVersion": body.get("params", {}).get("protocolVersion"),
                                 "capabilities": {"tools": {}},
                                 "serverInfo": {"name": "sse", "version": "1"}},
                  "tools/list": {"tools": [{"name": "echo", "inputSchema": {"type": "object"}}]}
                  }.get(body["method"], {"content": [{"type": "text", "text": "ok"}]})
        answer = json.dumps({"jsonrpc": "2.0", "id": body["id"], "result": result})
        self._send(200, f"event: {DRIVING}\ndata: x\n\nevent: message\ndata: {answer}\n\n"
                   .encode(), "text/event-stream")


SSE_SERVERS: dict[Path, ThreadingHTTPServer] = {}   # begin_sse's, begin_echo's, by directory


def begin_sse(path: Path, srv: FakeOpenAI) -> subprocess.Popen[str]:
    """`bob -v -p hi` with a Streamable HTTP MCP server answering in SSE (_SseHandler)."""
    server = SSE_SERVERS[path] = ThreadingHTTPServer(("127.0.0.1", 0), _SseHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    srv.push(final("done"))
    write_config(path, srv, extra=(f'[[mcp.servers]]\nid = "w"\ntransport = "streamable_http"\n'
                                   f'url = "http://127.0.0.1:{server.server_address[1]}/mcp"\n'))
    return cli_begun(path, "-v", "-p", "hi", env=xdg_env(path))


def served(begun) -> subprocess.CompletedProcess[str]:
    """The CLI run begun beside its HTTP MCP server (SSE_SERVERS), collected; the server then
    stopped."""
    try:
        return collected(begun.run)
    finally:
        server = SSE_SERVERS.pop(begun.path)
        server.shutdown()
        server.server_close()


def test_verbose_log_lines_quoting_an_http_server_cannot_drive_the_terminal(early):
    # Without -v a library's warning reads `bob: warning: ...`, controls shown as U+FFFD; with
    # -v the log lines went out as the record had them: the SDK's `Unknown SSE event: ESC]0;...`
    # retitled and cleared the terminal (README: -v's lines cannot drive it).
    run = served(early["sse"])
    assert run.returncode == 0 and run.stdout == "done\n", run.stderr
    assert "Unknown SSE event: " in run.stderr, run.stderr
    assert not set("\x1b\x07\u202e") & set(run.stderr), repr(run.stderr[-600:])


class _EchoHandler(BaseHTTPRequestHandler):
    """An MCP server whose answer is no JSON-RPC message, and echoes the request's
    Authorization header in it (a debugging proxy, a server's error page)."""
    protocol_version = "HTTP/1.1"
    log_message = _SseHandler.log_message
    _send = _SseHandler._send
    do_GET = do_DELETE = _SseHandler.do_GET

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        if "id" not in body:
            return self._send(202)
        self._send(200, json.dumps({"jsonrpc": "2.0", "id": body["id"],
                                    "echo": self.headers.get("Authorization"), "result": 5}
                                   ).encode(), "application/json")


SECRET = "sk-SECRETVALUE123"   # begin_echo's MCP token


def begin_echo(path: Path, srv: FakeOpenAI) -> subprocess.Popen[str]:
    """`bob -v -p hi` with a Streamable HTTP MCP server that echoes its token (_EchoHandler):
    with -v the SDK's own log record of the bad answer, and its traceback, show too."""
    server = SSE_SERVERS[path] = ThreadingHTTPServer(("127.0.0.1", 0), _EchoHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    write_config(path, srv, extra=(f'[[mcp.servers]]\nid = "w"\ntransport = "streamable_http"\n'
                                   f'url = "http://127.0.0.1:{server.server_address[1]}/mcp"\n'
                                   'headers = { Authorization = "Bearer ${MCP_TOKEN}" }\n'))
    return cli_begun(path, "-v", "-p", "hi", env=xdg_env(path, MCP_TOKEN=SECRET))


def test_a_secret_an_http_server_echoes_in_a_bad_answer_is_not_shown(early):
    run = served(early["echo"])
    assert run.returncode == 1 and "failed to start" in run.stderr, run.stderr
    shown = [SECRET[i:i + 6] for i in range(len(SECRET) - 5) if SECRET[i:i + 6] in run.stderr]
    assert not shown, run.stderr
    # the SDK's validation error still says what was wrong, its cut quote of the answer left out
    assert "input_value=(left out), input_type=" in run.stderr, run.stderr


# The runs that start an MCP server (each imports the MCP SDK: a second of CPU), side by side
early = begun_early({"replay_live": begin_replay_live, "sse": begin_sse, "echo": begin_echo})


# ---- 8. Odd flag values --------------------------------------------------------------------

def test_forget_of_an_empty_or_bad_id_is_a_usage_error_and_runs_no_turn(tmp_path):
    # `bob --forget "$ID"` with ID unset: --forget "" was taken for no --forget at all, and bob
    # went on to run: here each piped line became a turn sent to the model. `--forget ../x`
    # was exit 1, a runtime error. Both are usage errors (exit 2), as `--session ""` is.
    with FakeOpenAI([final("sent")]) as srv:
        write_config(tmp_path, srv)
        runs = [run_cli(tmp_path, "--forget", bad, stdin="my secret notes\n",
                        env=xdg_env(tmp_path)) for bad in ("", "../x")]
        assert not srv.requests, "a turn ran"
    for run in runs:
        assert run.returncode == 2 and run.stdout == "", (run.returncode, run.stderr)
        assert run.stderr.startswith("bob: error: ") and "--sessions" in run.stderr, run.stderr


def test_sessions_names_a_session_file_it_cannot_read(tmp_path):
    # A session file cut short (a disk that filled, an edit gone wrong) was left out of
    # --sessions without a word, while `bob -c` picked it and failed on it: the user could not
    # see which session it was, nor why.
    sessions = tmp_path / "xd" / "bob" / "sessions"
    sessions.mkdir(parents=True)
    whole = {"messages": [{"role": "user", "content": "hello"}], "usage": {}, "version": 1}
    (sessions / "good.json").write_text(json.dumps(whole))
    (sessions / "cut.json").write_text(json.dumps(whole)[:40])
    run = run_cli(tmp_path, "--sessions", env=xdg_env(tmp_path))
    assert run.returncode == 0 and run.stdout.startswith("good  "), run
    assert run.stderr.startswith("bob: warning: ") and "cut.json" in run.stderr, run.stderr
    assert run.stderr.count("\n") == 1, run.stderr


# ---- 9. `bob replay` of a trace edited by hand (bob.py's reading of it) ---------------------

def test_a_trace_whose_session_id_is_no_string_is_a_trace_error(tmp_path):
    # Found by fuzzing the fields of a real trace (about 1 edit in 30 hit it; nothing else).
    events = _trace(tmp_path / "t.jsonl", [final("hi")])
    events[2]["session_id"] = {"id": "s"}
    _write(tmp_path / "edited.jsonl", events)
    run = run_cli(tmp_path, "replay", "edited.jsonl", env=xdg_env(tmp_path))
    assert run.returncode == 2 and "internal error" not in run.stderr, run.stderr
    assert "line 3" in run.stderr, run.stderr


def _into_full_disk(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """bob ARGS with stdout /dev/full (a file on a full disk)."""
    with open("/dev/full", "w") as full:
        return subprocess.run([sys.executable, str(CLI), *args], cwd=tmp_path,
                              env=xdg_env(tmp_path), stdin=subprocess.DEVNULL, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=15)


def test_an_answer_a_full_disk_cannot_take_is_no_internal_error(tmp_path):
    # `bob -p ... > out.txt` on a full disk: `bob: error: internal error: OSError: [Errno 28] No
    # space left on device`, as if bob had a bug, then Python's `Exception ignored in: <stdout>`
    # and exit 120. It is the disk: a runtime error (exit 1) that says so; the session is kept.
    with FakeOpenAI([final("the answer")]) as srv:
        write_config(tmp_path, srv)
        run = _into_full_disk(tmp_path, "-p", "hi", "--session", "s1")
    assert run.returncode == 1 and "internal error" not in run.stderr, run.stderr
    assert run.stderr == "bob: error: [Errno 28] No space left on device\n", run.stderr
    assert (tmp_path / "xd" / "bob" / "sessions" / "s1.json").is_file()


def test_a_replay_report_a_full_disk_cannot_take_is_no_internal_error(tmp_path):
    # `bob replay TRACE > report.txt` on a full disk: the same internal error and exit 120 as
    # `-p`. A runtime error (exit 1, as a divergence, but with the one line saying why).
    _trace(tmp_path / "t.jsonl", [final("hi")])
    run = _into_full_disk(tmp_path, "replay", "t.jsonl")
    assert (run.returncode, run.stderr) == (1, "bob: error: [Errno 28] No space left on "
                                                "device\n"), run.stderr


def test_a_session_list_a_full_disk_cannot_take_is_said(tmp_path):
    # `bob --sessions > list.txt` on a full disk: nothing said by bob, Python's `Exception ignored
    # in: <stdout>` at exit, and exit 120 (the list was printed unflushed: the error came only
    # when Python's exit wrote it). The same one line and exit 1 as an answer's.
    with FakeOpenAI([final("the answer")]) as srv:
        write_config(tmp_path, srv)
        assert run_cli(tmp_path, "-p", "hi", "--session", "s1", env=xdg_env(tmp_path)
                       ).returncode == 0
    run = _into_full_disk(tmp_path, "--sessions")
    assert (run.returncode, run.stderr) == (1, "bob: error: [Errno 28] No space left on "
                                                "device\n"), run.stderr
