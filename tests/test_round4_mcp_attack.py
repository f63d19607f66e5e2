"""bob_mcp, fourth round, attacked: hostile Streamable HTTP servers against the 404 retry (a lost
session started anew within the call), and the tool cap. Real servers only:
tests/mcp_http_server.py on 127.0.0.1, its session set replaced by ones that misbehave."""
from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from pathlib import Path

import bob
import bob_mcp
from bob import CancelToken, ToolCall
from bob_mcp import McpServerConfig, McpToolPort
from mcp_http_server import ForgetOnCall, McpHttpServer

SAME = str(Path(__file__).parent / "mcp_same_name_server.py")


def http(url: str, **kw) -> McpServerConfig:
    return McpServerConfig("w", transport="streamable_http", url=url, **kw)


def call(port: McpToolPort, timeout_s: float = 10.0, cancel: CancelToken | None = None,
         text: str = "x") -> bob.ToolResult:
    return port.call_tool(ToolCall("c1", "w__echo", {"text": text}), timeout_s, cancel)


def methods(srv: McpHttpServer) -> list[str | None]:
    return [m for m, _ in srv.requests]


class _Blocking(set):
    """Sessions a server forgets (404); a new session's initialize then waits on `release`
    (a restart that hangs) and `entered` says it got there."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def add(self, session: str) -> None:
        self.entered.set()
        self.release.wait(30)
        super().add(session)


# ---- 1. the 404 retry -------------------------------------------------------------------------

def test_a_server_that_answers_404_to_everything_gets_no_storm(caplog):
    with McpHttpServer() as srv, McpToolPort([http(srv.url)]) as port:
        srv.status = 404   # initialize included, from now on
        before = len(srv.requests)
        with caplog.at_level(logging.WARNING):
            r = call(port)
            assert r.is_error and "failed to start" in r.content and "404" in r.content, r
            sent = methods(srv)[before:]
            print(f"404 to everything: {len(sent)} requests for one call: {sent}")
            assert sent.count("tools/call") == 1 and sent.count("initialize") == 1, sent
            again = call(port)   # the same turn: no new try (a failed start is no lost session)
            assert again.is_error and "failed to start" in again.content, again
            assert methods(srv)[before:] == sent, methods(srv)
            for _ in range(3):      # the next turns: one more try, then it is dropped for good
                port.list_tools()
            assert methods(srv)[before:].count("initialize") == 2, methods(srv)
            assert call(port).is_error
            gc.collect()
        assert methods(srv)[before:].count("initialize") == 2, methods(srv)
    assert "never retrieved" not in caplog.text, caplog.text


def test_many_concurrent_calls_that_meet_a_404_start_exactly_one_new_session():
    """Was flaky (1 of 20 calls `timed out`, in about 1 run of 4): the test below makes its race
    certain. Also failed (10 calls `executor unavailable: ... ReadError`) while the test server
    had socketserver's listen backlog of 5: 20 connections at once overflowed it."""
    with McpHttpServer() as srv, McpToolPort([http(srv.url)]) as port:
        assert call(port).content == "x"
        srv.restart()
        results: dict[str, bob.ToolResult] = {}
        threads = [threading.Thread(target=lambda t=str(i): results.update({t: call(
            port, text=t)})) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert {k: (r.is_error, r.content) for k, r in results.items()} == {
            str(i): (False, str(i)) for i in range(20)}, results
        assert srv.initializes == 2, srv.initializes


class _OnLoop(CancelToken):
    """A token that says (`on_loop`) when call_tool has put its call on the port's loop: it
    registers its cancel callback right after."""

    def __init__(self, on_loop: threading.Semaphore) -> None:
        super().__init__()
        self._on_loop = on_loop

    def on_cancel(self, callback):
        self._on_loop.release()
        return super().on_cancel(callback)


def test_calls_that_begin_as_the_lost_session_ends_wait_for_the_new_one():
    """The race of the test above, made certain: calls that begin on the port's loop just as the
    session that met the 404 ends, before the first call's restart begins (bob logs "bob will
    try to restart it" right there, on the loop). They waited for the ended session's start,
    done, then found the new one's not done and said `timed out after 10000 ms` in ~30 ms."""
    late: dict[str, bob.ToolResult] = {}
    threads: list[threading.Thread] = []
    on_loop = threading.Semaphore(0)

    class AtRunEnd(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "will try to restart" not in record.getMessage() or threads:
                return
            for i in range(5):   # on the loop, which waits until each call is on it
                threads.append(threading.Thread(target=lambda t=f"late{i}": late.update(
                    {t: call(port, cancel=_OnLoop(on_loop), text=t)})))
                threads[-1].start()
                assert on_loop.acquire(timeout=5)

    handler = AtRunEnd()
    logging.getLogger("bob.mcp").addHandler(handler)
    try:
        with McpHttpServer() as srv, McpToolPort([http(srv.url)]) as port:
            assert call(port).content == "x"
            srv.restart()
            assert call(port, text="first").content == "first"   # met the 404, restarted
            for t in threads:
                t.join(20)
            assert {k: (r.is_error, r.content) for k, r in late.items()} == {
                f"late{i}": (False, f"late{i}") for i in range(5)}, late
            assert srv.initializes == 2, srv.initializes
    finally:
        logging.getLogger("bob.mcp").removeHandler(handler)


def test_a_restart_that_hangs_in_initialize_keeps_the_calls_timeout_and_says_so():
    with McpHttpServer() as srv, McpToolPort([http(srv.url)]) as port:
        assert call(port).content == "x"
        srv.sessions = _Blocking()
        try:
            t0 = time.monotonic()
            r = call(port, timeout_s=1.0)
            took = time.monotonic() - t0
        finally:
            srv.sessions.release.set()
        assert srv.sessions.entered.is_set()
        assert took < 1.5, took
        assert r.is_error and "timed out after 1000 ms" in r.content, r


def test_a_cancel_while_a_404_restart_hangs_ends_the_call_within_100_ms():
    with McpHttpServer() as srv, McpToolPort([http(srv.url)]) as port:
        assert call(port).content == "x"
        srv.sessions = _Blocking()
        token, stamp = CancelToken(), {}

        def fire() -> None:
            if srv.sessions.entered.wait(5):
                stamp["t"] = time.monotonic()
                token.cancel()
        threading.Thread(target=fire, daemon=True).start()
        try:
            r = call(port, timeout_s=10.0, cancel=token)
            late = time.monotonic() - stamp["t"]
        finally:
            srv.sessions.release.set()
        assert r.is_error and "cancelled" in r.content, r
        assert late < 0.1, late


def test_a_404_met_while_bob_closes_leaves_no_thread_and_no_unseen_error(caplog):
    threads_before = set(threading.enumerate())
    with caplog.at_level(logging.WARNING), McpHttpServer() as srv:
        port = McpToolPort([http(srv.url)]).start()
        assert call(port).content == "x"
        srv.sessions = _Blocking()
        results = []
        caller = threading.Thread(target=lambda: results.append(call(port, timeout_s=10.0)))
        caller.start()
        assert srv.sessions.entered.wait(5)   # the call's restart hangs in initialize
        t0 = time.monotonic()
        port.close()
        srv.sessions.release.set()
        caller.join(10)
        took = time.monotonic() - t0
        gc.collect()
    assert results and results[0].is_error, results
    assert took < 10, took
    # bob's threads, not the test server's own handlers (daemons its close does not join: one
    # may still be writing to a socket bob closed)
    left = [t for t in set(threading.enumerate()) - threads_before
            if t.is_alive() and "process_request_thread" not in t.name]
    assert not left, left
    assert "never retrieved" not in caplog.text, caplog.text


def test_a_server_that_answers_404_only_to_calls_costs_a_bounded_number_of_requests():
    with McpHttpServer() as srv, McpToolPort([http(srv.url)]) as port:
        srv.sessions = ForgetOnCall(srv.requests)
        before = len(srv.requests)
        for turn in range(3):
            port.list_tools()
            for _ in range(2):
                r = call(port, timeout_s=20.0)
                assert r.is_error and "HTTP 404" in r.content, r
        sent = methods(srv)[before:]
        print(f"404 to every tools/call: {len(sent)} requests for 6 calls in 3 turns: "
              f"{sent.count('initialize')} initialize, {sent.count('tools/call')} tools/call")
        assert sent.count("tools/call") <= 2 * 6 and sent.count("initialize") <= 2 * 6, sent


# ---- 2. the tool cap ----------------------------------------------------------------------------

def test_a_thousand_tools_of_one_name_are_one_warning_a_listing_not_999(caplog):
    same = McpServerConfig("s", command=sys.executable, args=(SAME, str(bob_mcp._MAX_TOOLS)))
    with caplog.at_level(logging.WARNING, logger="bob.mcp"), McpToolPort([same]) as port:
        assert [t.name for t in port.list_tools()] == ["s__same"]
        assert call_same(port).content == "ok"      # it sends tools/list_changed
        assert [t.name for t in port.list_tools()] == ["s__same"]   # listed again
    clashes = [r.getMessage() for r in caplog.records if "clash" in r.getMessage()]
    assert len(clashes) == 2, len(clashes)
    assert "'same'" in clashes[0] and "the server lists both" in clashes[0], clashes[0]
    assert f"{bob_mcp._MAX_TOOLS - 1} tools skipped" in clashes[0], clashes[0]


def call_same(port: McpToolPort) -> bob.ToolResult:
    return port.call_tool(ToolCall("c1", "s__same", {}), 10.0)
