"""Benchmark: processes left alive after MCP servers that start a setsid child, then crash.

    /work/venv/bin/python bench/mcp_orphans.py [--crashes 20] [--bob DIR]

Runs tests/mcp_raw_server.py in `setsid-crash` mode (a grandchild in a new session, then the
tool `crash` exits the server): crash, next turn restarts it, N times; then close(). Prints the
orphans still alive (target: 0), the time from a crash to the restarted server's answer, and the
CPU time the bob process spent per second while one server idles (the process-tree watch).
--bob DIR: import bob_mcp from DIR (e.g. an older checkout, to compare).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "tests" / "mcp_raw_server.py"


def marked(marker: str) -> list[int]:
    """Live processes whose command line carries marker (the sleepers this run started)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--crashes", type=int, default=20)
    p.add_argument("--bob", default=str(ROOT))
    args = p.parse_args()
    sys.path.insert(0, args.bob)
    from bob import ToolCall
    from bob_mcp import McpServerConfig, McpToolPort
    marker = f"bob-orphan-{uuid.uuid4().hex[:8]}"
    cfg = McpServerConfig("r", command=sys.executable, args=(str(RAW), "setsid-crash"),
                          env={"MARKER": marker})
    restarts = []
    with McpToolPort([cfg]) as port:
        t0, c0 = time.monotonic(), time.process_time()
        time.sleep(2.0)
        idle_cpu = (time.process_time() - c0) / (time.monotonic() - t0)
        for _ in range(args.crashes):
            port.call_tool(ToolCall("c", "r__crash", {}), 10)
            t0 = time.monotonic()
            port.list_tools()   # the next turn: restarted
            port.call_tool(ToolCall("c", "r__echo", {"text": "x"}), 10)
            restarts.append(time.monotonic() - t0)
    time.sleep(1.0)   # let SIGKILLed processes be reaped
    orphans = marked(marker)
    print(f"crashes: {args.crashes}  orphans alive after close(): {len(orphans)}")
    print(f"crash -> restarted server answers: median {sorted(restarts)[len(restarts) // 2]:.3f} s")
    print(f"bob's CPU while one server idles: {idle_cpu * 100:.1f}% of a core")
    for pid in orphans:   # clean up after an older bob: only the sleepers this run started
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
