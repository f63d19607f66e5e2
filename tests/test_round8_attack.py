"""Round 8, the attack on what changed: the adapter's refusals cut of the texts the request
sent (_unquoted, _http_failure), the savings that must not change behaviour (the request body
posted as a str), and the CLI's approval prompt handshake and main()'s one error handler.

The eight breaks it found were strict xfails (what breaks, what the user sees, where in the
code); all are fixed now and plain tests, beside the promises that held under the attack. Real parts only: the fake HTTP
server, a raw socket for the bytes on the wire, the CLI as a subprocess and on a real pty.
Sections: 1. Learnt refusals  2. The body on the wire  3. The approval prompt  4. main's errors
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI, completion, tool_calls_reply

import bob
from bob import CancelToken, LlmError, LlmRequest, Message, ToolCall
from conftest import CLI, Terminal, final, make_llm, marked_pids, write_config, xdg_env

RAW_SERVER = Path(__file__).resolve().parent / "mcp_raw_server.py"


# ---- 1. Learnt refusals: the texts the request sent cut out of the error ---------------------

REFUSAL = "Unrecognized request argument supplied: reasoning_content"


def history(asked: str, system: str = "You are bob.") -> list[Message]:
    """The user asked `asked`; the model (a thinking one) called a tool with its reasoning."""
    return [Message("system", system), Message("user", asked),
            Message("assistant", "", (ToolCall("call_1", "add", {"a": 2, "b": 3}),),
                    reasoning="The user wants 2+3; use add."),
            Message("tool", "5", tool_call_id="call_1", name="add"),
            Message("user", "and 4+4?")]


def reasoning_sent(messages: list[Message], *answers) -> list[bool]:
    """Ask twice (the first answer an error); whether each request carried the reasoning."""
    with FakeOpenAI([*answers, "ok", "ok"]) as srv:
        llm = make_llm(srv, retry_max=0)
        for _ in range(2):
            try:
                llm.complete(LlmRequest(messages, [], None, None), CancelToken())
            except LlmError:
                pass
        return ["reasoning_content" in r["body"]["messages"][2] for r in srv.requests]


def rejected(text: str, status: int = 400) -> dict:
    return {"status": status, "body": {"error": {"message": text}}}


LEARNT, NOT_LEARNT = [True, False, False], [True, True]


@pytest.mark.parametrize("said", ["_content", "ng_content"])
def test_a_refusal_is_learnt_when_a_message_is_a_piece_of_the_fields_name(said):
    assert reasoning_sent(history(said), rejected(REFUSAL)) == LEARNT


def test_a_refusal_naming_the_field_after_4_kib_of_echo_is_learnt():
    system = "Answer briefly. " * 320   # 5,120 chars
    echo = json.dumps({"messages": [{"role": "system", "content": system},
                                    {"role": "assistant", "reasoning_content": "..."}]})
    assert reasoning_sent(history("2+3?", system),
                          rejected(f"bad request {echo}: {REFUSAL}")) == LEARNT


def test_a_long_quoted_prompt_naming_the_field_is_no_refusal():
    asked = "Please explain what reasoning_content is in this API doc:\n" + "text " * 1000
    flagged = rejected(f"Rejected by the safety system: the prompt '{asked}' may be unsafe")
    assert reasoning_sent(history(asked), flagged) == NOT_LEARNT


def test_a_prompt_quoted_by_a_json_body_keeping_non_ascii_is_no_refusal():
    asked = '¿qué es "reasoning_content"?\nY 2+3?'
    body = json.dumps({"error": {"message": f"the prompt '{asked}' may be unsafe"}},
                      ensure_ascii=False)
    assert reasoning_sent(history(asked), {"status": 400, "body": body,
                                           "headers": {"Content-Type": "application/json"}}
                          ) == NOT_LEARNT


ASKED = 'what does "reasoning_content" mean?\nand 2+3?'


@pytest.mark.parametrize("status, message", [
    (400, f"{REFUSAL}. Your prompt: '{ASKED}'"),
    (400, f"Additional properties are not allowed ('reasoning_content' was unexpected); "
          f"input: {json.dumps(ASKED)}"),
    (422, json.dumps({"detail": [
        {"type": "extra_forbidden", "loc": ["body", "messages", 2, "reasoning_content"],
         "msg": "Extra inputs are not permitted", "input": "The user wants 2+3; use add."},
        {"type": "string_too_short", "loc": ["body", "messages", 1, "content"],
         "msg": "too short", "input": ASKED}]})),
    (500, f"Please remove the reasoning_content. ({ASKED})"),
])
def test_a_refusal_quoting_the_users_text_too_is_still_learnt(status, message):
    assert reasoning_sent(history(ASKED), rejected(message, status)) == LEARNT


def test_a_refused_extra_content_beside_a_quoted_prompt_naming_it_is_learnt():
    asked = "what is extra_content?"
    messages = [Message("user", asked),
                Message("assistant", "", (ToolCall("c1", "add", {}, extra={
                    "extra_content": {"google": {"thought_signature": "sig"}}}),)),
                Message("tool", "5", tool_call_id="c1", name="add"), Message("user", "more")]
    refusal = rejected(f"Unknown name \"extra_content\" at 'messages[1].tool_calls[0]': "
                       f"prompt '{asked}'")
    with FakeOpenAI([refusal, "ok"]) as srv:
        llm = make_llm(srv, retry_max=0)
        assert llm.complete(LlmRequest(messages, [], None, None), CancelToken()).content == "ok"
        sent = ["extra_content" in r["body"]["messages"][1]["tool_calls"][0]
                for r in srv.requests]
    assert sent == [True, False]


# ---- 2. The body on the wire: a str now, the same bytes -----------------------------------------

def one_raw_request(reply: bytes) -> tuple[socket.socket, dict]:
    """A listening socket answering one request with `reply`; got["head"], got["body"]: the
    request's bytes as they came."""
    listener = socket.create_server(("127.0.0.1", 0))
    got: dict = {}

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            while len(body) < length:
                body += conn.recv(1 << 20)
            got.update(head=head, body=body, length=length)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(reply), reply))
    threading.Thread(target=serve, daemon=True).start()
    return listener, got


def test_non_ascii_lone_surrogates_and_a_huge_body_go_on_the_wire_as_their_json_bytes():
    text = "héllo 🙂 \ud83d cut emoji, \x00 NUL, \u2028 " + "ü" * 3_000_000
    listener, got = one_raw_request(json.dumps(completion("ok")).encode())
    with listener:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        llm = bob.OpenAICompatLlm("test:m", base_url=url, api_key="sk-test-0123456789",
                                  extra_body={"über": "ñ\ud800"})
        assert llm.complete(LlmRequest([Message("user", text)], [], None, None),
                            CancelToken()).content == "ok"
    body = got["body"]
    assert got["length"] == len(body) and body.isascii()
    sent = json.loads(body)
    assert sent["messages"][0]["content"] == text and sent["über"] == "ñ\ud800"
    assert body == json.dumps(sent, separators=(",", ":")).encode()



def strict_json(data: bytes):
    """JSON as RFC 8259 has it: NaN and Infinity are none (Python's json reads them)."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(data, parse_constant=refuse)


def test_a_tools_infinite_default_never_makes_the_request_body_invalid_json():
    def scale(x: float = float("inf")) -> str:
        """Scale."""
        return str(x)
    listener, got = one_raw_request(json.dumps(completion("ok")).encode())
    with listener:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        llm = bob.OpenAICompatLlm("test:m", base_url=url, api_key="sk-test-0123456789")
        tools = bob.FunctionTools([scale]).list_tools()
        llm.complete(LlmRequest([Message("user", "hi")], tools, None, None), CancelToken())
    strict_json(got["body"])


# ---- 3. The approval prompt's handshake, on a real terminal --------------------------------------

def call(text: str = "x") -> str:
    return json.dumps({"type": "tool_call", "name": "t__echo", "arguments": {"text": text}})


def asking_repl(tmp_path: Path, srv: FakeOpenAI, runtime: str = "", marker: str = "raw",
                extra: str = "") -> Terminal:
    """The REPL on a pty, t__echo (the raw MCP server: it starts in ms) needing approval."""
    write_config(tmp_path, srv, runtime=runtime, extra=(
        f'{extra}[policy]\nask_tools = ["t__echo"]\n[[mcp.servers]]\nid = "t"\n'
        f'command = "{sys.executable}"\nargs = ["{RAW_SERVER}", "{marker}"]\n'))
    term = Terminal(tmp_path, env=xdg_env(tmp_path))
    term.expect(b"bob> ", timeout=10)
    return term


def test_ctrl_d_at_the_approval_prompt_cancels_the_turn_and_the_repl_goes_on(tmp_path, srv):
    srv.push(call(), final("fine"))
    term = asking_repl(tmp_path, srv)
    try:
        term.send(b"go\r")
        term.expect(b"this session? ", timeout=10)
        term.wait_blocked_reading()
        term.send(b"\x04")   # Ctrl-D: a cancel, not the REPL's quit
        assert b"turn cancelled" in term.expect(b"bob> ", timeout=5)
        term.send(b"again\r")
        assert b"fine" in term.expect(b"bob> ", timeout=5)
    finally:
        term.close()


def test_always_then_a_question_then_the_tool_again_runs_without_a_prompt(tmp_path, srv):
    ask = json.dumps({"type": "ask_user", "question": "which colour?"})
    srv.push(call("one"), ask, call("two"), final("done"))
    term = asking_repl(tmp_path, srv)
    try:
        term.send(b"go\r")
        term.expect(b"this session? ", timeout=10)
        term.send(b"a\r")
        assert b"which colour?" in term.expect(b"your answer to bob's question> ", timeout=5)
        term.send(b"blue\r")
        seen = term.expect(b"bob> ", timeout=5)
        assert b"done" in seen and b"wants to run" not in seen, seen
    finally:
        term.close()
    assert json.loads(json.dumps(srv.requests[2]["body"]))["messages"][-1]["content"] == "blue"


def test_sigterm_at_the_approval_prompt_exits_saves_and_stops_the_server(tmp_path, srv):
    marker = f"bob-r8-attack-{tmp_path.name}"
    srv.push(call())
    term = asking_repl(tmp_path, srv, marker=marker)
    try:
        term.send(b"go\r")
        term.expect(b"this session? ", timeout=10)
        term.wait_blocked_reading()
        term.proc.send_signal(signal.SIGTERM)
        assert term.proc.wait(5) == 128 + signal.SIGTERM
    finally:
        term.close()
    assert marked_pids(marker) == []
    saved = list((tmp_path / "xd" / "bob" / "sessions").glob("*.json"))
    assert len(saved) == 1 and "go" in saved[0].read_text()


def test_two_approvals_in_one_batch_yes_then_ctrl_c_cancels_and_history_stays_whole(
        tmp_path, srv):
    srv.push(tool_calls_reply([("t__echo", {"text": "one"}), ("t__echo", {"text": "two"})]),
             completion("fine"))
    term = asking_repl(tmp_path, srv, runtime='action_mode = "native"\n')
    try:
        term.send(b"go\r")
        assert b"one" in term.expect(b"this session? ", timeout=10)
        term.send(b"y\r")
        assert b"two" in term.expect(b"this session? ", timeout=5)
        term.wait_blocked_reading()
        term.send(b"\x03")
        assert b"turn cancelled" in term.expect(b"bob> ", timeout=5)
        term.send(b"again\r")
        assert b"fine" in term.expect(b"bob> ", timeout=5)
    finally:
        term.close()
    sent = srv.requests[1]["body"]["messages"]
    calls = [c["id"] for m in sent if m["role"] == "assistant" for c in m.get("tool_calls", ())]
    assert [m["tool_call_id"] for m in sent if m["role"] == "tool"] == calls and len(calls) == 2


def first_of(term: Terminal, *texts: bytes, timeout: float = 3.0) -> bytes:
    """Read until one of `texts` is on the terminal; return it (what came before is consumed)."""
    deadline = time.monotonic() + timeout
    while not any(t in term.seen for t in texts):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([term.fd], [], [], left)[0]:
            raise AssertionError(f"none of {texts} seen; output: {term.seen[-600:]!r}")
        term.seen += os.read(term.fd, 4096)
    found = min(texts, key=lambda t: term.seen.find(t) if t in term.seen else len(term.seen))
    term.expect(found)
    return found


def test_answering_as_the_turn_times_out_leaves_no_ctrl_c_for_the_next_line(tmp_path, srv):
    # 150 ms turns, each asking at once (its prompt shows at the main thread's first 0.1 s
    # tick, in about half the turns), answered the moment it shows: the answer races the
    # turn's end and the worker's Ctrl-C. A Ctrl-C meant for the prompt landing after it
    # would drop the `/usage` typed next at `bob> `, or show a traceback.
    srv.push(*[call()] * 60)
    term = asking_repl(tmp_path, srv, runtime="turn_timeout_ms = 150\n")
    try:
        for _ in range(7):
            term.send(b"go\r")
            while first_of(term, b"this session? ", b"bob> ") == b"this session? ":
                term.send(b"y\r")
            term.send(b"/usage\r")
            assert b"tokens" in term.expect(b"bob> ", timeout=3)
    finally:
        term.close()


# ---- 4. main's one handler: exit codes, and what MCP servers say as they stop -------------------

def goodbye_config(tmp_path: Path) -> None:
    """No LLM server; the raw MCP server, which says goodbye on stderr as bob stops it."""
    write_config(tmp_path, None, extra=(
        f'[[mcp.servers]]\nid = "t"\ncommand = "{sys.executable}"\n'
        f'args = ["{RAW_SERVER}", "goodbye"]\n'))


def cli(tmp_path: Path, *args: str, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE):
    return subprocess.run([sys.executable, str(CLI), *args], cwd=tmp_path, env=xdg_env(tmp_path),
                          stdin=stdin, stdout=subprocess.PIPE, stderr=stderr, text=True,
                          timeout=15, check=False)


def test_after_any_error_but_an_oserror_what_servers_say_as_they_stop_shows(tmp_path):
    """main's handler sends fds 1 and 2 to /dev/null for an OSError alone (a full disk, a
    reader that left): after r8-cli's first fix every error did so, before the MCP servers
    stopped, and with -v what a server wrote as it stopped was lost. Three runs side by side
    (each imports the MCP SDK: a second of CPU): no LLM server (an LlmError, exit 1); `-p -`
    with stdin empty, found after the servers started (a ConfigError, exit 2); stdin open for
    writing only (`-p - 0>file`: it said only `[Errno 9] Bad file descriptor` and took the
    OSError path; now `cannot read stdin`, exit 2)."""
    runs = {"llm": ("-p", "hi"), "empty": ("-p", "-"), "unreadable": ("-p", "-")}
    procs = {}
    for name, args in runs.items():
        (tmp_path / name).mkdir()
        goodbye_config(tmp_path / name)
        with open(tmp_path / name / "written", "w") as write_only:
            procs[name] = subprocess.Popen(
                [sys.executable, str(CLI), "-v", *args], cwd=tmp_path / name,
                env=xdg_env(tmp_path / name), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                stdin=write_only if name == "unreadable" else subprocess.DEVNULL, text=True)
    done = {name: (proc.communicate(timeout=15)[1], proc.returncode)
            for name, proc in procs.items()}
    for name, (err, code) in done.items():
        assert "[t] raw server: goodbye" in err, (name, err)
        said = [line for line in err.splitlines() if line.startswith("bob: error:")]
        assert len(said) == 1, (name, err)
    assert done["llm"][1] == 1 and "cannot reach http://127.0.0.1:9/v1" in done["llm"][0]
    assert done["empty"][1] == 2 and "-p -: stdin is empty" in done["empty"][0]
    assert done["unreadable"][1] == 2 and "cannot read stdin: " in done["unreadable"][0]


def test_a_config_error_with_stderr_on_a_full_disk_still_exits_2(tmp_path):
    write_config(tmp_path, None)
    with open("/dev/full", "w") as full:
        done = cli(tmp_path, "--model", "nosuch", "-p", "hi", stderr=full)
    assert done.returncode == 2

