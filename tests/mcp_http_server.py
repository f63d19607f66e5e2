"""A small Streamable HTTP MCP server on 127.0.0.1 for bob's tests, run in a thread:

    with McpHttpServer() as srv:          # srv.url is http://127.0.0.1:PORT/mcp
        srv.status = 401                   # answer every request 401 (or 403)
        srv.restart()                      # forget every session: old ids get 404, as after
                                           # a real restart
Answers JSON (no SSE): initialize (a new Mcp-Session-Id), tools/list (`echo`), tools/call
(`echo` returns its `text`; text "FAIL" gets a JSON-RPC error, HTTP 200); notifications get
202, GET and DELETE 405; an unknown session 404 with `not_found` as the body. `initializes`
counts the sessions started; `requests` the requests seen.
"""
from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    server: _Http

    def log_message(self, *args: object) -> None:   # quiet
        pass

    def do_GET(self) -> None:
        self._send(405, b"")

    do_DELETE = do_GET

    def do_POST(self) -> None:
        owner = self.server.owner
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        owner.requests.append((body.get("method"), dict(self.headers)))
        if owner.status:
            return self._send(owner.status, b'{"error": "unauthorized"}')
        session = self.headers.get("Mcp-Session-Id")
        if body.get("method") == "initialize":
            session = uuid.uuid4().hex
            owner.sessions.add(session)
            owner.initializes += 1
            result = {"protocolVersion": body["params"]["protocolVersion"],
                      "capabilities": {"tools": {}}, "serverInfo": {"name": "http", "version": "1"}}
        elif session not in owner.sessions:
            return self._send(404, owner.not_found)
        elif "id" not in body:
            return self._send(202, b"")
        elif body["method"] == "tools/list":
            result = {"tools": [{"name": "echo", "inputSchema": {"type": "object"}}]}
        elif body["method"] == "tools/call" and body["params"].get("arguments") == {"text": "FAIL"}:
            error = {"code": -32602, "message": "echo will not say FAIL"}   # a JSON-RPC error
            reply = json.dumps({"jsonrpc": "2.0", "id": body["id"], "error": error}).encode()
            return self._send(200, reply, {"Mcp-Session-Id": session})
        elif body["method"] == "tools/call":
            text = body["params"].get("arguments", {}).get("text", "")
            result = {"content": [{"type": "text", "text": text}]}
        else:
            result = {}
        reply = json.dumps({"jsonrpc": "2.0", "id": body["id"], "result": result}).encode()
        self._send(200, reply, {"Mcp-Session-Id": session})

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class ForgetOnCall(set):
    """Sessions for `McpHttpServer.sessions` that a server forgets before each tools/call (it
    restarts in a loop): initialize and tools/list work, every call answers 404."""

    def __init__(self, requests: list) -> None:
        super().__init__()
        self.requests = requests

    def __contains__(self, session: object) -> bool:
        return self.requests[-1][0] != "tools/call" and super().__contains__(session)


class _Http(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default listen backlog is 5: 20 calls at once overflowed it, and a
    # connection the kernel gave up on failed the session (`ReadError`), as no real server would
    request_queue_size = 128
    owner: McpHttpServer


class McpHttpServer:
    """The server, serving from a thread until close()."""

    def __init__(self) -> None:
        self.status = 0
        self.sessions: set[str] = set()
        self.not_found = b'{"error": "unknown session"}'   # the body of a 404 (not JSON-RPC)
        self.initializes = 0
        self.requests: list[tuple[str | None, dict[str, str]]] = []
        self._http = _Http(("127.0.0.1", 0), _Handler)
        self._http.owner = self
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}/mcp"
        self._thread = threading.Thread(target=self._http.serve_forever,   # close() waits
                                        kwargs={"poll_interval": 0.01}, daemon=True)  # a poll
        self._thread.start()

    def restart(self) -> None:
        """Forget every session, as a restarted server does."""
        self.sessions.clear()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def __enter__(self) -> McpHttpServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
