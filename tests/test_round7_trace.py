"""Round 7: a trace written into a pipe. JsonlEventSink opened its file without blocking (a FIFO
nobody reads must fail at once, not hang) and wrote so: a line longer than the pipe's buffer
came out cut, and every event after it was lost. Now a line waits for the reader, but a reader
that takes nothing for bob._SINK_WAIT_S fails that event: the turn goes on.

Real parts: a real OS pipe, a real runtime and sink; the CLI case (`--trace >(gzip > t.gz)`)
is tests/test_round7_attack.py's.
Sections: 1. Helpers  2. A pipe's reader, slow or stalled
"""
from __future__ import annotations

import json
import logging
import os
import resource
import threading

import pytest

import bob
from bob import AgentRequest, AgentRuntime, JsonlEventSink, ScriptedLlm

BIG = "x" * 300_000   # one llm_call_completed line: several times a pipe's 64 KB


# ---- 1. Helpers ---------------------------------------------------------------------------------

def run_into(fd: int) -> bob.AgentRunResult:
    """A one-step turn with a 300 KB answer, traced into the pipe's write end `fd`."""
    sink = JsonlEventSink(f"/dev/fd/{fd}")
    rt = AgentRuntime(ScriptedLlm([json.dumps({"type": "final", "content": BIG})]), None,
                      events=sink)
    try:
        return rt.run(AgentRequest("hi"))
    finally:
        sink.close()


# ---- 2. A pipe's reader, slow or stalled --------------------------------------------------------

def test_a_slow_readers_pipe_gets_every_line_whole():
    """The reader begins only once the pipe is full: before, the big line was cut at the
    buffer (BlockingIOError) and no event came after it."""
    r, w = os.pipe()
    full = threading.Event()
    got = []

    def reader():
        full.wait(10)   # set once the turn blocks on the full pipe, or has ended
        with os.fdopen(r, "rb") as f:
            got.append(f.read())
    t = threading.Thread(target=reader)
    t.start()
    timer = threading.Timer(0.3, full.set)   # a reader that takes a moment (not a wait for it:
    timer.start()                            # the test passes at any speed of the reader)
    try:
        result = run_into(w)
    finally:
        os.close(w)
        full.set()
        t.join(10)
    lines = got[0].decode().splitlines()
    kinds = [json.loads(line)["kind"] for line in lines]   # each line whole
    assert result.content == BIG
    assert "turn_started" in kinds and kinds[-1] == "turn_completed"
    assert BIG in next(line for line in lines if '"llm_call_completed"' in line)


def test_a_stalled_readers_pipe_fails_the_event_not_the_turn(monkeypatch, caplog):
    """A reader that never reads: the big line waits _SINK_WAIT_S, then that event's write
    fails (logged, named); the turn ends with its answer. Before the wait existed a blocking
    write would have held the turn for ever."""
    monkeypatch.setattr(bob, "_SINK_WAIT_S", 0.2)
    r, w = os.pipe()
    try:
        with caplog.at_level(logging.WARNING, logger="bob"):
            result = run_into(w)
    finally:
        os.close(w)
        os.close(r)
    assert result.content == BIG
    [warning] = [rec for rec in caplog.records if "failed on" in rec.getMessage()]
    assert "llm_call_completed" in warning.getMessage()
    assert "its reader did not take the line within 0.2 s" in str(warning.exc_info[1])


@pytest.mark.parametrize("size", [10, 100_000])
def test_a_regular_file_trace_is_as_before(tmp_path, size):
    path = tmp_path / "t.jsonl"
    sink = JsonlEventSink(path)
    rt = AgentRuntime(ScriptedLlm([json.dumps({"type": "final", "content": "y" * size})] * 2), None,
                      events=sink)
    rt.run(AgentRequest("hi"))
    rt.run(AgentRequest("again"))   # appended, the file opened once
    sink.close()
    kinds = [json.loads(line)["kind"] for line in path.read_text().splitlines()]
    assert kinds.count("turn_started") == kinds.count("turn_completed") == 2
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_a_process_with_many_open_files_still_writes_its_trace(tmp_path):
    """select() takes no file descriptor past 1023 (ValueError: every event's write failed):
    a program holding many sockets or files has its trace file at a high descriptor."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"this system allows {hard} open files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    held = []
    try:
        while not held or held[-1] < 1030:   # the next descriptors are past select's range
            held.append(os.open(os.devnull, os.O_RDONLY))
        test_a_regular_file_trace_is_as_before(tmp_path, 10)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
