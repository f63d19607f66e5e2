"""What hostile MCP servers cost bob's process: a tools/list of N tools in one page (the SDK
parses the whole page before bob's cap of 1,000 applies), and an HTTP 404 whose body is large
(the SDK reads a JSON body whole). Each case runs in a fresh process; prints seconds to the
error and the process's peak RSS.

    python bench/mcp_attack.py [N ...]        # default: 100000 300000 (a million: > 5 min)
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ONE_PAGE = """
import resource, sys, time
sys.path[:0] = [{root!r}, {tests!r}]
from bob_mcp import McpError, McpServerConfig, McpToolPort
cfg = McpServerConfig("many", command=sys.executable,
                      args=({many!r}, "{n}"), startup_timeout_ms=600_000)
t0 = time.monotonic()
try:
    McpToolPort([cfg]).start()
except McpError as e:
    error = str(e).splitlines()[0][:90]
print(f"{n:>9} tools in one page: {{time.monotonic() - t0:6.1f}} s to {{error!r}}, "
      f"peak RSS {{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}} MB")
"""

BIG_404 = """
import resource, sys, threading, time
sys.path[:0] = [{root!r}, {tests!r}]
from bob import ToolCall
from bob_mcp import McpServerConfig, McpToolPort
import mcp_http_server
from mcp_http_server import McpHttpServer
MB = {mb}

class Handler(mcp_http_server._Handler):
    def _send(self, status, body, headers=None):
        if status != 404:
            return super()._send(status, body, headers)
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(MB << 20))
        self.end_headers()
        chunk = b"x" * (1 << 20)
        for _ in range(MB):
            self.wfile.write(chunk)

with McpHttpServer() as srv:
    srv._http.RequestHandlerClass = Handler
    port = McpToolPort([McpServerConfig("w", transport="streamable_http", url=srv.url,
                                        tool_timeout_ms=120_000)]).start()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    srv.restart()
    t0 = time.monotonic()
    r = port.call_tool(ToolCall("c", "w__echo", {{"text": "x"}}), 120)
    took = time.monotonic() - t0
    port.close()
print(f"404 with a {{MB}} MB body: {{took:5.1f}} s to {{r.content[:60]!r}}, peak RSS "
      f"{{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}} MB (before: {{rss0}})")
"""


def run(code: str) -> None:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(r.stdout.strip() or r.stderr.strip()[-500:], flush=True)


def main() -> None:
    fmt = {"root": str(ROOT), "tests": str(ROOT / "tests"),
           "many": str(ROOT / "tests" / "mcp_many_tools_server.py")}
    for n in [int(a) for a in sys.argv[1:]] or [100_000, 300_000]:
        run(ONE_PAGE.format(n=n, **fmt))
    for mb in (16, 256):
        run(BIG_404.format(mb=mb, **fmt))


if __name__ == "__main__":
    main()
