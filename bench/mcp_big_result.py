"""How long one large MCP tool result takes to reach bob over stdio, and what it costs the others.

    python bench/mcp_big_result.py [--sizes 1 5 10 20]

For each size N (MB), a fresh stdio server (a FastMCP script written to a temp dir) answers one
call with N MB of text; printed: that call's time, then the time of a trivial call to a second
server on the same port (they share bob_mcp's one event-loop thread), and bob's peak RSS.
What it shows: the mcp SDK's stdio reader (mcp.client.stdio.stdio_client) joins each 64 KiB chunk
to the unfinished line so far, so a line of N bytes costs O(N^2) on that thread. bob keeps its
promises (the call ends at its tool timeout, a cancel returns at once), and the loop yields
between chunks, so other servers still answer; but that server's large result is slow, and its
later calls wait until the line is read. No target: a figure to watch (see the README, MCP).
"""
from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bob import ToolCall  # noqa: E402
from bob_mcp import McpServerConfig, McpToolPort  # noqa: E402

SERVER = '''
from mcp.server.mcpserver import MCPServer
server = MCPServer("big", log_level="WARNING")

@server.tool()
def blob(mb: int) -> str:
    """mb MB of text."""
    return "y" * (mb << 20)

@server.tool()
def ping() -> str:
    """pong"""
    return "pong"

server.run()
'''


def one(script: str, mb: int, timeout_s: float) -> tuple[float, float, bool]:
    """(seconds for the blob call, seconds for a ping to the other server during it, ok)."""
    servers = [McpServerConfig(i, command=sys.executable, args=(script,), tool_timeout_ms=120_000)
               for i in ("a", "b")]
    with McpToolPort(servers) as port:
        pinged: list[float] = []

        def ping() -> None:
            time.sleep(0.2)   # a bench, not a test: let the blob call start first
            t = time.perf_counter()
            port.call_tool(ToolCall("p", "b__ping", {}), timeout_s)
            pinged.append(time.perf_counter() - t)
        pinger = threading.Thread(target=ping)
        pinger.start()
        t = time.perf_counter()
        r = port.call_tool(ToolCall("c", "a__blob", {"mb": mb}), timeout_s)
        took = time.perf_counter() - t
        pinger.join()
    return took, pinged[0], not r.is_error and len(r.content) == mb << 20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 5, 10, 20])
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = str(Path(tmp) / "big_server.py")
        Path(script).write_text(SERVER)
        print(f"{'MB':>4} {'call s':>8} {'other server ping s':>20} {'ok':>4}")
        for mb in args.sizes:
            took, ping, ok = one(script, mb, args.timeout)
            print(f"{mb:>4} {took:>8.2f} {ping:>20.2f} {ok!s:>4}", flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"peak RSS of this process: {rss} MB")


if __name__ == "__main__":
    main()
