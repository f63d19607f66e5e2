"""Benchmark: peak memory of OpenAICompatLlm refusing bodies far over max_response_bytes.

    python bench/hostile_llm.py [--mb 200] [--bomb-gb 2] [--only error,redirect,...]

A raw server (a subprocess, so its memory is not ours) answers each POST by its path: /big with
a 200 MB JSON body, /stream with 200 MB of Server-Sent Events, /bomb with a gzip body (about
2 MB) that inflates to 2 GB. The adapter (default limit, 16 MB) must refuse each with an LlmError
naming the limit. Printed: this process's peak RSS (ru_maxrss) before and after each case, and
the time each refusal took. Before the limit, a 200 MB body took about 600 MB of RSS.
Issue 21's cases come first: /error, an HTTP 500 with 15 MB of "ab ab ..." (quoting 300 chars
of it split it all into words: +400 MB); /redirect, a 307 with a 200 MB body; /gzredirect, a
307 with a gzip body inflating to 300 MB (requests read both whole before following: +400 MB
and +600 MB). bob follows no redirect: an LlmError naming the Location. Peak RSS only grows, so
run one case alone (--only) to see its own peak.

Sections: 1. The server  2. Measure and report
"""
from __future__ import annotations

import argparse
import functools
import resource
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bob  # noqa: E402  (after the path line, so the bench runs from a plain checkout)

PIECE = 1024 * 1024


# ---- 1. The server ------------------------------------------------------------------------------

@functools.lru_cache(maxsize=2)  # built once per server, not per request
def gzip_of_zeros(size: int) -> bytes:
    """A gzip stream of `size` zero bytes, built a piece at a time."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(PIECE)
    return b"".join([z.compress(zeros) for _ in range(size // PIECE)] + [z.flush()])


def serve(mb: int, bomb_gb: int) -> None:
    """Answer POSTs forever on a free port (printed first) until stdin closes."""
    bomb = gzip_of_zeros(bomb_gb * 1024 * PIECE)
    gzip_of_zeros(300 * PIECE)  # /gzredirect's, built before any clock starts
    srv = socket.create_server(("127.0.0.1", 0))
    print(srv.getsockname()[1], len(bomb), flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            request = conn.recv(65536)
            path = request.split(b" ", 2)[1]
            try:
                send(conn, path, mb, bomb)
            except OSError:  # the client hung up: that is the point
                pass


def send(conn: socket.socket, path: bytes, mb: int, bomb: bytes) -> None:
    if path.startswith(b"/error"):
        body = b"ab " * (5 * PIECE)
        conn.sendall(b"HTTP/1.1 500 Oops\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                     b"\r\n%s" % (len(body), body))
        return
    if path.startswith(b"/redirect") or path.startswith(b"/gzredirect"):
        gz = path.startswith(b"/gzredirect")
        body = gzip_of_zeros(300 * PIECE) if gz else b" " * PIECE
        conn.sendall(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /big/chat/completions\r\n"
                     b"%sContent-Length: %d\r\n\r\n" % (b"Content-Encoding: gzip\r\n" if gz
                                                       else b"", len(body) * (1 if gz else mb)))
        for _ in range(1 if gz else mb):
            conn.sendall(body)
        return
    if path.startswith(b"/bomb"):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: "
                     b"gzip\r\nContent-Length: %d\r\n\r\n%s" % (len(bomb), bomb))
        return
    stream = path.startswith(b"/stream")
    kind = b"text/event-stream" if stream else b"application/json"
    event = b'data: {"choices":[{"delta":{"content":"' + b"x" * 1000 + b'"}}]}\n\n'
    piece = event * (PIECE // len(event)) if stream else b" " * PIECE  # whole events
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
                 % (kind, mb * len(piece)))
    for _ in range(mb):
        conn.sendall(piece)


# ---- 2. Measure and report ----------------------------------------------------------------------

def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--bomb-gb", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated cases to run")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.mb, args.bomb_gb)
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--mb", str(args.mb),
                               "--bomb-gb", str(args.bomb_gb)], stdout=subprocess.PIPE,
                              stdin=subprocess.PIPE, text=True)
    try:
        port, bomb_size = map(int, server.stdout.readline().split())
        request = bob.LlmRequest([bob.Message("user", "hi")], [], None, None)
        bob.OpenAICompatLlm("bench:x", base_url="http://127.0.0.1:9/v1")  # imports requests
        print(f"peak RSS before any request (requests imported): {peak_mb():.0f} MB")
        for path, what in (("error", "HTTP 500 with 15 MB of 'ab ab ...'"),
                           ("redirect", f"307 with a {args.mb} MB body"),
                           ("gzredirect", "307 with a gzip body inflating to 300 MB"),
                           ("big", f"{args.mb} MB JSON body"),
                           ("stream", f"{args.mb} MB of SSE events (stream=True)"),
                           ("bomb", f"gzip bomb, {bomb_size / PIECE:.1f} MB inflating to "
                                    f"{args.bomb_gb} GB")):
            if args.only and path not in args.only.split(","):
                continue
            llm = bob.OpenAICompatLlm("bench:x", base_url=f"http://127.0.0.1:{port}/{path}",
                                      stream=path == "stream", retry_max=0)
            t0 = time.perf_counter()
            try:
                llm.complete(request, bob.CancelToken())
                outcome = "ACCEPTED (wrong)"
            except bob.LlmError as e:
                outcome = ("refused" if "max_response_bytes" in str(e) or path in (
                    "error", "redirect", "gzredirect") else "other error") + f": {str(e)[:90]}"
            took = time.perf_counter() - t0
            print(f"{what}: {outcome} in {took * 1000:.0f} ms; peak RSS now {peak_mb():.0f} MB "
                  f"(limit {llm.max_response_bytes // PIECE} MB)")
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
