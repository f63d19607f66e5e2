"""Benchmark: one huge event written by JsonlEventSink into a pipe read as fast as it can be
(`--trace >(gzip > t.gz)`, here `cat > /dev/null`), and a hostile server's error body run
through the adapter's refusal check.

    python bench/sink_pipe.py [MB ...]

1. The sink: for each size (default 5 10 20 40 MB) one `note` event of that much text is
   emitted into a pipe; printed: CPU and wall seconds of emit(). The pipe takes 64 KB a write,
   and emit slices the rest of the line's bytes after each write (line = line[n:]), a copy of
   what is left: quadratic (measured on 2 shared cores: 20 MB 0.32 s, 40 MB 4.2 s, 100 MB 55 s
   of CPU, the turn's thread held all along; a regular file takes one write). Fixed the same
   day (a memoryview, no copy): 5 MB 0.03 s, 10 MB 0.06, 20 MB 0.12, 40 MB 0.27 s of CPU.
2. The adapter: a 400 whose body names reasoning_content every KB (spaces between), to a
   request whose message carried it; printed: seconds in complete() for 1, 4 and 15 MB (under
   the 16 MB max_response_bytes). OpenAICompatLlm._http_failure's regex backtracks over each
   name's next six words and the runs of non-word characters between them: about 0.8 s per MB
   (15 MB: ~12 s), in re, which holds the GIL: the turn's deadline and cancel wait for it.
   Fixed the same day (the words are searched in the error's first 4,096 characters): the
   whole complete(), the body's transfer included, 1 MB 0.09 s, 4 MB 0.31 s, 15 MB 1.12 s.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bob import (AgentEvent, CancelToken, JsonlEventSink, LlmError, LlmRequest,  # noqa: E402
                 Message, OpenAICompatLlm, ToolCall)


def sink_into_a_pipe(mb: int) -> None:
    reader = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    sink = JsonlEventSink(f"/dev/fd/{reader.stdin.fileno()}")
    event = AgentEvent("note", "s", 0, {"text": "a" * (mb << 20)}, 0.0)
    cpu, wall = time.process_time(), time.monotonic()
    sink.emit(event)
    print(f"sink: {mb} MB into a pipe: cpu {time.process_time() - cpu:.2f} s, "
          f"wall {time.monotonic() - wall:.2f} s", flush=True)
    sink.close()
    reader.stdin.close()
    reader.wait()


def adapter_error_body(mb: int) -> None:
    from fake_openai import FakeOpenAI
    history = [Message("user", "2+3?"), Message("assistant", "", (ToolCall(
        "call_1", "add", {"a": 2, "b": 3}),), reasoning="think"),
        Message("tool", "5", tool_call_id="call_1", name="add"), Message("user", "4+4?")]
    body = ("reasoning_content" + " " * 1007) * (mb << 10)
    with FakeOpenAI([{"status": 400, "body": body}]) as srv:
        llm = OpenAICompatLlm("test:x", base_url=srv.url, api_key="sk-bench", retry_max=0)
        wall = time.monotonic()
        try:
            llm.complete(LlmRequest(history, [], None, None), CancelToken())
        except LlmError:
            pass
        print(f"adapter: a {mb} MB error body: {time.monotonic() - wall:.2f} s", flush=True)


if __name__ == "__main__":
    for size in [int(a) for a in sys.argv[1:]] or [5, 10, 20, 40]:
        sink_into_a_pipe(size)
    for size in (1, 4, 15):
        adapter_error_body(size)
