"""A fake OpenAI-compatible /chat/completions server for tests: real HTTP on 127.0.0.1.

    from fake_openai import FakeOpenAI, tool_calls_reply

    with FakeOpenAI(["hello"]) as srv:                 # one scripted reply
        llm = OpenAICompatLlm("openai:gpt-x", base_url=srv.url, api_key="sk-test")
        ...                                            # srv.url == "http://127.0.0.1:PORT/v1"
        assert srv.requests[0]["body"]["model"] == "gpt-x"

API
    FakeOpenAI(replies=())   start serving at once on a free port (a threaded http.server,
                             HTTP/1.1 keep-alive); a context manager that closes on exit.
    .url                     "http://127.0.0.1:PORT/v1" (any path is accepted, POST or GET).
    .push(*replies)          append replies; each request consumes the next one, in order.
    .requests                list of {"path", "method", "headers", "body", "client_port"} in
                             arrival order (the same client_port means a reused connection);
                             "headers" is a dict with lower-cased keys whose lookups ignore case
                             (h["Authorization"] works); "body" is the parsed JSON, or the raw
                             text if it is not JSON, or None if empty.
    .arrived                 threading.Event set whenever a request arrives (clear it yourself).
    .wait_for_requests(n, timeout=2.0) -> bool   True once n requests have arrived.
    .release()               unblock the requests hanging on HANG right now (they are dropped).
    .close()                 stop serving, release hanging/slow handlers, cut open connections,
                             free the port. Idempotent; never hangs.

Replies (what a request gets)
    "text"                   200 chat completion: assistant content "text", finish_reason
                             "stop", usage prompt_tokens 10 / completion_tokens 5.
    {"status": 429, "headers": {"Retry-After": "0.05"}, "body": {...} or "text"}
                             a raw response; body JSON-encoded unless a str (headers optional,
                             Content-Type defaults to application/json, text/plain for a str).
    {"stream": [chunk, ...], "delay_s": 0.0, "drop": False, "done": True}
                             200 text/event-stream, chunked. Each chunk is a dict (sent as
                             "data: <json>\\n\\n") or a str (sent verbatim). "delay_s" waits before
                             every chunk after the first. Then "data: [DONE]\\n\\n" unless
                             "done" is False (the stream then ends cleanly without it) or "drop"
                             is True (the connection is cut mid-response, no [DONE], no end).
                             "hold": True sends [DONE] and then keeps the connection open
                             without ending the response, until .release() or .close().
    {"raw": fn}              misbehave at the byte level: fn(write, stop) is called instead of
                             a response; write(bytes) sends bytes as they are (status line and
                             headers included), stop is a threading.Event set by .close() (wait
                             on it to pace writes). The connection is closed afterwards.
    FakeOpenAI.HANG          the handler blocks (no response at all) until .release() or
                             .close(); then the connection is dropped.
    any other dict           sent as the 200 JSON body as is.
    callable(body) -> reply  called with the parsed request body; its result is served.
    (no reply left)          500 {"error": {"message": "fake server: no scripted reply left"}}.

Helpers: completion(content, ...) builds a completion dict; tool_calls_reply([("name", {args}),
...]) a completion with tool_calls (a str instead of the args dict is sent as the raw arguments
string); stream_reply(["Hel", "lo"]) a "stream" reply of text deltas; chunk(...) one SSE chunk.
"""
from __future__ import annotations

import collections
import json
import socket
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["FakeOpenAI", "completion", "tool_calls_reply", "stream_reply", "chunk"]

NO_REPLY_LEFT = {"error": {"message": "fake server: no scripted reply left",
                           "type": "server_error"}}


# ---- 1. Reply builders ----------------------------------------------------------------------

def completion(content: str | None = "", *, tool_calls: list | None = None,
               finish_reason: str | None = "stop", prompt_tokens: int = 10,
               completion_tokens: int = 5, model: str = "fake-model") -> dict:
    """A /chat/completions response body (usage omitted when prompt_tokens is None)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    body: dict[str, Any] = {
        "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}]}
    if prompt_tokens is not None:
        body["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    return body


def tool_calls_reply(calls: list[tuple[str, Any]], content: str | None = None,
                     **kw: Any) -> dict:
    """A completion whose message carries these (name, arguments) tool calls, ids call_1..."""
    wire = [{"id": f"call_{i}", "type": "function",
             "function": {"name": name,
                          "arguments": args if isinstance(args, str) else json.dumps(args)}}
            for i, (name, args) in enumerate(calls, 1)]
    kw.setdefault("finish_reason", "tool_calls")
    return completion(content, tool_calls=wire, **kw)


def chunk(content: str | None = None, *, tool_calls: list | None = None,
          finish_reason: str | None = None, usage: dict | None = None,
          role: str | None = None) -> dict:
    """One chat.completion.chunk; pass usage alone for the final include_usage chunk."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    body: dict[str, Any] = {"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                            "created": 0, "model": "fake-model", "choices": []}
    if delta or finish_reason:
        body["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
    if usage is not None:
        body["usage"] = usage
    return body


def stream_reply(pieces: list[str], *, finish_reason: str | None = "stop",
                 usage: tuple[int, int] | None = (10, 5), **opts: Any) -> dict:
    """A "stream" reply: a role chunk, one chunk per text piece, finish, usage chunk."""
    chunks = [chunk(role="assistant", content="")] + [chunk(p) for p in pieces]
    if finish_reason:
        chunks.append(chunk(finish_reason=finish_reason))
    if usage:
        chunks.append(chunk(usage={"prompt_tokens": usage[0], "completion_tokens": usage[1],
                                   "total_tokens": sum(usage)}))
    return {"stream": chunks, **opts}


# ---- 2. The server ------------------------------------------------------------------------------

class _Headers(dict):
    """A dict of lower-cased header names whose lookups ignore case."""

    def __getitem__(self, key: str) -> str:
        return super().__getitem__(key.lower())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and super().__contains__(key.lower())

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key.lower(), default)


class _Drop(Exception):
    """Cut the connection without a (complete) response."""


class FakeOpenAI:
    """A threaded fake OpenAI-compatible server on 127.0.0.1 (see the module docstring)."""

    HANG = object()

    def __init__(self, replies: Any = ()):
        self.requests: list[dict[str, Any]] = []
        self.arrived = threading.Event()
        self._replies = collections.deque(replies)
        self._lock = threading.Condition()
        self._closed = threading.Event()
        self._release = threading.Event()
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self),
                                           bind_and_activate=False)
        self._server.request_queue_size = 64   # 16 callers at once are not reset (listen's 5)
        self._server.server_bind()
        self._server.server_activate()
        self._server.daemon_threads = True
        self._server.handle_error = _quiet_error  # a client hanging up is not news
        self._server.block_on_close = False
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.01}, daemon=True,
                                        name=f"fake-openai-{self.port}")
        self._thread.start()

    def __enter__(self) -> FakeOpenAI:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def push(self, *replies: Any) -> None:
        """Append replies to the script."""
        with self._lock:
            self._replies.extend(replies)

    def wait_for_requests(self, n: int, timeout: float = 2.0) -> bool:
        """Block until at least n requests arrived (True) or timeout (False)."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self.requests) >= n, timeout)

    def release(self) -> None:
        """Unblock every handler hanging on HANG now; later HANG replies block again."""
        with self._lock:
            event, self._release = self._release, threading.Event()
        event.set()

    def close(self) -> None:
        """Stop serving, release blocked handlers, cut connections, free the port."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.release()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for sock in conns:
            _shut(sock)
        for t in threads:
            t.join(timeout=1.0)
        self._thread.join(timeout=1.0)

    # -- called by the handler threads --

    def _record(self, entry: dict[str, Any]) -> Any:
        with self._lock:
            self.requests.append(entry)
            reply = self._replies.popleft() if self._replies else None
            self._lock.notify_all()
        self.arrived.set()
        return reply

    def _track(self, sock: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._conns.add(sock)
                self._threads.add(threading.current_thread())
            else:
                self._conns.discard(sock)
                self._threads.discard(threading.current_thread())

    def _hang(self) -> None:
        with self._lock:
            event = self._release
        if not self._closed.is_set():
            event.wait(30.0)  # bounded, so a forgotten server never pins a thread forever
        raise _Drop()


def _quiet_error(request: Any, client_address: Any) -> None:
    if not isinstance(sys.exc_info()[1], OSError):
        traceback.print_exc()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# ---- 3. The request handler ---------------------------------------------------------------------

def _make_handler(server: FakeOpenAI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # headers and body go in separate writes: without this, Nagle + delayed ACK add 40 ms
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server._track(self.connection, True)

        def finish(self) -> None:
            try:
                super().finish()
            finally:
                server._track(self.connection, False)

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._handle()

        def do_POST(self) -> None:
            self._handle()

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length).decode("utf-8", "replace") if length else ""
            try:
                body: Any = json.loads(raw) if raw else None
            except ValueError:
                body = raw
            headers = _Headers((k.lower(), v) for k, v in self.headers.items())
            reply = server._record({"path": self.path, "method": self.command,
                                    "headers": headers, "body": body,
                                    "client_port": self.client_address[1]})
            try:
                self._serve(reply, body)
            except (_Drop, OSError):
                self.close_connection = True
                _shut(self.connection)

        def _serve(self, reply: Any, body: Any) -> None:
            while callable(reply) and reply is not FakeOpenAI.HANG:
                reply = reply(body)
            if reply is None:
                self._send(500, {}, NO_REPLY_LEFT)
            elif reply is FakeOpenAI.HANG:
                server._hang()
            elif isinstance(reply, str):
                self._send(200, {}, completion(reply))
            elif isinstance(reply, dict) and "raw" in reply:
                self.close_connection = True
                reply["raw"](self.wfile.write, server._closed)
            elif isinstance(reply, dict) and "stream" in reply:
                self._stream(reply)
            elif isinstance(reply, dict) and "status" in reply:
                self._send(reply["status"], reply.get("headers") or {}, reply.get("body", ""))
            elif isinstance(reply, dict):
                self._send(200, {}, reply)
            else:
                raise TypeError(f"fake_openai: unknown reply {reply!r}")

        def _send(self, status: int, headers: dict, body: Any) -> None:
            is_text = isinstance(body, str)
            data = (body if is_text else json.dumps(body)).encode()
            self.send_response(status)
            hdrs = {"Content-Type": "text/plain" if is_text else "application/json", **headers}
            for k, v in hdrs.items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, reply: dict) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            delay = float(reply.get("delay_s", 0.0))
            for i, item in enumerate(reply["stream"]):
                if i and delay and server._closed.wait(delay):
                    raise _Drop()
                self._chunk(item if isinstance(item, str) else f"data: {json.dumps(item)}\n\n")
            if reply.get("drop"):
                raise _Drop()
            if reply.get("done", True):
                self._chunk("data: [DONE]\n\n")
            if reply.get("hold"):
                server._hang()
            self.wfile.write(b"0\r\n\r\n")

        def _chunk(self, text: str) -> None:
            data = text.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    return Handler
