"""Benchmark: how long a cancel takes to reach an MCP server.

    /work/venv/bin/python bench/mcp_cancel.py [--rounds 20]

Calls the `slow` tool of tests/mcp_hostile_server.py through McpToolPort.call_tool with a
CancelToken, cancels it once the server is in the tool, and prints the median and worst time
from cancel() to the server seeing notifications/cancelled (its handler cancelled). Both sides
read time.monotonic(), which on Linux is one clock for all processes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bob import CancelToken, ToolCall  # noqa: E402
from bob_mcp import McpServerConfig, McpToolPort  # noqa: E402


def _wait_for(path: Path, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise SystemExit(f"{path.name} never appeared: the server did not react")
        time.sleep(0.001)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    delays = []
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "cancelled"
        cfg = McpServerConfig("h", command=sys.executable, args=(
            str(ROOT / "tests" / "mcp_hostile_server.py"), "--record", str(record)))
        with McpToolPort([cfg]) as port:
            for _ in range(args.rounds):
                for f in (record, Path(f"{record}.started")):
                    f.unlink(missing_ok=True)
                token = CancelToken()
                worker = threading.Thread(target=port.call_tool, args=(
                    ToolCall("c", "h__slow", {"seconds": 30}), 60), kwargs={"cancel": token})
                worker.start()
                _wait_for(Path(f"{record}.started"))
                t0 = time.monotonic()
                token.cancel()
                _wait_for(record)
                delays.append((float(record.read_text()) - t0) * 1000)
                worker.join(10)
    print(f"cancel -> server sees notifications/cancelled over {args.rounds} rounds: "
          f"median {statistics.median(delays):.1f} ms, worst {max(delays):.1f} ms")


if __name__ == "__main__":
    main()
