"""Benchmark: what bob_mcp's sync-to-async bridge costs per tool call.

    /tmp/venv/bin/python bench/mcp_overhead.py [--calls 200] [--warmup 30]

Prints the median round trip of a trivial tool call (echo) through McpToolPort.call_tool and
through the SDK's own async ClientSession.call_tool, against tests/mcp_server.py over stdio (one
server process each, the same script) and over streamable HTTP (the very same server process),
their ratio (target: at most 1.2x), and the time from McpToolPort.start() to tools listed.
The two are measured in alternating rounds, so load from other processes hits both alike.

Sections:
    1. Measuring both, round by round
    2. Main
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
from contextlib import AbstractAsyncContextManager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

from bob import ToolCall  # noqa: E402
from bob_mcp import McpServerConfig, McpToolPort  # noqa: E402

SERVER = str(ROOT / "tests" / "mcp_server.py")
ROUNDS = 10


# ---- 1. Measuring both, round by round ----

async def measure(transport: AbstractAsyncContextManager, cfg: McpServerConfig, calls: int,
                  warmup: int) -> tuple[list[float], list[float], float]:
    """(SDK round trips, McpToolPort round trips, seconds from start() to tools listed).

    The SDK session runs on this thread's loop; the port on its own loop thread, driven here
    synchronously (blocking this loop meanwhile, which the idle SDK session does not mind)."""
    async with transport as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        t0 = time.perf_counter()
        with McpToolPort([cfg]) as port:
            assert port.list_tools()
            startup = time.perf_counter() - t0
            call = ToolCall("b", f"{cfg.id}__echo", {"text": "ping"})
            for _ in range(warmup):
                await session.call_tool("echo", {"text": "ping"})
                port.call_tool(call, 10.0)
            sdk, bridged, per_round = [], [], max(1, calls // ROUNDS)
            for _ in range(ROUNDS):
                for _ in range(per_round):
                    t = time.perf_counter()
                    await session.call_tool("echo", {"text": "ping"})
                    sdk.append(time.perf_counter() - t)
                for _ in range(per_round):
                    t = time.perf_counter()
                    result = port.call_tool(call, 10.0)
                    bridged.append(time.perf_counter() - t)
                    assert result.content == "ping", result
    return sdk, bridged, startup


# ---- 2. Main ----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _report(label: str, sdk: list[float], port: list[float]) -> None:
    m_sdk, m_port = statistics.median(sdk), statistics.median(port)
    print(f"{label:6} SDK ClientSession.call_tool  median {m_sdk * 1e6:8.0f} us")
    print(f"{label:6} McpToolPort.call_tool        median {m_port * 1e6:8.0f} us"
          f"   ratio {m_port / m_sdk:.2f}x (target <= 1.20x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=30)
    args = ap.parse_args()

    stdio = stdio_client(StdioServerParameters(command=sys.executable, args=[SERVER]),
                         errlog=subprocess.DEVNULL)
    cfg = McpServerConfig("s", command=sys.executable, args=(SERVER,))
    sdk, port, startup = asyncio.run(measure(stdio, cfg, args.calls, args.warmup))
    _report("stdio", sdk, port)
    print(f"stdio  start() to tools listed: {startup * 1000:.0f} ms")

    http_port = _free_port()
    server = subprocess.Popen([sys.executable, SERVER, "--http", str(http_port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while socket.socket().connect_ex(("127.0.0.1", http_port)) != 0:
            if time.monotonic() > deadline or server.poll() is not None:
                sys.exit("the HTTP MCP server did not come up")
            time.sleep(0.02)
        url = f"http://127.0.0.1:{http_port}/mcp"
        cfg = McpServerConfig("h", "streamable_http", url=url)
        sdk, port, startup = asyncio.run(measure(streamable_http_client(url), cfg, args.calls,
                                                 args.warmup))
        _report("http", sdk, port)
        print(f"http   start() to tools listed: {startup * 1000:.0f} ms (server already up)")
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
