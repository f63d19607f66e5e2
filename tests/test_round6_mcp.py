"""bob_mcp, sixth round: a Ctrl-C that the kernel hands to a port's event-loop thread while the
caller's thread waits on that loop (start, first use, re-listing, a call, close) reaches the
caller at once, and leaves no server process behind.

The kernel may deliver a process's SIGINT to any thread that does not block it; Python only sets
a flag there, and raises KeyboardInterrupt on the main thread when that thread next runs Python
code. A script in a child process runs the cases in turn (one MCP SDK import for all), each on
its own port, servers and marker: a helper thread, once the main thread is blocked in its wait,
sends SIGINT to the port's loop thread with signal.pthread_kill; each case is one test. Real
servers only, hand-written (no SDK import: they start in milliseconds): tests/mcp_held_server.py
holds what a case waits for (the handshake, a re-listing, a call, its exit) until the case lets
it go, so no case waits out a fixed time; tests/mcp_raw_server.py."""
from __future__ import annotations

import ctypes
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import bob
from bob_mcp import McpServerConfig, McpToolPort
from conftest import REPO, child_env, marked_pids, wait_until

HERE = Path(__file__).parent

CTRL_C_TO_THE_LOOP = r'''
import atexit, contextlib, json, os, signal, sys, tempfile, threading, time
markers, repo, tests = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.path.insert(0, repo)
import bob
import bob_mcp
from bob_mcp import McpServerConfig, McpToolPort

marker = path = None   # the case's: its servers' command lines and files carry the marker

def server(*modes, id="s"):
    return McpServerConfig(id, command=sys.executable, startup_timeout_ms=5_000,
                           args=(f"{tests}/mcp_held_server.py", path, *modes, marker))

def call(port, tool, **arguments):
    return port.call_tool(bob.ToolCall("c1", tool, arguments), 20.0)

def server_runs():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read() and int(pid) != os.getpid():
                    return True
        except OSError:
            pass
    return False

def started():   # the server runs: it made this file as it started
    return os.path.exists(path + ".running")

def release():   # what the held server holds (an answer, its exit) goes now
    open(path + ".release", "w").close()

def told_of_the_cancel():
    for _ in range(500):   # the server writes it when it sees notifications/cancelled
        if os.path.exists(path + ".cancelled"):
            return print("the server was told of the cancel")
        time.sleep(0.01)

def nothing(port):
    pass

def listed_later(port, name):
    release()
    for _ in range(500):   # the re-listing goes on; a later turn's list has its result
        if name in [t.name for t in port.list_tools()]:
            return print(f"then {name} is listed")
        time.sleep(0.01)

def owners_ended(port):
    for _ in range(500):   # what the servers' owners log as they end shows on stderr
        if all(s.task.done() for s in port._servers):
            return
        time.sleep(0.01)

def failed_start(port):
    try:
        port.start()
    except bob_mcp.McpError as e:   # a required server failed: the port closes, on a thread
        print("start failed:", str(e).splitlines()[0])

def in_a_with(port):
    with port:
        print("the body ran")

def then_use(port):
    release()
    print("then", len(port.list_tools()), "tools")

def cases():   # case: (its server, what runs first, what waits on the loop, ready to be
    return {   # interrupted, then)
        "start": (server("hang"), nothing, lambda p: p.start(), started, nothing),
        "start, then use": (server("held-start"), nothing, lambda p: p.start(), started,
                            then_use),
        "start in a with": (server("hang"), nothing, in_a_with, started,
                            lambda p: print("still running:", server_runs())),
        "first use": (server("hang"), lambda p: p.start(wait=False), lambda p: p.list_tools(),
                      started, nothing),
        "re-listing": (server("held-relist"), lambda p: (p.start(), call(p, "s__echo", text="x")),
                       lambda p: p.list_tools(), lambda: True,
                       lambda p: listed_later(p, "s__added")),
        "call": (server(), lambda p: p.start(), lambda p: call(p, "s__slow"),
                 lambda: os.path.exists(path + ".started"), lambda p: told_of_the_cancel()),
        # the interrupted close kills its servers: their owners' ends are this case's
        "close": (server("held-stop"), lambda p: p.start(), lambda p: p.close(), lambda: True,
                  owners_ended),
        "close, two servers": ([server(), server("held-stop", id="t")], lambda p: p.start(),
                               lambda p: p.close(), lambda: True, owners_ended),
        "close while closing": ([server("held-stop", id="t"), server("fail")], failed_start,
                                lambda p: p.close(), lambda: True, lambda p: release()),
    }

def run(case):
    cfg, before, wait, ready, then = cases()[case]
    port = McpToolPort(cfg if isinstance(cfg, list) else [cfg])
    before(port)
    sent, done = [], []

    def ctrl_c_to_the_loop():
        """Once the main thread waits, SIGINT the port's loop thread, as the kernel may."""
        main = threading.main_thread().ident
        while not (done or sent and ready()
                   and sys._current_frames()[main].f_code.co_name == "wait"):
            time.sleep(0.005)
        if not done:   # the wait went on to its end: no Ctrl-C for the next case
            sent[0] = time.monotonic()
            signal.pthread_kill(port._thread.ident, signal.SIGINT)

    helper = threading.Thread(target=ctrl_c_to_the_loop, daemon=True)
    helper.start()
    try:
        sent.append(None)   # the main thread waits on the port from now on
        wait(port)
        done.append(True)
        print("no KeyboardInterrupt", flush=True)
    except KeyboardInterrupt:
        print(f"KeyboardInterrupt after {time.monotonic() - sent[0]:.3f} s", flush=True)
        then(port)
    helper.join()

@atexit.register   # first, so it runs last: after the ports' closes (a held-stop server
def remove_files():   # exits once released)
    for marker in markers.values():
        for suffix in (".running", ".started", ".cancelled", ".release"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(tempfile.gettempdir(), marker + suffix))

for case, marker in markers.items():   # one process for all: one MCP SDK import
    path = os.path.join(tempfile.gettempdir(), marker)
    for out in (sys.stdout, sys.stderr):
        print(f"=== {case}", file=out, flush=True)
    try:
        run(case)
    except Exception as e:   # this case's failure, shown by its test; the next cases run
        print(f"{type(e).__name__}: {e}", flush=True)
'''


CASES = {   # case: what the script prints after the KeyboardInterrupt
    "start": [],
    "start, then use": ["then 2 tools"],   # the start went on, and the next use waited for it
    "start in a with": ["still running: False"],   # no body, no __exit__: __enter__ closes it
    "first use": [],
    "re-listing": ["then s__added is listed"],
    "call": ["the server was told of the cancel"],   # notifications/cancelled
    "close": [],
    "close, two servers": [],
    "close while closing": [],   # the port's own close after the failed start, still stopping
}


def sections(text: str) -> dict[str, list[str]]:
    """The script's output per case: the lines after its `=== case` line."""
    parts: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("=== "):
            parts[line[4:]] = []
        elif parts:
            parts[list(parts)[-1]].append(line)
    return parts


@pytest.fixture(scope="module")
def ctrl_c_runs():
    """All cases in turn, in one child process (each case its own port, servers and marker);
    each test checks its own. Then the processes left, once the child has ended."""
    markers = {case: f"bob-r6-{uuid.uuid4().hex[:8]}" for case in CASES}
    child = subprocess.run([sys.executable, "-c", CTRL_C_TO_THE_LOOP, json.dumps(markers),
                            str(REPO), str(HERE)], capture_output=True, text=True, timeout=120)
    return child, markers, sections(child.stdout), sections(child.stderr)


@pytest.mark.parametrize("case", CASES)
def test_a_ctrl_c_the_loop_thread_takes_reaches_the_waiting_caller_at_once(case, ctrl_c_runs):
    # Each wait used to end only with its own timeout: start and first use at the servers'
    # startup_timeout_ms (5 s here), re-listing at it too, a call at the tool's (20 s), close
    # once the SDK had stopped the stubborn server (~4 s): the Ctrl-C came that late
    child, markers, out, err = ctrl_c_runs
    assert case in out, (child.stdout, child.stderr)
    lines = [x for x in out[case] if not x.startswith("start failed: ")]
    assert lines and lines[0].startswith("KeyboardInterrupt after "), (out[case], err.get(case))
    assert float(lines[0].split()[2]) < 0.5, out[case]   # 50 ms, with room for load
    assert lines[1:] == CASES[case], (out[case], err.get(case))
    # no word of a restart: the servers the interrupted close killed were not taken for dead
    assert "restart" not in "\n".join(err[case]), err[case]
    # bob's exit (atexit) or the interrupted close stopped the server
    marker = markers[case]
    assert wait_until(lambda: not marked_pids(marker), timeout=5), marked_pids(marker)


# ---- the CLI: replay --live-tools while its servers start ----

TGKILL = {"x86_64": 234, "aarch64": 131}   # syscall numbers: a signal to one thread of a process


def tgkill(pid: int, tid: int, signum: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(TGKILL[platform.machine()], pid, tid, signum) == 0, ctypes.get_errno()


@pytest.mark.skipif(platform.machine() not in TGKILL, reason="tgkill's number is not known here")
def test_ctrl_c_taken_by_another_thread_of_the_cli_ends_replay_live_tools_at_once(tmp_path):
    # `bob replay --live-tools` waits for its MCP servers to start; a Ctrl-C that the kernel
    # handed to a thread other than the main one came at startup_timeout_ms (20 s here)
    marker = f"bob-r6-{uuid.uuid4().hex[:8]}"
    (tmp_path / "agent.toml").write_text(
        f'[[mcp.servers]]\nid = "h"\ncommand = "{sys.executable}"\n'
        f'args = ["{HERE / "mcp_held_server.py"}", "{tmp_path / "h"}", "hang", "{marker}"]\n'
        "startup_timeout_ms = 20000\n")
    (tmp_path / "t.jsonl").write_text(
        '{"kind":"turn_started","session_id":"d","step":0,"data":{},"ts":0}\n')
    child = subprocess.Popen([sys.executable, str(REPO / "bob_cli.py"), "replay", "t.jsonl",
                              "--live-tools"], cwd=tmp_path, env=child_env(tmp_path),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = tmp_path / "h.running"   # the server made it as it started
        assert wait_until(started.exists, timeout=20), "the server never started"
        others = sorted(int(t) for t in os.listdir(f"/proc/{child.pid}/task")
                        if int(t) != child.pid)
        t0 = time.monotonic()
        tgkill(child.pid, others[0], signal.SIGINT)   # the port's loop thread, or a helper
        child.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        child.kill()
    assert child.returncode == 130, child.returncode
    assert elapsed < 5, f"{elapsed:.1f} s"   # ~0.1 s, and the close; before: 20 s
    assert wait_until(lambda: not marked_pids(marker), timeout=5), marked_pids(marker)


# ---- a cancel while the port's loop is busy ----

def test_a_cancel_returns_at_once_while_the_ports_loop_is_busy(tmp_path):
    # The port's loop thread can be busy for a while (the SDK parsing a big message, a slow
    # logging handler for a server's stderr). A cancelled call_tool returned at once all the
    # same; waiting on the loop in 50 ms steps, it returned only once the loop was free again
    record = tmp_path / "record"
    cfg = McpServerConfig("h", command=sys.executable,
                          args=(str(HERE / "mcp_held_server.py"), str(record)))
    with McpToolPort([cfg]) as port:
        token, results = bob.CancelToken(), []
        call = threading.Thread(target=lambda: results.append(port.call_tool(
            bob.ToolCall("c1", "h__slow", {"seconds": 30}), 20.0, token)))
        call.start()
        assert wait_until(Path(f"{record}.started").exists, timeout=10)
        busy, free = threading.Event(), threading.Event()
        # the stand-in: the loop is busy for 1.5 s, or until the call has returned
        port._loop.call_soon_threadsafe(lambda: (busy.set(), free.wait(1.5)))
        assert busy.wait(5)
        t0 = time.monotonic()
        token.cancel()
        call.join(10)
        elapsed = time.monotonic() - t0
        free.set()
    assert results[0].content == "tool slow cancelled" and results[0].is_error, results
    assert elapsed < 0.5, f"{elapsed:.2f} s"   # at once, with room for load; was 1.5 s


# ---- restarts at a turn's start ----

def test_servers_that_died_together_are_restarted_together_within_the_wait(tmp_path, caplog):
    # list_tools() restarted dead servers one after another, each bounded by its own
    # startup_timeout_ms, while its wait for them all is bounded by the largest plus a grace
    # (7 s): seven that hang when restarted (1.5 s each, 10.5 s in all) made it fail, "MCP
    # servers did not answer in 8 s", and the next turn still listed the dropped servers' tools
    hang = tmp_path / "hang"   # once it exists, the servers start but never answer
    script = (f'test -e "{hang}" && exec "{sys.executable}" "{HERE / "mcp_held_server.py"}" '
              f'"{hang}" hang; exec "{sys.executable}" "{HERE / "mcp_raw_server.py"}"')
    configs = [McpServerConfig(f"s{i}", command="sh", args=("-c", script),
                               startup_timeout_ms=1_500) for i in range(7)]
    with McpToolPort(configs) as port:
        assert len(port.list_tools()) == 21
        hang.touch()
        for i in range(7):   # each exits: dead, restarted at the next turn's start
            assert "exited (code 3)" in port.call_tool(
                bob.ToolCall("c1", f"s{i}__crash", {}), 5.0).content
        t0 = time.monotonic()
        assert port.list_tools() == []   # no McpError: each restart failed and was dropped
        elapsed = time.monotonic() - t0
        assert port.list_tools() == []
    assert elapsed < 8, f"{elapsed:.1f} s"   # 1.5 s and the stops, together; one after another
    # 10.5 s: failing at 8.5 s
    assert caplog.text.count("no answer to the MCP handshake within 1500 ms") == 7, caplog.text
