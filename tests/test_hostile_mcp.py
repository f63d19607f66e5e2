"""bob_mcp against a misbehaving MCP server (tests/mcp_hostile_server.py), each promise of
issue 11 through a real server process: garbage and bad bytes on stdout, secrets, cancel,
setsid grandchildren; garbage lines at startup and the setsid grandchild through the
hand-written tests/mcp_raw_server.py (it starts in milliseconds); roots: tests/test_mcp.py."""
from __future__ import annotations

import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

import bob
from conftest import Together, marked_pids, wait_until
from bob import ToolCall
import bob_mcp
from bob_mcp import McpServerConfig, McpToolPort

HOSTILE = str(Path(__file__).with_name("mcp_hostile_server.py"))
RAW = str(Path(__file__).with_name("mcp_raw_server.py"))   # banner, setsid-crash modes
SECRET = "k3y"   # short: masked because of its key's name, not its length


def hostile(*flags: str, **kw) -> McpServerConfig:
    """A config running the hostile server over stdio, with API_KEY set."""
    kw.setdefault("env", {"API_KEY": SECRET})
    return McpServerConfig("h", command=sys.executable, args=(HOSTILE, *flags), **kw)


def call(port: McpToolPort, tool: str, timeout_s: float = 10.0, **arguments) -> bob.ToolResult:
    return port.call_tool(ToolCall("c1", tool, arguments), timeout_s)


def bob_command(flags: list[str], level: str, tool: str = "noise") -> list[str]:
    """A real bob process: the hand-written server started in these modes (it starts in ms; bob
    imports the MCP SDK, a second of CPU), one tool called twice, logging at `level`."""
    script = textwrap.dedent(f"""
        import logging, sys
        sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
        if {level!r} != "NONE":
            logging.basicConfig(level={level!r}, stream=sys.stderr)
        from bob import ToolCall
        from bob_mcp import McpServerConfig, McpToolPort
        cfg = McpServerConfig("h", command=sys.executable, args=({RAW!r}, *{flags!r}),
                              env={{"API_KEY": {SECRET!r}}})
        with McpToolPort([cfg]) as port:
            for _ in range(2):
                r = port.call_tool(ToolCall("c", "h__{tool}", {{}}), 10)
                print(r.is_error, r.content)
    """)
    return [sys.executable, "-c", script]


@pytest.fixture(scope="module")
def bobs():
    """The bob processes of the tests below, one per logging level, started together."""
    with Together({level: bob_command(["banner"], level) for level in ("NONE", "INFO")}) as t:
        yield t


# ---- 1. garbage lines on stdout ----

def test_garbage_lines_are_skipped_and_silent_without_verbose(bobs):
    done = bobs.result("NONE")
    assert done.stdout.splitlines() == ["False ok", "False ok"], done
    assert done.stderr == "", done.stderr


def test_garbage_lines_are_logged_masked_with_verbose(bobs):
    done = bobs.result("INFO")
    assert done.stdout.splitlines() == ["False ok", "False ok"], done
    assert "not JSON-RPC" in done.stderr and "hostile server v1 starting" in done.stderr
    assert SECRET not in done.stderr and "key=***" in done.stderr, done.stderr


# ---- 2. invalid UTF-8 on stdout ----

@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """One hostile server for the tests below that leave it usable (a start is a second of
    CPU): invalid UTF-8 on stdout at startup, the secrets' environment, and --record for the
    cancel tests: its port, and the file its `slow` tool writes when cancelled."""
    record = tmp_path_factory.mktemp("cancel") / "cancelled"
    env = {"API_KEY": SECRET, "db_password": 'pa"ss\\wd', "MY_VAR": "a b&c/d",
           "HOME_DIR": "xyz", "PROJECT_DIR": "/home/alice/app"}
    with McpToolPort([hostile("--bad-utf8", "--record", str(record), env=env,
                              secret_env=("MY_VAR",))]) as port:
        yield port, record


def test_invalid_utf8_at_startup_and_in_calls_does_not_break_the_server(shared_server):
    port, _ = shared_server
    for _ in range(3):
        result = call(port, "h__noise")
        assert (result.is_error, result.content) == (False, "ok"), result


# ---- 3. secret masking without gaps ----

def test_secrets_are_masked_whatever_their_length_and_form(shared_server):
    port, _ = shared_server   # its env: API_KEY, db_password, MY_VAR (secret_env), HOME_DIR...
    assert call(port, "h__echo_env", name="API_KEY").content == "***"
    leaked = call(port, "h__leak", name="db_password")   # JSON-escaped in the error
    assert leaked.is_error and "ss" not in leaked.content and "***" in leaked.content, leaked
    assert call(port, "h__echo_env", name="MY_VAR").content == "***"
    for name, value in [("PROJECT_DIR", "/home/alice/app"), ("HOME_DIR", "xyz")]:
        assert call(port, "h__echo_env", name=name).content == value  # configuration
    server = port._servers[0]
    text = "a%20b%26c%2Fd a+b%26c%2Fd pa%22ss%5Cwd"
    assert server._scrub(text) == "*** *** ***", server._scrub(text)


# ---- 5. no process outlives bob ----

def test_a_setsid_grandchild_is_ended_with_its_server():
    marker = f"bob-hostile-{uuid.uuid4().hex[:8]}"
    port = McpToolPort([McpServerConfig("r", command=sys.executable, args=(RAW, "setsid-crash"),
                                        env={"MARKER": marker})]).start()   # starts in ms
    try:
        assert wait_until(lambda: marked_pids(marker), timeout=10), "no grandchild started"
    finally:
        port.close()
    assert wait_until(lambda: not marked_pids(marker), timeout=5), marked_pids(marker)


# ---- 4. cancel reaches the server ----

@pytest.fixture
def recording(shared_server):
    """The shared server for one test: what an earlier test's call recorded is removed."""
    port, record = shared_server
    for path in (record, Path(f"{record}.started")):
        path.unlink(missing_ok=True)
    return port, record


def cancelled_at(record: Path) -> float:
    """When the server saw notifications/cancelled (its time.monotonic(), one clock for all)."""
    assert wait_until(record.exists, timeout=10), "the server never saw notifications/cancelled"
    return float(record.read_text())


def test_cancel_sends_notifications_cancelled_at_once(recording):
    port, record = recording
    token, results = bob.CancelToken(), []
    worker = threading.Thread(target=lambda: results.append(port.call_tool(
        ToolCall("c1", "h__slow", {"seconds": 30}), 60, cancel=token)))
    worker.start()
    assert wait_until(Path(f"{record}.started").exists, timeout=10)
    t0 = time.monotonic()
    token.cancel()
    worker.join(10)
    delay_ms = (cancelled_at(record) - t0) * 1000
    print(f"cancel -> server saw notifications/cancelled: {delay_ms:.1f} ms")
    assert delay_ms < 300, f"{delay_ms:.1f} ms (bound 100 ms, generous for a loaded box)"
    assert results[0].is_error and "cancelled" in results[0].content, results
    assert call(port, "h__echo_env", name="API_KEY").content == "***"   # still usable


def test_a_timed_out_call_is_cancelled_on_the_server(recording):
    port, record = recording
    t0 = time.monotonic()
    result = call(port, "h__slow", timeout_s=0.5, seconds=30)
    assert result.is_error and "timed out" in result.content, result
    assert cancelled_at(record) - t0 < 5


def test_cancelling_a_turn_cancels_its_mcp_call(recording):
    port, record = recording
    llm = bob.ScriptedLlm(['{"type":"tool_call","name":"h__slow","arguments":{"seconds":30}}'])
    token, results = bob.CancelToken(), []
    turn = threading.Thread(target=lambda: results.append(
        bob.AgentRuntime(llm, port).run(bob.AgentRequest("wait"), cancel=token)))
    turn.start()
    assert wait_until(Path(f"{record}.started").exists, timeout=10)
    t0 = time.monotonic()
    token.cancel()
    turn.join(10)
    assert results[0].finish_reason == bob.FinishReason.CANCELLED
    assert cancelled_at(record) - t0 < 0.3


def test_a_transport_broken_at_startup_is_reported_at_once_with_its_cause():
    t0 = time.monotonic()
    with pytest.raises(bob_mcp.McpError) as err:
        McpToolPort([hostile("--close-stdout", startup_timeout_ms=30_000)]).start()
    elapsed = time.monotonic() - t0
    assert "'h'" in str(err.value) and "closed the connection" in str(err.value), err.value
    assert elapsed < 10, f"reported after {elapsed:.1f} s, not at once"
