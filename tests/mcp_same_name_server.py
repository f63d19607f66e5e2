"""A hand-written MCP stdio server that lists TOOLS tools all named `same` (a server's bug), and
changes its list on every call (notifications/tools/list_changed), for bob's name-clash warning.

    python tests/mcp_same_name_server.py TOOLS
"""
import json
import sys

TOTAL = int(sys.argv[1])


def send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def answer(method: str, params: dict) -> dict:
    if method == "initialize":
        return {"protocolVersion": params.get("protocolVersion"), "capabilities": {"tools": {}},
                "serverInfo": {"name": "same", "version": "1"}}
    if method == "tools/list":
        return {"tools": [{"name": "same", "description": f"copy {i}",
                           "inputSchema": {"type": "object"}} for i in range(TOTAL)]}
    if method == "tools/call":
        send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        return {"content": [{"type": "text", "text": "ok"}]}
    return {}


for line in sys.stdin:
    msg = json.loads(line)
    if "id" in msg and "method" in msg:
        send({"jsonrpc": "2.0", "id": msg["id"], "result": answer(msg["method"],
                                                                  msg.get("params") or {})})
