"""Benchmark: what OpenAICompatLlm.complete() costs on top of a bare requests.Session.post.

    /tmp/venv/bin/python bench/llm_overhead.py [--calls 500] [--messages 12]

A stub server (a subprocess, so it does not share our GIL) answers every POST with one canned
chat completion over keep-alive HTTP/1.1. We time, interleaved call by call so drift hits both
alike: (a) the adapter's complete() and (b) a bare session.post of the same JSON bytes that
reads the body. Overhead = median(a) - median(b). Target: under 0.3 ms per call.
It also times the adapter's own work without the network (request body + reply parsing), and
runs 16 callers at once on one adapter (more than its pool of 10 connections), 10 rounds, with
retry_max=0 so that every transport error shows: before issue 21, about 6 of 16 calls of a round
failed with "[Errno 9] Bad file descriptor" (and with retries, were billed again).

Sections: 1. The stub server  2. Timing  3. Main
"""
from __future__ import annotations

import argparse
import json
import socket
import socketserver
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPLY = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": '{"type": "final", "content": "' + "ok " * 40 + '"}'}}],
    "usage": {"prompt_tokens": 321, "completion_tokens": 42, "total_tokens": 363}}).encode()
RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: keep-alive\r\n\r\n%s" % (len(REPLY), REPLY))


# ---- 1. The stub server -------------------------------------------------------------------------

class _Stub(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = sock.recv(65536)
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            while len(buf) < length:
                buf += sock.recv(65536)
            buf = buf[length:]
            sock.sendall(RESPONSE)


def serve() -> None:
    socketserver.ThreadingTCPServer.daemon_threads = True
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Stub) as srv:
        print(srv.server_address[1], flush=True)
        srv.serve_forever()


# ---- 2. Timing ----------------------------------------------------------------------------------

def measure(calls: int, n_messages: int) -> None:
    import requests

    from bob import CancelToken, LlmRequest, Message
    from bob import OpenAICompatLlm
    stub = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE,
                            text=True)
    try:
        port = int(stub.stdout.readline())
        url = f"http://127.0.0.1:{port}/v1"
        llm = OpenAICompatLlm("bench:model", base_url=url, api_key="sk-bench")
        msgs = [Message("system", "You are a helpful assistant. " * 20)] + [
            Message("user" if i % 2 == 0 else "assistant", f"message {i} " * 30)
            for i in range(n_messages - 1)]
        req = LlmRequest(msgs, [], "json", None)
        payload = json.dumps(llm._to_wire(req), separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}
        bare = requests.Session()
        cancel = CancelToken()

        def adapter_call() -> None:
            llm.complete(req, cancel)

        def bare_call() -> None:
            bare.post(url + "/chat/completions", data=payload, headers=headers).content

        for _ in range(100):  # warm up both connections and caches
            adapter_call()
            bare_call()
        a, b = [], []
        for _ in range(calls):
            for fn, out in ((adapter_call, a), (bare_call, b)):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        own = []
        for _ in range(calls):
            t0 = time.perf_counter()
            json.dumps(llm._to_wire(req), separators=(",", ":")).encode()
            llm._from_wire(REPLY)
            own.append(time.perf_counter() - t0)
        ma, mb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
        print(f"calls={calls} messages={n_messages} request_bytes={len(payload)}")
        print(f"adapter complete()     median {ma:.3f} ms")
        print(f"bare Session.post      median {mb:.3f} ms")
        print(f"overhead               median {ma - mb:.3f} ms  (target < 0.3 ms)")
        print(f"adapter's own work     median {statistics.median(own) * 1e3:.3f} ms "
              "(request body + JSON + reply parsing, no network)")
        callers(OpenAICompatLlm("bench:model", base_url=url, api_key="sk-bench", retry_max=0),
                req)
    finally:
        stub.kill()
        stub.wait()


def callers(llm, req, n: int = 16, rounds: int = 10) -> None:
    """n threads calling complete() at once, `rounds` times: answers and errors."""
    import threading

    from bob import CancelToken
    answers, errors = [], []

    def call(barrier: threading.Barrier) -> None:
        barrier.wait()
        try:
            answers.append(llm.complete(req, CancelToken()))
        except Exception as e:
            errors.append(str(e))
    t0 = time.perf_counter()
    for _ in range(rounds):
        barrier = threading.Barrier(n)
        threads = [threading.Thread(target=call, args=(barrier,)) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    took = time.perf_counter() - t0
    print(f"{n} callers x {rounds} rounds: {len(answers)} answers, {len(errors)} errors in "
          f"{took * 1000:.0f} ms" + (f" (first: {errors[0][:80]})" if errors else ""))


# ---- 3. Main ------------------------------------------------------------------------------------

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--messages", type=int, default=12)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    serve() if args.serve else measure(args.calls, args.messages)
