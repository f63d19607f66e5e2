"""A hand-written MCP stdio server that lists many tools, for bob's tool cap.

    python tests/mcp_many_tools_server.py TOOLS [PER_PAGE [MARKER]]

Lists TOOLS tools named `t0`, `t1`, ... in pages of PER_PAGE (default: all in one page), each
with a small schema, as a big server (hundreds of endpoints generated from an API spec) does.
Tool `t0` returns its `text` argument; tool `t1` makes the list `total` tools long and sends
notifications/tools/list_changed. MARKER is ignored (tests find the process by it).
"""
import json
import sys

TOTAL = int(sys.argv[1])
PER_PAGE = int(sys.argv[2]) if len(sys.argv) > 2 else TOTAL
SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}}


def answer(method: str, params: dict) -> dict:
    global TOTAL
    if method == "initialize":
        return {"protocolVersion": params.get("protocolVersion"), "capabilities": {"tools": {}},
                "serverInfo": {"name": "many", "version": "1"}}
    if method == "tools/list":
        start = int(params.get("cursor") or 0)
        end = min(start + PER_PAGE, TOTAL)
        page = {"tools": [{"name": f"t{i}", "description": f"Tool {i}.", "inputSchema": SCHEMA}
                          for i in range(start, end)]}
        if end < TOTAL:
            page["nextCursor"] = str(end)
        return page
    if method == "tools/call":
        arguments = params.get("arguments") or {}
        if params.get("name") == "t1":
            TOTAL = int(arguments["total"])
            send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        return {"content": [{"type": "text", "text": arguments.get("text", "")}]}
    return {}


def send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    for line in sys.stdin:
        msg = json.loads(line)
        if "id" in msg and "method" in msg:
            result = answer(msg["method"], msg.get("params") or {})
            send({"jsonrpc": "2.0", "id": msg["id"], "result": result})


if __name__ == "__main__":
    main()
