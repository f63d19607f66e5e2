"""A hand-written MCP stdio server for bob's tests: JSON-RPC lines, broken on purpose.

    python tests/mcp_raw_server.py MODE...

Modes: `null-result` / `array-result` (tools/call answered with "result": null / [...]),
`pages` (tools/list pages forever), `old-protocol` (initialize answers version 1999-01-01),
`no-schema` (a tool without inputSchema), `twice` (the same tool listed twice), `clash` (tools
`a.b` and `a_b`), `prefixed` (a tool `x__echo`), `bad-level` (notifications/message with an
invalid level quoting API_KEY, 200 times, on every call), `described` (a description and a
schema default quoting API_KEY),
`setsid-crash` (a setsid grandchild at start, tool `crash` exits at once), `child` (a grandchild
at start that holds only stderr, like `npx` spawning node), `banner` (non-JSON lines quoting
API_KEY on stdout at start, and a tool `noise` that writes one and invalid UTF-8), `noisy` (stderr
lines with terminal controls, 100,000 characters long, then `crash` exits), `die-soon` (exits
0.5 s after its first tools/list), `relist-slow` (each tools/call sends
notifications/tools/list_changed; each later tools/list is answered 2 s late, listing one more
tool, `added`), `stubborn` (ignores
SIGTERM and stays up after stdin ends, until killed), `goodbye` (writes "raw server: goodbye"
on stderr as its stdin ends: bob is stopping it).
Tool `echo` returns its `text` argument; `env` the value of the environment variable `name`.
Mode `lifecycle` adds tools `pid` (the server's pid) and `die` (writes "raw server: dying with
code N" on stderr and exits N).
The grandchildren's command lines carry $MARKER; other arguments are ignored (tests pass one to
find the server in /proc).
"""
import json
import os
import signal
import subprocess
import sys
import threading

MODES = set(sys.argv[1:])
SECRET = os.environ.get("API_KEY", "")
LISTED = []   # one item per tools/list received
SENDING = threading.Lock()
UNANSWERED = object()   # what answer() returns for a request left without an answer


def send(message: dict) -> None:
    with SENDING:   # one line at a time: a Timer thread sends too
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def garbage(data: bytes) -> None:
    """Bytes on stdout between messages, as a server's stray prints."""
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def tools() -> list[dict]:
    schema = {"type": "object", "properties": {"text": {"type": "string"}}}
    named = {"type": "object", "properties": {"name": {"type": "string"}}}
    coded = {"type": "object", "properties": {"code": {"type": "integer"}}}
    listed = [{"name": "echo", "description": "Echo text.", "inputSchema": schema},
              {"name": "crash", "inputSchema": {"type": "object"}},
              {"name": "env", "description": "An environment variable.", "inputSchema": named}]
    if "lifecycle" in MODES:
        listed += [{"name": "pid", "inputSchema": {"type": "object"}},
                   {"name": "die", "inputSchema": coded}]
    if "no-schema" in MODES:
        listed.append({"name": "bare", "description": "no inputSchema"})
    if "twice" in MODES:
        listed.append(listed[0])
    if "clash" in MODES:
        listed += [{"name": n, "inputSchema": {"type": "object"}} for n in ("a.b", "a_b")]
    if "banner" in MODES:
        listed.append({"name": "noise", "inputSchema": {"type": "object"}})
    if "prefixed" in MODES:
        listed.append({"name": "x__echo", "inputSchema": {"type": "object"}})
    if "described" in MODES:
        listed.append({"name": "leaky", "description": f"Uses the key {SECRET}.", "inputSchema": {
            "type": "object", "properties": {"key": {"type": "string", "default": SECRET}}}})
    return listed


def answer(msg: dict) -> dict | None:
    method, params = msg.get("method"), msg.get("params") or {}
    if method == "initialize":
        version = "1999-01-01" if "old-protocol" in MODES else params.get("protocolVersion")
        return {"protocolVersion": version, "capabilities": {"tools": {}},
                "serverInfo": {"name": "raw", "version": "1"}}
    if method == "tools/list":
        LISTED.append(1)
        if "relist-slow" in MODES and len(LISTED) > 1:
            later = {"tools": [*tools(), {"name": "added", "inputSchema": {"type": "object"}}]}
            late = {"jsonrpc": "2.0", "id": msg["id"], "result": later}
            threading.Timer(2.0, send, [late]).start()
            return UNANSWERED
        if "die-soon" in MODES:
            threading.Timer(0.5, os._exit, [3]).start()
        if "pages" in MODES:
            return {"tools": tools() if not params.get("cursor") else [],
                    "nextCursor": str(int(params.get("cursor") or 0) + 1)}
        return {"tools": tools()}
    if method == "tools/call":
        if params.get("name") == "crash":
            if "noisy" in MODES:
                for _ in range(8):
                    sys.stderr.write("\x1b]0;owned\x07\x1b[2J" + "x" * 100_000 + "\n")
                sys.stderr.flush()
            os._exit(3)
        if "relist-slow" in MODES:
            send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        if "bad-level" in MODES:
            for _ in range(200):
                send({"jsonrpc": "2.0", "method": "notifications/message",
                      "params": {"level": f"loud-{SECRET}", "data": "hi"}})
        if "null-result" in MODES:
            return None
        if "array-result" in MODES:
            return ["not", "an", "object"]
        arguments = params.get("arguments") or {}
        if params.get("name") == "die":
            print(f"raw server: dying with code {arguments['code']}", file=sys.stderr, flush=True)
            os._exit(arguments["code"])
        if params.get("name") == "noise":
            garbage(f"DEBUG: key is {SECRET}\n".encode() + b"\x80\xff bad bytes\n")
            return {"content": [{"type": "text", "text": "ok"}]}
        if params.get("name") == "env":
            text = os.environ.get(arguments.get("name", ""), "(unset)")
        elif params.get("name") == "pid":
            text = str(os.getpid())
        else:
            text = arguments.get("text", "")
        return {"content": [{"type": "text", "text": text}]}
    if method == "ping":
        return {}
    return {}


def main() -> None:
    if "setsid-crash" in MODES:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                          os.environ.get("MARKER", "bob-raw")], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    if "child" in MODES:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                          os.environ.get("MARKER", "bob-raw")],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    if "banner" in MODES:
        garbage(f"hostile server v1 starting, key={SECRET}\n== ready ==\n".encode())
    if "stubborn" in MODES:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for line in sys.stdin:
        msg = json.loads(line)
        if "id" in msg and "method" in msg and (result := answer(msg)) is not UNANSWERED:
            send({"jsonrpc": "2.0", "id": msg["id"], "result": result})
    if "goodbye" in MODES:
        print("raw server: goodbye", file=sys.stderr, flush=True)
    if "stubborn" in MODES:
        threading.Event().wait(60)


if __name__ == "__main__":
    main()
