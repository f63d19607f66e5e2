"""A hand-written MCP stdio server (no SDK import: it starts in milliseconds) that holds what a
test waits for until the test lets it go, so that no test waits out a fixed time.

    python tests/mcp_held_server.py PATH MODE...

PATH names the files it shares with the test: it creates PATH.running as it starts (a test
waits for that file, cheaper than scanning /proc); it holds what its modes say until
PATH.release exists (the test creates it); tool `slow` creates PATH.started and never answers,
and a notifications/cancelled creates PATH.cancelled. Modes: `hang` (never answers initialize; ends
with stdin), `held-start` (answers initialize once released), `held-relist` (each tools/call
sends notifications/tools/list_changed; each later tools/list is answered once released,
listing one more tool, `added`), `held-stop` (ignores SIGTERM and stays up after stdin ends,
until released or killed), `fail` (an error on stderr, exit 1). Tool `echo` returns its `text`.
Other arguments are ignored (tests pass a marker to find the server in /proc).
"""
import json
import os
import signal
import sys
import threading
import time

PATH, MODES = sys.argv[1], set(sys.argv[2:])
SENDING = threading.Lock()
LISTED = []   # one item per tools/list received
TOOLS = [{"name": "echo", "inputSchema": {"type": "object",
                                          "properties": {"text": {"type": "string"}}}},
         {"name": "slow", "inputSchema": {"type": "object"}}]


def send(message: dict) -> None:
    with SENDING:   # one line at a time: a releasing thread sends too
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def released() -> None:
    while not os.path.exists(PATH + ".release"):
        time.sleep(0.01)


def once_released(message: dict) -> None:
    """Send message on a thread, once the test creates PATH.release."""
    threading.Thread(target=lambda: (released(), send(message)), daemon=True).start()


def touch(suffix: str) -> None:
    open(PATH + suffix, "w").close()


def answer(msg: dict) -> dict | None:
    """The result for a request, or None: answered later (held), or never."""
    method, params = msg["method"], msg.get("params") or {}
    if method == "initialize":
        result = {"protocolVersion": params.get("protocolVersion"),
                  "capabilities": {"tools": {"listChanged": True}},
                  "serverInfo": {"name": "held", "version": "1"}}
        if "hang" in MODES:
            return None
        if "held-start" in MODES:
            return once_released({"jsonrpc": "2.0", "id": msg["id"], "result": result})
        return result
    if method == "tools/list":
        LISTED.append(1)
        if "held-relist" in MODES and len(LISTED) > 1:
            later = {"tools": [*TOOLS, {"name": "added", "inputSchema": {"type": "object"}}]}
            return once_released({"jsonrpc": "2.0", "id": msg["id"], "result": later})
        return {"tools": TOOLS}
    if method == "tools/call":
        if params.get("name") == "slow":
            return touch(".started")
        if "held-relist" in MODES:
            send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        text = (params.get("arguments") or {}).get("text", "")
        return {"content": [{"type": "text", "text": text}]}
    return {}


def main() -> None:
    touch(".running")
    if "fail" in MODES:
        sys.exit("mcp_held_server: failing on purpose")   # exit code 1
    if "held-stop" in MODES:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("method") == "notifications/cancelled":
            touch(".cancelled")
        elif "id" in msg and "method" in msg and (result := answer(msg)) is not None:
            send({"jsonrpc": "2.0", "id": msg["id"], "result": result})
    if "held-stop" in MODES:
        released()


if __name__ == "__main__":
    main()
