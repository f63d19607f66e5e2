"""Tests of bob_mcp against real MCP servers (tests/mcp_server.py) over stdio and streamable HTTP.

One port with three servers (a, b over stdio; h over HTTP) is shared by the tests that leave it
usable; tests that break servers start their own. Every server carries a marker argument, so
the tests can look for leftover processes in /proc.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

import bob
from conftest import marked_pids, wait_until
from bob import ConfigError, ToolCall
from bob_mcp import McpError, McpServerConfig, McpToolPort, exposed_name

SERVER = str(Path(__file__).with_name("mcp_server.py"))
RAW = str(Path(__file__).with_name("mcp_raw_server.py"))   # for a test where any server will do
MARKER = f"bob-mcp-test-{uuid.uuid4().hex[:8]}"
LONG = "t" * 70                                  # a tool name too long to expose as is
ROOTS = (str(Path(__file__).parent), str(Path(__file__).parent.parent))  # b's roots


def stdio(server_id: str, *flags: str, marker: str = MARKER, **kw) -> McpServerConfig:
    """A config running tests/mcp_server.py over stdio."""
    return McpServerConfig(server_id, command=sys.executable,
                           args=(SERVER, "--marker", marker, *flags), **kw)


def raw_with_child(server_id: str, marker: str) -> McpServerConfig:
    """The hand-written server (it starts in milliseconds; tests/mcp_server.py imports the SDK:
    a second and a half of CPU) with a grandchild, both carrying `marker`, for tests of the
    port's lifecycle, where any server will do."""
    return McpServerConfig(server_id, command=sys.executable,
                           args=(RAW, "child", "lifecycle", marker), env={"MARKER": marker})


def call(port: McpToolPort, tool: str, timeout_s: float = 5.0, **arguments) -> bob.ToolResult:
    return port.call_tool(ToolCall("c1", tool, arguments), timeout_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- fixtures ----

@pytest.fixture(scope="module")
def http_url():
    """tests/mcp_server.py over streamable HTTP on a free loopback port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "--http", str(port), "--marker", MARKER],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ready() -> bool:
        with socket.socket() as s:
            return proc.poll() is None and s.connect_ex(("127.0.0.1", port)) == 0

    assert wait_until(ready, timeout=15), "the HTTP MCP server did not come up"
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(timeout=5)


@pytest.fixture(scope="module")
def port(http_url):
    """Servers a and b (stdio, same tools) and h (HTTP), started once for the module."""
    servers = [stdio("a", "--extra", "odd.name/with space", "--extra", LONG, tool_timeout_ms=300),
               # a header of the env key's name (meaningless to stdio, as a config copied
               # from an HTTP server's may have): the env value stays masked too
               stdio("b", env={"BOB_TEST_TOKEN": "from config"},
                     headers={"BOB_TEST_TOKEN": "another value"}, roots=ROOTS),
               McpServerConfig("h", "streamable_http", url=http_url,
                               headers={"X-Key": "s3cret-header-value"})]
    with McpToolPort(servers) as p:
        yield p


# ---- configuration and names (no servers) ----

@pytest.mark.parametrize("kwargs, words", [
    (dict(id="bad id", command="x"), ["'bad id'", "id"]),
    (dict(id="s", transport="sse", command="x"), ["'s'", "transport", "sse"]),
    (dict(id="s"), ["'s'", "command"]),
    (dict(id="s", transport="streamable_http"), ["'s'", "url"]),
    (dict(id="s", command="x", tool_timeout_ms=0), ["'s'", "tool_timeout_ms"]),
])
def test_bad_config_is_a_config_error_naming_server_and_field(kwargs, words):
    with pytest.raises(ConfigError) as err:
        McpServerConfig(**kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_secrets_stay_out_of_repr_and_errors_and_duplicate_ids_are_refused():
    cfg = McpServerConfig("s", command="x", env={"TOKEN": "s3cret"}, headers={"A": "s3cret"})
    assert "s3cret" not in repr(cfg)
    with pytest.raises(ConfigError) as err:
        McpServerConfig("s", command="x", env={"TOKEN": 12345})
    assert "env" in str(err.value) and "12345" not in str(err.value)
    with pytest.raises(ConfigError, match="'s' is used twice"):
        McpToolPort([cfg, cfg])


def test_exposed_names_are_provider_safe_and_deterministic():
    assert exposed_name("fs", "read_file") == "fs__read_file"
    assert exposed_name("fs", "a.b/c d") == "fs__a_b_c_d"
    long_a, long_b = exposed_name("srv", LONG), exposed_name("srv", LONG + "x")
    assert len(long_a) == 64 and long_a == exposed_name("srv", LONG) and long_a != long_b
    assert all(c.isalnum() or c in "_-" for c in long_a)


def test_import_loads_no_sdk_and_a_start_without_it_says_how_to_install():
    code = ("import sys; import bob_mcp; assert 'mcp' not in sys.modules, 'mcp imported'\n"
            "sys.modules['mcp'] = None\n"                     # None: import mcp fails
            "bob_mcp.McpToolPort([bob_mcp.McpServerConfig('a', command='x')]).start()")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "McpError" in out.stderr, out.stderr
    assert "pip install mcp" in out.stderr and "mcp imported" not in out.stderr


def test_calls_before_start_say_how_to_fix():
    with pytest.raises(McpError, match=r"call start\(\)"):
        McpToolPort([stdio("z")]).list_tools()


# ---- the shared port ----

def test_lists_every_servers_tools_under_distinct_names(port):
    names = [t.name for t in port.list_tools()]
    for server_id in "abh":
        assert {f"{server_id}__echo", f"{server_id}__slow"} <= set(names)
    assert len(names) == len(set(names))
    sources = port.tool_sources()
    assert sources["a__echo"] == "a" and sources["b__echo"] == "b" and sources["h__echo"] == "h"
    echo = next(t for t in port.list_tools() if t.name == "a__echo")
    assert echo.description and echo.input_schema["properties"]["text"]


def test_same_tool_on_two_servers_reaches_each_server(port):
    pid_a, pid_b = call(port, "a__pid").content, call(port, "b__pid").content
    assert pid_a.isdigit() and pid_b.isdigit() and pid_a != pid_b


@pytest.mark.parametrize("server_id", ["a", "h"])
def test_call_over_stdio_and_http(port, server_id):
    name = f"{server_id}__echo"
    r = call(port, name, text="hello")
    assert (r.content, r.is_error, r.name, r.call_id) == ("hello", False, name, "c1")
    r = call(port, f"{server_id}__structured", n=4)
    assert json.loads(r.content) == {"n": 4, "square": 16} and not r.is_error
    r = call(port, f"{server_id}__picture")
    assert r.content == "a picture\n[image: image/png, 100 bytes]"
    r = call(port, f"{server_id}__fail", message="no such file")
    assert r.is_error and "no such file" in r.content


def test_env_and_headers_reach_the_servers_and_come_back_masked(port):
    # The servers echo the exact values; they are secrets, so the model sees them masked.
    assert call(port, "b__env", name="BOB_TEST_TOKEN").content == "***"
    assert call(port, "b__env", name="PATH").content != "(unset)"   # the SDK's safe base env
    assert call(port, "h__header", name="X-Key").content == "***"
    assert call(port, "a__env", name="BOB_TEST_TOKEN").content == "(unset)"  # b's env only


@pytest.mark.parametrize("code", [-32000, -32001, -32002])
def test_a_server_error_code_the_sdk_also_uses_is_just_an_error_result(port, code):
    r = call(port, "a__rpc_error", code=code)
    assert r.is_error and f"server-side problem (code {code})" in r.content
    assert call(port, "a__echo", text="still up").content == "still up"


def test_secrets_quoted_in_errors_and_stderr_are_masked(port, caplog):
    r = call(port, "b__fail", message="upstream refused token from config")
    assert r.is_error and "from config" not in r.content and "***" in r.content
    with caplog.at_level(logging.INFO, logger="bob.mcp"):
        assert call(port, "b__shout", text="using token from config").content == "ok"
        assert wait_until(lambda: "[b] using token ***" in caplog.text)
    assert "from config" not in caplog.text


def test_odd_and_long_tool_names_map_back_exactly(port):
    names = {t.name for t in port.list_tools()}
    assert "a__odd_name_with_space" in names
    assert call(port, "a__odd_name_with_space").content == "I am odd.name/with space"
    long_name = exposed_name("a", LONG)
    assert long_name in names and call(port, long_name).content == f"I am {LONG}"


def test_unknown_tool_is_an_error_result(port):
    r = call(port, "a__nope")
    assert r.is_error and "unknown tool" in r.content


def test_timeout_is_an_error_result_and_the_port_stays_usable(port):
    t0 = time.monotonic()
    r = call(port, "a__slow", seconds=5)            # server a allows 300 ms
    assert r.is_error and "timed out after 300 ms" in r.content
    assert time.monotonic() - t0 < 1.5
    r = call(port, "b__slow", timeout_s=0.2, seconds=5)   # the runtime's limit is shorter
    assert r.is_error and "timed out after 200 ms" in r.content
    assert call(port, "a__echo", text="still here").content == "still here"


@pytest.mark.parametrize("server_id", ["a", "h"])
def test_roots_and_sampling_are_declined_without_config(port, server_id):
    r = call(port, f"{server_id}__roots")   # a filesystem server then keeps its command-line dirs
    assert r.is_error and "not supported" in r.content and os.getcwd() not in r.content, r
    r = call(port, f"{server_id}__sample")
    assert not r.is_error and r.content.startswith("declined")


def test_configured_roots_are_answered(port):
    assert call(port, "b__roots").content == "\n".join(Path(r).as_uri() for r in ROOTS)


def test_a_control_character_in_a_header_is_refused_without_showing_it():
    with pytest.raises(ConfigError, match="control or non-ASCII character") as err:
        McpServerConfig("h", "streamable_http", url="http://x/mcp",
                        headers={"Authorization": "Bearer TOPSECRET-123\r"})
    assert "TOPSECRET" not in str(err.value)


def test_list_changed_refreshes_tools_before_the_next_turn(port):
    name = f"new_{uuid.uuid4().hex[:6]}"
    assert call(port, "a__grow", name=name).content == "added"
    assert wait_until(lambda: f"a__{name}" in {t.name for t in port.list_tools()})
    assert call(port, f"a__{name}").content == f"{name} works"


class _Events:
    def __init__(self):
        self.events = []

    def emit(self, event):
        self.events.append(event)


def test_a_full_agent_turn_through_the_runtime(port):
    llm = bob.ScriptedLlm([
        '{"type":"tool_call","name":"b__echo","arguments":{"text":"from mcp"}}',
        '{"type":"final","content":"done"}',
    ])
    sink = _Events()
    result = bob.AgentRuntime(llm, port, events=sink).run(bob.AgentRequest("echo it"))
    assert result.finish_reason == bob.FinishReason.FINAL and result.content == "done"
    tool_messages = [m for m in result.history if m.role == "tool"]
    assert [(m.name, m.content, m.is_error) for m in tool_messages] == [
        ("b__echo", "from mcp", False)]
    assert "b__echo" in llm.requests[0].messages[0].content   # the tool block names it
    done = [e.data for e in sink.events if e.kind == "tool_call_completed"]
    assert done and done[0]["is_error"] is False


# ---- servers that fail ----

@pytest.mark.parametrize("cfg, words", [
    (McpServerConfig("gone", command="bob-no-such-command-xyz"),
     ["'gone'", "FileNotFoundError", "bob-no-such-command-xyz"]),
    (stdio("crash", "--fail", marker=MARKER + "-fail"),
     ["'crash'", "exited (code 3)", "cannot open database"]),
    (stdio("mute", "--hang", marker=MARKER + "-fail", startup_timeout_ms=300),
     ["'mute'", "handshake within 300 ms", "hanging on purpose"]),
])
def test_startup_failure_names_server_cause_and_stderr(cfg, words):
    threads_before, t0 = set(threading.enumerate()), time.monotonic()
    with pytest.raises(McpError) as err:
        McpToolPort([cfg]).start()
    assert all(w in str(err.value) for w in words), str(err.value)
    assert time.monotonic() - t0 < 3.0
    assert wait_until(lambda: not marked_pids(MARKER + "-fail"))
    assert wait_until(lambda: set(threading.enumerate()) <= threads_before)   # port closed


def test_name_clash_at_start_names_both_servers_and_tools(port, http_url, caplog):
    # Server "h" gets a tool "x__echo" (exposed as h__x__echo); a server with id "h__x" exposes
    # its "echo" under the same name. Both connect to the already running HTTP server. The
    # first keeps the name; the warning names both and the fix (issue 22: it was fatal).
    assert call(port, "h__grow", name="x__echo").content == "added"
    servers = [McpServerConfig(i, "streamable_http", url=http_url) for i in ("h", "h__x")]
    with caplog.at_level(logging.WARNING, logger="bob.mcp"), McpToolPort(servers) as both:
        assert both.tool_sources()["h__x__echo"] == "h"
    text = caplog.text
    assert all(w in text for w in ["'h'", "'x__echo'", "'h__x'", "'echo'", "h__x__echo",
                                   "rename a server id"]), text


def test_lifecycle_optional_skip_death_restart_and_clean_close(caplog, capfd):
    marker = MARKER + "-life"
    threads_before = set(threading.enumerate())
    servers = [stdio("opt", "--fail", marker=marker, required=False),   # fails before the SDK
               raw_with_child("k", marker)]
    caplog.set_level(logging.DEBUG, logger="bob.mcp")
    port = McpToolPort(servers).start(wait=False)        # the first call waits for startup
    names = [t.name for t in port.list_tools()]
    assert "k__echo" in names and not any(n.startswith("opt__") for n in names)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'opt'" in w and "cannot open database" in w for w in warnings), warnings
    assert len(marked_pids(marker)) == 2                  # server k and its grandchild

    r = call(port, "k__die", code=7)
    assert r.is_error and r.content.startswith("executor unavailable: server k exited (code 7)")
    assert "dying with code 7" in r.content
    assert call(port, "k__echo", text="x").is_error      # the rest of this turn: still down
    assert "[k] raw server: dying with code 7" in caplog.text   # server stderr: in the log,
    assert "dying with code 7" not in capfd.readouterr().err     # not on the terminal

    assert "k__echo" in [t.name for t in port.list_tools()]   # next turn: restarted once
    assert call(port, "k__echo", text="back").content == "back"

    port.close()
    port.close()                                          # idempotent
    assert wait_until(lambda: not marked_pids(marker)), marked_pids(marker)
    assert wait_until(lambda: set(threading.enumerate()) <= threads_before)
    with pytest.raises(McpError, match="closed"):
        port.list_tools()


def test_servers_die_with_bob_after_ctrl_c():
    # The hand-written server, with a grandchild (this bob process imports the SDK: a second of
    # CPU; tests/mcp_server.py would be another).
    marker = MARKER + "-exit"
    script = textwrap.dedent(f"""
        import signal, sys, time
        signal.signal(signal.SIGINT, signal.default_int_handler)   # even if started ignoring it
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from bob_mcp import McpServerConfig, McpToolPort
        cfg = McpServerConfig("s", command=sys.executable, env={{"MARKER": {marker!r}}},
                              args=({RAW!r}, "child", {marker!r}))
        McpToolPort([cfg]).start()
        print("ready", flush=True)
        time.sleep(30)
    """)
    bob_proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        assert bob_proc.stdout.readline().strip() == "ready"
        assert len(set(marked_pids(marker)) - {bob_proc.pid}) == 2   # server and grandchild
        bob_proc.send_signal(signal.SIGINT)
        bob_proc.wait(timeout=10)
        assert "KeyboardInterrupt" in bob_proc.stderr.read()
        assert wait_until(lambda: not marked_pids(marker)), marked_pids(marker)
    finally:
        bob_proc.kill()


def test_a_second_close_waits_until_the_servers_are_gone():
    marker = MARKER + "-close2"
    port = McpToolPort([raw_with_child("c", marker)]).start()
    server_pid = int(call(port, "c__pid").content)
    other = threading.Thread(target=port.close)       # the first close() ...
    other.start()
    assert wait_until(lambda: port._closed)          # ... is under way (a peek, to sync only)
    port.close()           # the second returns only once the first has stopped the server
    assert not Path(f"/proc/{server_pid}").exists()          # stopped and reaped
    assert wait_until(lambda: marked_pids(marker) == [])     # its killed grandchild too
    other.join(10)


def test_a_failed_start_raises_at_once_and_leaves_nothing():
    marker = MARKER + "-failstart"
    port = McpToolPort([stdio("ok", "--child", marker=marker), stdio("bad", "--fail")])
    with pytest.raises(McpError, match="(?s)'bad' failed to start.*cannot open database"):
        port.start()
    port.close()           # waits for the close that the failure started in the background
    assert wait_until(lambda: marked_pids(marker) == [])

