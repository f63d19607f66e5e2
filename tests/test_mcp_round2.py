"""bob_mcp against the second attack round (issue 22), each through a real server: the
hand-written stdio server tests/mcp_raw_server.py, and a Streamable HTTP server on 127.0.0.1
(tests/mcp_http_server.py). A server that misbehaves once keeps serving; a failed start names
its cause; no orphans, no secrets, no terminal control in what bob shows."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

import bob
import bob_mcp
from bob import ToolCall
from bob_mcp import McpServerConfig, McpToolPort
from conftest import Together, marked_pids, wait_until
from mcp_http_server import McpHttpServer

RAW = str(Path(__file__).with_name("mcp_raw_server.py"))
SECRET = "k3y-Zq81"
CUT_EMOJI = "a cut emoji: \ud83d!"


def raw(*modes: str, server_id: str = "r", **kw) -> McpServerConfig:
    """The hand-written stdio server in these modes, with API_KEY set."""
    kw.setdefault("env", {"API_KEY": SECRET})
    return McpServerConfig(server_id, command=sys.executable, args=(RAW, *modes), **kw)


def call(port: McpToolPort, tool: str, timeout_s: float = 10.0, **arguments) -> bob.ToolResult:
    return port.call_tool(ToolCall("c1", tool, arguments), timeout_s)


# ---- a server that misbehaves once is not a dead server ----

def test_a_lone_surrogate_is_an_error_for_that_call_alone_over_stdio():
    with McpToolPort([raw()]) as port:
        bad = call(port, "r__echo", text=CUT_EMOJI)
        assert bad.is_error and "surrogate" in bad.content, bad
        assert "exited" not in bad.content and "unavailable" not in bad.content, bad
        assert call(port, "r__echo", text="still here").content == "still here"


def test_a_lone_surrogate_is_an_error_for_that_call_alone_over_http():
    with McpHttpServer() as srv, McpToolPort([McpServerConfig(
            "w", transport="streamable_http", url=srv.url)]) as port:
        bad = call(port, "w__echo", text=CUT_EMOJI)
        assert bad.is_error and "surrogate" in bad.content, bad
        assert call(port, "w__echo", text="still here").content == "still here"


@pytest.mark.parametrize("mode", ["null-result", "array-result"])
def test_a_malformed_result_is_an_error_at_once(mode):
    with McpToolPort([raw(mode, tool_timeout_ms=20_000)]) as port:
        for _ in range(2):   # and the server goes on serving
            t0 = time.monotonic()
            r = call(port, "r__echo", timeout_s=30, text="hi")
            assert time.monotonic() - t0 < 5, "it waited for the timeout"
            assert r.is_error and "invalid result" in r.content and "timed out" not in r.content, r


def test_an_expired_http_session_is_initialized_again():
    with McpHttpServer() as srv, McpToolPort([McpServerConfig(
            "w", transport="streamable_http", url=srv.url)]) as port:
        assert call(port, "w__echo", text="a").content == "a"
        srv.restart()   # it forgot the session: 404 for the old id
        t0 = time.monotonic()
        r = call(port, "w__echo", text="b")   # round 4: a new session and the call again, at once
        print(f"404 -> new session -> the same call: {(time.monotonic() - t0) * 1000:.1f} ms")
        assert (r.is_error, r.content) == (False, "b"), r
        assert srv.initializes == 2


def test_endless_tools_list_pages_are_a_named_startup_error():
    t0 = time.monotonic()
    with pytest.raises(bob_mcp.McpError) as err:
        McpToolPort([raw("pages", startup_timeout_ms=30_000)]).start()
    assert "pages" in str(err.value) and "handshake" not in str(err.value), err.value
    assert time.monotonic() - t0 < 10


# ---- a failed start names the real cause ----

@pytest.mark.parametrize("mode, cause", [("old-protocol", "Unsupported protocol version"),
                                         ("no-schema", "inputSchema")])
def test_a_failed_start_names_the_sdks_error(mode, cause):
    with pytest.raises(bob_mcp.McpError) as err:
        McpToolPort([raw(mode)]).start()
    assert cause in str(err.value) and "exited (code 0)" not in str(err.value), err.value


@pytest.mark.parametrize("status", [401, 403])
def test_http_401_and_403_name_the_status_and_the_header_to_check(status):
    with McpHttpServer() as srv:
        srv.status = status
        cfg = McpServerConfig("w", transport="streamable_http", url=srv.url,
                              headers={"Authorization": "Bearer tok-" + SECRET})
        with pytest.raises(bob_mcp.McpError) as err:
            McpToolPort([cfg]).start()
    text = str(err.value)
    assert str(status) in text and "Authorization" in text and SECRET not in text, text


@pytest.mark.parametrize("mode, shown", [("twice", "r__echo"), ("clash", "r__a_b")])
def test_an_optional_servers_tool_name_clash_is_a_warning(mode, shown, caplog):
    with caplog.at_level(logging.WARNING, logger="bob.mcp"), McpToolPort(
            [raw(mode, required=False)]) as port:
        names = [t.name for t in port.list_tools()]
        assert names.count(shown) == 1 and "r__crash" in names, names
        assert call(port, "r__echo", text="x").content == "x"
    assert shown in caplog.text and "rename one of the server ids" not in caplog.text


def test_a_clash_between_two_servers_keeps_the_first_and_says_to_rename(caplog):
    with caplog.at_level(logging.WARNING, logger="bob.mcp"), McpToolPort(
            [raw("prefixed", server_id="r"), raw(server_id="r__x")]) as port:
        names = [t.name for t in port.list_tools()]
        assert names.count("r__x__echo") == 1 and "r__x__crash" in names, names
        assert port.tool_sources()["r__x__echo"] == "r"   # the first keeps the name
    assert "skipping the second (rename a server id)" in caplog.text, caplog.text


# ---- no orphans, no secrets, no terminal control ----

def test_setsid_grandchildren_of_servers_that_crashed_are_ended():
    marker = f"bob-raw-{uuid.uuid4().hex[:8]}"
    port = McpToolPort([raw("setsid-crash", env={"MARKER": marker})]).start()
    try:
        for n in (1, 2):   # a crash, a restart with a new grandchild, a crash
            assert wait_until(lambda: len(marked_pids(marker)) >= 1, timeout=10)
            assert call(port, "r__crash").is_error
            port.list_tools()   # restarts it
    finally:
        port.close()
    assert wait_until(lambda: not marked_pids(marker), timeout=5), marked_pids(marker)


PHASE = "---- the noisy server ----"   # between the two servers' output of one bob process


def bob_command(level: str) -> list[str]:
    """A real bob process, logging at `level`: the raw server in mode bad-level started and its
    echo called, then (after PHASE on stdout and stderr) one in mode noisy and its crash."""
    script = textwrap.dedent(f"""
        import logging, sys
        sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
        logging.basicConfig(level={level!r}, stream=sys.stderr)
        from bob import ToolCall
        from bob_mcp import McpServerConfig, McpToolPort
        for mode, tool in (("bad-level", "echo"), ("noisy", "crash")):
            if mode == "noisy":
                for stream in (sys.stdout, sys.stderr):
                    print({PHASE!r}, file=stream, flush=True)
            cfg = McpServerConfig("r", command=sys.executable, args=({RAW!r}, mode),
                                  env={{"API_KEY": {SECRET!r}}})
            with McpToolPort([cfg]) as port:
                r = port.call_tool(ToolCall("c", "r__" + tool, {{"text": "hi"}}), 10)
                print(r.is_error, repr(r.content[:200]), flush=True)
    """)
    return [sys.executable, "-c", script]


@pytest.fixture(scope="module")
def bobs():
    """The bob processes of the two tests below, one at each level (each imports the MCP SDK: a
    second of CPU), started together; each test reads its server's part of their output."""
    with Together({level: bob_command(level) for level in ("INFO", "WARNING")}) as started:
        yield started


def part(bobs: Together, level: str, mode: str) -> subprocess.CompletedProcess[str]:
    """What the bob process at `level` printed while the server in `mode` ran."""
    r = bobs.result(level)
    assert r.stdout.count(PHASE) == 1 and r.stderr.count(PHASE) == 1, (r.stdout, r.stderr[-2000:])
    index = 0 if mode == "bad-level" else 2
    out, err = (text.partition(PHASE + "\n")[index] for text in (r.stdout, r.stderr))
    return subprocess.CompletedProcess(r.args, r.returncode, out, err)


@pytest.mark.parametrize("level", ["INFO", "WARNING"])
def test_notifications_with_an_invalid_level_are_masked_and_bounded(bobs, level):
    r = part(bobs, level, "bad-level")
    assert r.stdout.startswith("False 'hi'"), (r.stdout, r.stderr[-2000:])
    assert SECRET not in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "WARNING" not in r.stderr, r.stderr[-2000:]


def test_tool_descriptions_and_schema_defaults_are_masked():
    with McpToolPort([raw("described")]) as port:
        leaky = next(t for t in port.list_tools() if t.name == "r__leaky")
    assert SECRET not in repr(leaky) and "***" in leaky.description, leaky
    assert leaky.input_schema["properties"]["key"]["default"] == "***", leaky


@pytest.mark.parametrize("level", ["INFO", "WARNING"])
def test_what_a_server_wrote_is_shown_bounded_and_neutralised(bobs, level):
    r = part(bobs, level, "noisy")
    assert r.stdout.startswith("True"), r.stdout
    for text in (r.stdout, r.stderr):
        assert "\x1b" not in text and "\x07" not in text, text[:300]
    assert len(r.stderr) < 20_000 and max(map(len, r.stderr.splitlines())) < 2_000


def test_through_the_cli_a_lone_surrogate_is_no_dead_server(tmp_path, srv):
    from conftest import final, run_cli, write_config
    srv.push('{"type": "tool_call", "name": "r__echo", "arguments": {"text": "cut \\ud83d"}}',
             '{"type": "tool_call", "name": "r__echo", "arguments": {"text": "whole"}}',
             final("done"))
    write_config(tmp_path, srv, extra=(
        f'[[mcp.servers]]\nid = "r"\ncommand = "{sys.executable}"\nargs = ["{RAW}"]\n'))
    r = run_cli(tmp_path, "-p", "echo it")
    assert r.returncode == 0 and r.stdout == "done\n", r.stderr
    assert "exited" not in r.stderr and "restart" not in r.stderr, r.stderr
    results = [m for m in srv.requests[2]["body"]["messages"] if "whole" in str(m)]
    assert results and "surrogate" in str(srv.requests[1]["body"]["messages"]), srv.requests[1]
