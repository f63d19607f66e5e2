"""bob_mcp, fourth round: a Streamable HTTP session the server lost (404) is started anew within
the call that met it; the tools one server may list are capped; the one read of the SDK's
internals (the stdio Process) is checked here on the SDK the suite runs, and named when it fails.
Real servers only: tests/mcp_server.py (the SDK's own HTTP server, killed and started again on
the same port), tests/mcp_http_server.py, tests/mcp_many_tools_server.py, tests/mcp_raw_server.py
(stdio, hand-written: it starts in milliseconds)."""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import bob
import bob_mcp
from bob import ToolCall
from bob_mcp import McpError, McpServerConfig, McpToolPort
from conftest import marked_pids, wait_until
from mcp_http_server import ForgetOnCall, McpHttpServer

HERE = Path(__file__).parent
SERVER = str(HERE / "mcp_server.py")
RAW = str(HERE / "mcp_raw_server.py")
MANY = str(HERE / "mcp_many_tools_server.py")


def call(port: McpToolPort, tool: str, timeout_s: float = 10.0, **arguments) -> bob.ToolResult:
    return port.call_tool(ToolCall("c1", tool, arguments), timeout_s)


def http(srv_url: str, **kw) -> McpServerConfig:
    return McpServerConfig("w", transport="streamable_http", url=srv_url, **kw)


# ---- 1. a lost HTTP session: a new one, and the call once more, within the call ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sdk_http_server(port: int) -> subprocess.Popen:
    """tests/mcp_server.py (the SDK's Streamable HTTP server) on this port, once it listens."""
    proc = subprocess.Popen([sys.executable, SERVER, "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ready() -> bool:
        with socket.socket() as s:
            return proc.poll() is None and s.connect_ex(("127.0.0.1", port)) == 0
    assert wait_until(ready, timeout=15), "the HTTP MCP server did not come up"
    return proc


def test_a_restarted_http_server_is_called_again_in_a_new_session_within_the_call():
    number = free_port()
    proc = sdk_http_server(number)
    try:
        with McpToolPort([http(f"http://127.0.0.1:{number}/mcp")]) as port:
            assert call(port, "w__echo", text="a").content == "a"
            proc.kill()   # a real restart: a new process, no memory of bob's session
            proc.wait(5)
            proc = sdk_http_server(number)
            t0 = time.monotonic()
            r = call(port, "w__echo", text="b")
            print(f"404 -> new session -> the same call answered: "
                  f"{(time.monotonic() - t0) * 1000:.1f} ms")
            assert (r.is_error, r.content) == (False, "b"), r
            assert call(port, "w__echo", text="c").content == "c"   # and it keeps serving
    finally:
        proc.kill()
        proc.wait(5)


def test_a_forgotten_session_is_initialized_again_once_within_the_call(caplog):
    with McpHttpServer() as srv, McpToolPort([http(srv.url)]) as port:
        assert call(port, "w__echo", text="a").content == "a"
        srv.restart()   # it forgot the session: 404 for the old id
        with caplog.at_level(logging.WARNING, logger="bob.mcp"):
            r = call(port, "w__echo", text="b")
        assert (r.is_error, r.content) == (False, "b"), r
        assert srv.initializes == 2
        assert [t.name for t in port.list_tools()] == ["w__echo"]   # no restart left for later
        assert srv.initializes == 2
    assert "restart it: at once" in caplog.text, caplog.text


def test_calls_that_meet_the_404_together_share_one_new_session():
    with McpHttpServer() as srv, McpToolPort([http(srv.url)]) as port:
        assert call(port, "w__echo", text="a").content == "a"
        srv.restart()
        results: dict[str, bob.ToolResult] = {}
        threads = [threading.Thread(target=lambda t=t: results.update({t: call(
            port, "w__echo", text=t)})) for t in ("b", "c", "d")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert {k: (r.is_error, r.content) for k, r in results.items()} == {
            k: (False, k) for k in "bcd"}, results
        assert srv.initializes == 2, srv.initializes


def test_a_second_404_is_an_error_result_naming_the_cause_and_one_retry_only():
    with McpHttpServer() as srv, McpToolPort([http(srv.url)]) as port:
        srv.sessions = ForgetOnCall(srv.requests)
        t0 = time.monotonic()
        r = call(port, "w__echo", timeout_s=20, text="b")
        assert time.monotonic() - t0 < 5, "it waited for the timeout"
        assert r.is_error and "HTTP 404" in r.content and "session" in r.content, r
        assert srv.initializes == 2, srv.initializes   # the first session, one new one
        assert [m for m, _ in srv.requests].count("tools/call") == 2


def test_a_second_404_carrying_a_json_rpc_error_is_the_servers_error():
    """A 404 whose body is a JSON-RPC error (the SDK's client says a server may answer "method
    not found" so; the SDK's own server so answers a session it does not know) is taken for a lost
    session: a new session, the call once more. A second one, on the session just begun, is the
    server's error: its own message, not `executor unavailable: ... HTTP 404`."""
    with McpHttpServer() as srv, McpToolPort([http(srv.url)]) as port:
        srv.sessions = ForgetOnCall(srv.requests)
        srv.not_found = json.dumps({"jsonrpc": "2.0", "id": None, "error": {
            "code": -32601, "message": "tools/call is not offered here"}}).encode()
        for _ in range(2):   # the second: the same, on the session the first one left
            r = call(port, "w__echo", text="b")
            assert (r.is_error, r.content) == (
                True, "MCP error from server w: tools/call is not offered here"), r
        assert srv.initializes == 3, srv.initializes   # the first session, one new one per call
        assert [m for m, _ in srv.requests].count("tools/call") == 4
        # the session that answered stays, and its next error is an error, not a lost session
        # (the 404 was remembered: that call began a new session and ran the tool twice)
        srv.sessions = set(srv.sessions)   # it remembers sessions again
        r = call(port, "w__echo", text="FAIL")
        assert (r.is_error, r.content) == (True, "MCP error from server w: echo will not say FAIL")
        assert srv.initializes == 3, srv.initializes
        assert [m for m, _ in srv.requests].count("tools/call") == 5


class _GoesDown(set):
    """Sessions a server forgets, going down (503) right after: the new session fails."""

    def __init__(self, owner: McpHttpServer) -> None:
        super().__init__()
        self.owner = owner

    def __contains__(self, session: object) -> bool:
        self.owner.status = 503
        return False


def test_a_new_session_that_fails_is_the_calls_result_and_tried_again_next_turn(caplog):
    with McpHttpServer() as srv, McpToolPort([http(srv.url)]) as port:
        srv.sessions = _GoesDown(srv)
        with caplog.at_level(logging.WARNING):
            r = call(port, "w__echo", text="b")
            assert r.is_error and "failed to start" in r.content, r
            srv.status = 0
            srv.sessions = set()   # it is back
            assert [t.name for t in port.list_tools()] == ["w__echo"]   # the next turn
            gc.collect()           # the failed start's future, if its error went unseen
        assert call(port, "w__echo", text="c").content == "c"
    assert "never retrieved" not in caplog.text, caplog.text


def test_a_call_on_a_server_that_is_gone_is_not_retried():
    with McpHttpServer() as srv, McpToolPort([http(srv.url)]) as port:
        assert call(port, "w__echo", text="a").content == "a"
        srv.close()   # refused, not 404: no new session to start
        r = call(port, "w__echo", text="b")
        assert r.is_error and "unavailable" in r.content, r
        assert srv.initializes == 1


# ---- 2. the tools one server may list are capped ----

def many(total: int, per_page: int = 0, **kw) -> McpServerConfig:
    return McpServerConfig("many", command=sys.executable,
                           args=(MANY, str(total), str(per_page or total)), **kw)


def test_a_required_server_listing_too_many_tools_fails_start_naming_the_cause():
    with pytest.raises(McpError) as err:
        McpToolPort([many(bob_mcp._MAX_TOOLS + 1)]).start()
    text = str(err.value)
    for words in ("'many'", f"{bob_mcp._MAX_TOOLS + 1} tools", f"limit of {bob_mcp._MAX_TOOLS}",
                  "fewer tools"):
        assert words in text, text


def test_a_million_tools_in_pages_stop_at_the_cap_not_at_the_page_limit():
    t0 = time.monotonic()
    with pytest.raises(McpError) as err:
        McpToolPort([many(1_000_000, 700)]).start()
    assert "1400 tools" in str(err.value) and "pages" not in str(err.value), err.value
    assert time.monotonic() - t0 < 10


def test_an_optional_server_over_the_cap_is_skipped_with_a_warning(caplog):
    small = McpServerConfig("small", command=sys.executable, args=(MANY, "2"))
    with caplog.at_level(logging.WARNING, logger="bob.mcp"), McpToolPort(
            [many(bob_mcp._MAX_TOOLS + 1, required=False), small]) as port:
        assert [t.name for t in port.list_tools()] == ["small__t0", "small__t1"]
        assert call(port, "small__t0", text="x").content == "x"
    assert "'many'" in caplog.text and "Skipping it" in caplog.text, caplog.text


def test_a_list_that_grows_past_the_cap_keeps_the_old_one_and_no_process_outlives_bob(caplog):
    marker = f"bob-r4-{uuid.uuid4().hex[:8]}"
    port = McpToolPort([McpServerConfig("many", command=sys.executable,
                                        args=(MANY, "3", "1000", marker))]).start()
    try:
        assert call(port, "many__t1", total=bob_mcp._MAX_TOOLS + 5).content == ""
        with caplog.at_level(logging.WARNING, logger="bob.mcp"):
            names = [t.name for t in port.list_tools()]   # the next turn re-lists it
        assert names == ["many__t0", "many__t1", "many__t2"], names
        assert "'many'" in caplog.text and f"limit of {bob_mcp._MAX_TOOLS}" in caplog.text
        assert call(port, "many__t0", text="x").content == "x"   # it keeps serving
    finally:
        port.close()
    assert wait_until(lambda: not marked_pids(marker), timeout=5), marked_pids(marker)


def test_a_server_with_exactly_the_cap_starts():
    with McpToolPort([many(bob_mcp._MAX_TOOLS, 300)]) as port:
        assert len(port.list_tools()) == bob_mcp._MAX_TOOLS
        assert call(port, "many__t0", text="x").content == "x"


# ---- 3. the SDK's stdio Process, read from its generator frame ----

def test_the_stdio_process_is_found_in_the_installed_sdk(caplog):
    """This is the test pyproject.toml's `mcp` range rests on: if a new SDK moves the Process,
    the exit code, the kill of a setsid grandchild and this warning all show it."""
    marker = f"bob-r4-{uuid.uuid4().hex[:8]}"   # the hand-written server: starts in ms
    with caplog.at_level(logging.WARNING, logger="bob.mcp"):
        port = McpToolPort([McpServerConfig("h", command=sys.executable, env={"MARKER": marker},
                                            args=(RAW, "setsid-crash")),
                            McpServerConfig("s", command=sys.executable, args=(RAW,))])
        port.start()
        try:
            assert wait_until(lambda: marked_pids(marker), timeout=10), "no grandchild started"
            r = call(port, "s__crash")
            assert r.is_error and "exited (code 3)" in r.content, r
        finally:
            port.close()
    assert wait_until(lambda: not marked_pids(marker), timeout=5), marked_pids(marker)
    assert "orphan" not in caplog.text, caplog.text


def test_a_transport_without_a_visible_process_is_named_in_a_warning(caplog):
    """A transport whose generator holds no `process` (a future SDK): a warning naming the
    server and the consequence, not a silent skip."""
    with McpToolPort([]):   # binds bob_mcp.anyio and bob_mcp.mcp
        pass

    @contextlib.asynccontextmanager
    async def transport():
        yield None

    with caplog.at_level(logging.WARNING, logger="bob.mcp"):
        assert bob_mcp._stdio_process(transport(), "fs") is None
    assert "'fs'" in caplog.text and "orphan cleanup is off" in caplog.text, caplog.text


# ---- 4. the SDK is imported on first use, visibly ----

def test_the_sdk_names_are_bound_on_first_start_only():
    code = ("import sys, bob_mcp\n"
            "assert bob_mcp.mcp is None and bob_mcp.anyio is None and 'mcp' not in sys.modules\n"
            "with bob_mcp.McpToolPort([]):\n"
            "    assert bob_mcp.mcp.ClientSession and bob_mcp.anyio.abc.Process\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=HERE.parent, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
