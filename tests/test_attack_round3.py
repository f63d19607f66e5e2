"""Attack round 3: the features that landed with issues 20, 21, 22 and 24 (replay, trace masking,
headers and extra_body, the json_schema fallback, the stream merge by id, extra_content), as a
hostile peer would. Each test fails on the branch it was written against; nothing is mocked:
a real http.server on 127.0.0.1 (tests/fake_openai.py), real files, the CLI as a subprocess.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

import bob
from bob import (AgentRequest, AgentRuntime, FunctionTools, JsonFileSessionStore, JsonlEventSink,
                 LlmError)
from conftest import KEY, final, make_llm
from fake_openai import FakeOpenAI, chunk, tool_calls_reply

SECRET = "hunter2-SECRET-9f8e"


def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


def record(tmp_path: Path, replies, mode: str = "native", **kw) -> Path:
    """A real run against a fake server, recorded to a trace; the trace's path."""
    path = tmp_path / "t.jsonl"
    with FakeOpenAI(replies) as srv:
        sink = JsonlEventSink(path)
        rt = AgentRuntime(make_llm(srv, **kw), FunctionTools([add]), events=sink,
                          action_mode=mode)
        rt.run(AgentRequest("add 1 and 2", "s1"))
        sink.close()
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def write(path: Path, events: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def replay_within(trace, seconds: float):
    """bob.replay(trace) on a thread: ("ok", report), ("raised", exc) or ("hung", None)."""
    out: list = []

    def go() -> None:
        try:
            out.append(("ok", bob.replay(trace)))
        except BaseException as e:  # noqa: BLE001 - the test shows what came out
            out.append(("raised", e))
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    return out[0] if out else ("hung", None)


TWO_STEPS = [tool_calls_reply([("add", {"a": 1, "b": 2})]), "3"]


# ---- 1. Replay of an edited trace -----------------------------------------------------------

def test_replay_of_a_trace_cut_after_a_request_does_not_wait_out_the_recorded_deadline(tmp_path):
    # Delete everything from the first llm_call_completed up to turn_completed: the recorded
    # request has no reply and the turn "ended" right after it. The trace says so; replay must
    # say TraceError (or a divergence) at once, not sleep on the recorded turn_timeout_ms.
    events = lines(record(tmp_path, TWO_STEPS))
    i = next(n for n, e in enumerate(events) if e["kind"] == "llm_call_started")
    end = next(n for n, e in enumerate(events) if e["kind"] == "turn_completed")
    start = next(e for e in events if e["kind"] == "turn_started")
    start["data"]["policy"]["turn_timeout_ms"] = 600_000
    trace = write(tmp_path / "cut.jsonl", events[:i + 1] + events[end:])
    t0 = time.monotonic()
    how, value = replay_within(trace, 8.0)
    assert how != "hung", "replay still waiting after 8 s (the recorded deadline is 600 s)"
    assert time.monotonic() - t0 < 5, time.monotonic() - t0


@pytest.mark.parametrize("field,value", [
    ("content", 123), ("content", ["a", "b"]), ("tool_calls", [{"id": 1, "name": 2,
                                                               "arguments": "x"}]),
    ("finish_reason", {"x": 1})])
def test_a_recorded_reply_of_the_wrong_type_is_a_trace_error_naming_the_line(tmp_path, field,
                                                                            value):
    events = lines(record(tmp_path, TWO_STEPS))
    n = next(n for n, e in enumerate(events) if e["kind"] == "llm_call_completed")
    events[n]["data"][field] = value
    trace = write(tmp_path / "bad.jsonl", events)
    how, value_ = replay_within(trace, 10.0)
    assert how == "raised" and isinstance(value_, bob.TraceError), (how, value_)
    assert f"line {n + 1}" in str(value_), str(value_)


def test_a_non_utf8_trace_is_a_trace_error_naming_the_line(tmp_path):
    path = record(tmp_path, TWO_STEPS)
    raw = path.read_bytes().splitlines(keepends=True)
    raw[3] = raw[3].replace(b'"kind"', b'"k\xff\xfeind"')
    path.write_bytes(b"".join(raw))
    how, value = replay_within(path, 10.0)
    assert how == "raised" and isinstance(value, bob.TraceError), (how, value)
    assert "line 4" in str(value), str(value)


# ---- 2. Helpers -----------------------------------------------------------------------------

def _deep(n: int):
    v: object = "sig"
    for _ in range(n):
        v = {"a": v}
    return v


# ---- 3. extra_body and headers ---------------------------------------------------------------

@pytest.mark.parametrize("extra,field", [({"response_format": {"type": "json_object"}},
                                          "response_format"),
                                         ({"stream_options": {"include_usage": True}},
                                          "stream_options")])
def test_a_refused_field_the_user_put_in_extra_body_is_not_sent_again_forever(extra, field):
    # The server refuses the field with 400 (as LM Studio refuses json_object). bob marks it
    # refused, "costs no retry", and tries again at once, but extra_body puts it back: the same
    # request again and again, no backoff, until timeout_s.
    with FakeOpenAI() as srv:
        srv.push(*[{"status": 400, "body": {"error": {"message": f"'{field}' is not supported"}}}
                   ] * 5000)
        llm = make_llm(srv, timeout_s=2.0, retry_max=2, extra_body=extra)
        req = bob.LlmRequest([bob.Message("user", "hi")], [], "json", None)
        with pytest.raises(LlmError):
            llm.complete(req, bob.CancelToken())
        assert len(srv.requests) <= 6, f"{len(srv.requests)} requests for one call"


def test_a_secret_in_extra_body_echoed_by_a_422_is_not_shown(tmp_path):
    # A gateway key in the body (extra_body={"api_key": ...}); the server's validation error
    # quotes the input (FastAPI/vLLM 422 do). Header secrets are masked in errors; this one
    # reaches the LlmError, the CLI's output and the trace.
    body422 = {"detail": [{"type": "extra_forbidden", "loc": ["body", "api_key"],
                           "msg": "Extra inputs are not permitted", "input": SECRET}]}
    path = tmp_path / "t.jsonl"
    with FakeOpenAI([{"status": 422, "body": body422}]) as srv:
        sink = JsonlEventSink(path)
        rt = AgentRuntime(make_llm(srv, extra_body={"api_key": SECRET}), events=sink)
        with pytest.raises(LlmError) as info:
            rt.run(AgentRequest("hi"))
        sink.close()
    assert SECRET not in str(info.value)
    assert SECRET not in path.read_text()


def test_a_header_value_outside_latin1_is_a_config_error_not_an_internal_error():
    # OpenRouter's X-Title is an app's name: "Café ☕" is printable, so the check passes, and
    # every call then fails inside http.client (UnicodeEncodeError), an internal error.
    with FakeOpenAI(["hi"]) as srv:
        try:
            llm = make_llm(srv, headers={"X-Title": "Café ☕"})
        except bob.ConfigError:
            return
        rt = AgentRuntime(llm)
        try:
            rt.run(AgentRequest("hi"))
        except bob.BobError as e:
            assert "internal" not in str(e) and "UnicodeEncodeError" not in str(e), str(e)
            assert isinstance(e, (bob.ConfigError, LlmError)), repr(e)


@pytest.mark.parametrize("headers", [{"X Bad Name": "v"}, {"X-A\r\nX-Injected": "v"},
                                     {"api-key": " " + SECRET}, {7: "v"},
                                     {"Content-Length": "999999"}])
def test_a_header_that_cannot_be_sent_is_a_config_error_when_given(headers):
    # bob checks only that values are printable strings: names are not checked at all, and a
    # value with a leading space is refused by requests on every call (retried as a
    # "transport error ... InvalidHeader", the retries spent, nothing saying which header).
    with FakeOpenAI(["hi"] * 5) as srv:
        with pytest.raises(bob.ConfigError):
            make_llm(srv, headers=headers)


# ---- 4. The stream merge by id ----------------------------------------------------------------

def test_a_streamed_call_whose_id_comes_back_after_another_is_not_duplicated():
    # Two calls at index 0 with ids a and b; a's last argument piece arrives after b's (with
    # its id again). bob starts a *third* call for a, with arguments that are half an object.
    pieces = [chunk(role="assistant", content=""),
              chunk(tool_calls=[{"index": 0, "id": "a", "type": "function",
                                 "function": {"name": "add", "arguments": '{"a": 1, '}}]),
              chunk(tool_calls=[{"index": 0, "id": "b", "type": "function",
                                 "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]),
              chunk(tool_calls=[{"index": 0, "id": "a", "function": {"arguments": '"b": 2}'}}]),
              chunk(finish_reason="tool_calls")]
    with FakeOpenAI([{"stream": pieces}]) as srv:
        reply = make_llm(srv, stream=True).complete(
            bob.LlmRequest([bob.Message("user", "x")], [], None, None), bob.CancelToken())
    assert [(c.id, c.arguments, c.error) for c in reply.tool_calls] == [
        ("a", {"a": 1, "b": 2}, None), ("b", {"a": 2, "b": 2}, None)]


# ---- 5. The CLI's config: ${VAR} forms and [llm] headers -------------------------------------

from conftest import run_cli, write_config, xdg_env  # noqa: E402


@pytest.mark.parametrize("value", ["${BOB_UNSET_VAR-fallback}", "${BOB_UNSET_VAR:-${BOB_SET_VAR}}",
                                   "${BOB_UNSET_VAR:=x}", "${BOB_SET_VAR:?x}"])
def test_a_shell_form_bob_does_not_expand_is_never_sent_literally(tmp_path, value):
    # issue 22: "Support the shell default form or refuse it as a config error; never send the
    # literal." ${VAR-default} (no colon), a nested default, $VAR, := and :? all reach the
    # server as the literal text.
    with FakeOpenAI([final("ok")] * 3) as srv:
        cfg = write_config(tmp_path, srv, extra=f'headers = {{ X-Title = "{value}" }}\n')
        env = xdg_env(tmp_path, BOB_SET_VAR="set-value")
        proc = run_cli(tmp_path, "--config", str(cfg), "-p", "hi", env=env)
        sent = [r["headers"].get("x-title") for r in srv.requests]
    if proc.returncode == 2:
        return   # refused as a config error: fine
    assert not any(s and ("$" in s or "{" in s) for s in sent), (sent, proc.stderr[-300:])


def test_an_empty_shell_default_is_the_empty_string_as_in_sh(tmp_path):
    # ${VAR:-} is sh for "empty when unset"; bob calls VAR "not set" and refuses the file.
    with FakeOpenAI([final("ok")] * 3) as srv:
        cfg = write_config(tmp_path, srv, extra='headers = { X-Title = "app${BOB_UNSET_VAR:-}" }\n')
        proc = run_cli(tmp_path, "--config", str(cfg), "-p", "hi", env=xdg_env(tmp_path))
        assert proc.returncode == 0, proc.stderr[-400:]
        assert srv.requests[0]["headers"].get("x-title") == "app"


@pytest.mark.parametrize("name", ["X Bad", "X-Ümlaut", "X:Colon"])
def test_an_llm_header_name_that_cannot_be_sent_is_exit_2_naming_the_key(tmp_path, name):
    # [[mcp.servers]] headers names are checked when the config is read; [llm] headers are not:
    # every request then fails as a "transport error ... InvalidHeader" (exit 1, retries spent).
    with FakeOpenAI([final("ok")] * 3) as srv:
        cfg = write_config(tmp_path, srv, extra=f'headers = {{ "{name}" = "v" }}\n')
        proc = run_cli(tmp_path, "--config", str(cfg), "-p", "hi", env=xdg_env(tmp_path))
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-400:])
    assert "headers" in proc.stderr and "agent.toml" in proc.stderr, proc.stderr[-400:]


# ---- 6. MCP: a server's secret where the masking does not look ---------------------------------

LEAKY_SERVER = r'''
import json, os, sys
SECRET = os.environ["API_KEY"]
TOOLS = [{"name": "get_" + SECRET, "description": "A tool.", "inputSchema": {"type": "object"}},
         {"name": "lookup", "description": "Look up.", "inputSchema": {"type": "object",
          "properties": {SECRET: {"type": "string"}}}}]
for line in sys.stdin:
    msg = json.loads(line)
    method, mid = msg.get("method"), msg.get("id")
    if mid is None:
        continue
    if method == "initialize":
        result = {"protocolVersion": msg["params"]["protocolVersion"], "capabilities":
                  {"tools": {}}, "serverInfo": {"name": "leaky", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": TOOLS}
    elif method == "tools/call":
        result = {"content": [{"type": "text", "text": "done"}]}
    else:
        result = {}
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": mid, "result": result}) + "\n")
    sys.stdout.flush()
'''

MCP_SECRET = "Zq81k3yVALUE"


def test_an_mcp_secret_in_a_tool_name_or_a_schema_key_reaches_neither_model_nor_trace(tmp_path):
    # README: any text from the server that quotes a secret env value is masked, "the tool list
    # too". Descriptions and schema *values* are; tool names and schema property *names* are not.
    import sys
    from bob_mcp import McpServerConfig, McpToolPort
    script = tmp_path / "leaky.py"
    script.write_text(LEAKY_SERVER)
    path = tmp_path / "t.jsonl"
    cfg = McpServerConfig("s", command=sys.executable, args=(str(script),),
                          env={"API_KEY": MCP_SECRET})
    with FakeOpenAI(["ok"]) as srv, McpToolPort([cfg]) as port:
        sink = JsonlEventSink(path)
        AgentRuntime(make_llm(srv), port, events=sink, action_mode="native").run(
            AgentRequest("hi"))
        sink.close()
        sent = json.dumps(srv.requests[0]["body"])
    assert MCP_SECRET not in sent, "the secret was sent to the model"
    assert MCP_SECRET not in path.read_text(), "the secret is in the trace"


def test_the_token_of_a_bearer_header_echoed_alone_by_a_401_is_masked(tmp_path):
    # A gateway's auth header given as headers={"Authorization": "Bearer <token>"} (README's
    # example for MCP). The server's 401 quotes the token alone, as most do. bob.py masks a
    # secret header's value only whole ("Bearer <token>"); bob_mcp masks its long words too.
    path = tmp_path / "t.jsonl"
    body = {"error": {"message": f"invalid token {SECRET}", "type": "authentication_error"}}
    with FakeOpenAI([{"status": 401, "body": body}]) as srv:
        sink = JsonlEventSink(path)
        llm = bob.OpenAICompatLlm("test:gpt-x", base_url=srv.url,
                                  headers={"Authorization": f"Bearer {SECRET}"})
        with pytest.raises(LlmError) as info:
            AgentRuntime(llm, events=sink).run(AgentRequest("hi"))
        sink.close()
    assert SECRET not in str(info.value), str(info.value)
    assert SECRET not in path.read_text()


# ---- 7. `bob replay TRACE` on what is not a trace file ----------------------------------------

def _replay_cli(tmp_path: Path, trace: str, timeout: float = 10.0):
    """The CLI's replay on `trace`, with 1 GB of address space: (returncode or "hung", stderr)."""
    import resource
    import subprocess
    import sys
    from conftest import CLI, child_env

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    try:
        proc = subprocess.run([sys.executable, str(CLI), "replay", trace], cwd=tmp_path,
                              env=child_env(tmp_path), capture_output=True, text=True,
                              timeout=timeout, preexec_fn=limit, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "hung", ""
    return proc.returncode, proc.stderr


def test_replay_of_a_fifo_nobody_writes_is_an_error_not_a_hang(tmp_path):
    # Sessions are opened with O_NONBLOCK ("a FIFO is an OSError, not a hang"); a trace is not.
    import os
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    code, err = _replay_cli(tmp_path, str(fifo), timeout=8.0)
    assert code == 2, (code, err[-300:])


def test_replay_of_an_endless_file_is_a_trace_error_not_a_crash(tmp_path):
    # /dev/zero (or a trace still being written by a runaway loop): read whole, then MemoryError
    # with a traceback; the CLI promises exit 2 and one line for an unreadable trace.
    code, err = _replay_cli(tmp_path, "/dev/zero", timeout=20.0)
    assert code == 2 and "Traceback" not in err, (code, err[-300:])


def test_trace_to_a_fifo_nobody_reads_does_not_hang_the_cli(tmp_path):
    # JsonlEventSink opens with O_NONBLOCK (issue 21: "a FIFO nobody reads blocks the turn");
    # the CLI's _owner_only() opens --trace first, blocking, before any turn or deadline.
    import os
    import subprocess
    fifo = tmp_path / "t.jsonl"
    os.mkfifo(fifo)
    with FakeOpenAI([final("ok")] * 3) as srv:
        cfg = write_config(tmp_path, srv)
        try:
            proc = run_cli(tmp_path, "--config", str(cfg), "--trace", str(fifo), "-p", "hi",
                           env=xdg_env(tmp_path))
        except subprocess.TimeoutExpired:
            pytest.fail("bob --trace FIFO -p hi still running after 15 s")
    assert proc.returncode in (0, 2), proc.stderr[-300:]


def test_a_too_deep_extra_body_is_a_config_error_not_a_recursion_error():
    # _set_extras catches TypeError and ValueError from json.dumps; RecursionError escapes raw.
    with pytest.raises(bob.ConfigError):
        bob.OpenAICompatLlm("test:m", base_url="http://127.0.0.1:9/v1", api_key=KEY,
                            extra_body={"x": _deep(5000)})


# ---- 8. What an LlmPort attaches (extra, reasoning): refused where it enters, or it loads ----

def _reply_with(**kw) -> bob.LlmResponse:
    extra = kw.pop("extra", None)
    return bob.LlmResponse("", (bob.ToolCall("c1", "add", {"a": 1, "b": 2}, extra=extra),), **kw)


@pytest.mark.parametrize("label,reply", [
    ("reasoning 123", _reply_with(reasoning=123)),
    ("extra a list", _reply_with(extra=["x"])),
    ("extra bytes", _reply_with(extra={"thought_signature": b"\x00\xff"})),
    ("extra too deep", _reply_with(extra={"s": _deep(990)}))])
def test_what_a_port_attaches_to_a_reply_is_refused_where_it_enters_or_saved_and_loaded(
        tmp_path, label, reply):
    # Issue 21: "What bob saves always loads; bad values are refused where they enter." The
    # arguments are checked (_fit); a call's `extra` and the reply's `reasoning` (issue 24) are
    # not: a list or an int is saved and the session is "corrupt" for ever after; bytes or a
    # deep value fail the save, and the turn (the tool that ran, the user's message) is lost.
    ran: list[int] = []

    def add(a: int, b: int) -> str:
        """Add two integers."""
        ran.append(a + b)
        return str(a + b)
    store = JsonFileSessionStore(tmp_path / "s")
    rt = AgentRuntime(bob.ScriptedLlm([reply, bob.LlmResponse("done")]), FunctionTools([add]),
                      store=store, action_mode="native")
    try:
        rt.run(AgentRequest("add", "s"))
    except bob.StoreError as e:
        pytest.fail(f"{label}: the turn was not saved ({e}); the tool ran {len(ran)} time(s)")
    except bob.BobError:
        pass   # refused where it entered
    store.load("s")   # a StoreError here: the session is lost for good



def test_session_files_are_owner_only_in_an_existing_store_directory(tmp_path):
    # issue 22: "Sessions, traces bob creates and the history file are owner-only." The CLI
    # makes a *new* sessions directory 0700; in an existing one ([store] path = a project dir,
    # or the directory an older bob made 0755) each session file is 0644 (0o666 & ~umask).
    import os
    import stat
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    with FakeOpenAI([final("ok")] * 3) as srv:
        cfg = write_config(tmp_path, srv, extra=f'\n[store]\npath = "{shared}"\n')
        proc = run_cli(tmp_path, "--config", str(cfg), "-p", "hi", env=xdg_env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-300:]
    files = list(shared.glob("*.json"))
    assert files, list(shared.iterdir())
    modes = {f.name: oct(stat.S_IMODE(os.stat(f).st_mode)) for f in files}
    assert all(m == "0o600" for m in modes.values()), modes


@pytest.mark.parametrize("events", [[{"kind": "turn_started"}], [["not", "an", "event"]],
                                    [{"kind": "turn_started", "data": None}]])
def test_replay_of_a_list_of_bad_events_is_a_trace_error(events):
    # read_trace checks each line of a file (a dict with a "kind" and a "data" object); a list
    # of events given from Python is taken as it is, and _turns() raises KeyError or TypeError.
    with pytest.raises(bob.TraceError):
        bob.replay(events)


# ---- 9. json mode's action schema ----------------------------------------------------------------

class _PydanticStyleTools:
    """A ToolPort whose tool takes a nested model, its schema as pydantic (FastMCP) writes it:
    the model under $defs, referred to by "#/$defs/Point"."""

    def list_tools(self) -> list[bob.ToolDescriptor]:
        return [bob.ToolDescriptor("place", "Place a point.", {
            "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"],
            "$defs": {"Point": {"type": "object", "required": ["x"],
                                "properties": {"x": {"type": "integer"}}}}})]

    def call_tool(self, call, timeout_s, cancel=None) -> bob.ToolResult:
        return bob.ToolResult(call.id, call.name, "placed")


def test_the_json_schema_sent_resolves_a_tool_schemas_local_refs():
    # action_schema() embeds each tool's input schema under anyOf/properties/arguments, so its
    # "#/$defs/Point" now points at the action schema's root, where there is no $defs: the
    # schema bob sends cannot be resolved (a constraining server refuses it or cannot apply it),
    # and a valid call of the tool does not validate against it.
    jsonschema = pytest.importorskip("jsonschema")   # a dependency of mcp
    with FakeOpenAI([final("ok")]) as srv:
        AgentRuntime(make_llm(srv), _PydanticStyleTools(), action_mode="json").run(
            AgentRequest("place"))
        schema = srv.requests[0]["body"]["response_format"]["json_schema"]["schema"]
    action = {"type": "tool_call", "name": "place", "arguments": {"p": {"x": 1}}}
    jsonschema.validate(action, schema)
