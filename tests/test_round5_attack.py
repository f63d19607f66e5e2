"""Breaks found attacking what the fifth round landed: the REPL with stdout redirected (`_input`
lends fd 1 to stderr while it reads), request_digest's cache, _run_tool's cached look at
call_tool, the text mask's quick check, and replay reading a recorded reply as a message. The
CLI runs as a real subprocess on a pty against fake_openai; traces are recorded by a real
AgentRuntime into a real JsonlEventSink file."""
from __future__ import annotations

import json
import os
import resource
import types
from pathlib import Path

import pytest

import bob
from conftest import Terminal, final, write_config, xdg_env


def fds(pid: int) -> dict[int, str]:
    """The process's open file descriptors and what each points at."""
    return {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}


# ---- 1. The REPL with stdout redirected ----

def test_a_redirected_repl_with_no_file_descriptor_left_still_reads_lines(tmp_path, srv):
    # _input took a new descriptor (a copy of fd 1) for every prompt: with none left (ulimit -n
    # reached: MCP servers, kept-alive connections), each prompt failed at once, and the REPL
    # said "bob: error: [Errno 24] Too many open files" again and again, forever, at full CPU.
    srv.push(final("ANSWER"))
    write_config(tmp_path, srv)
    with open(tmp_path / "out.txt", "wb") as out:
        term = Terminal(tmp_path, env=xdg_env(tmp_path), stdout=out)
    try:
        term.expect(b"bob> ", timeout=10)
        held = fds(term.proc.pid)
        assert held[1] == held[2]   # fd 1 lent to the terminal, a copy of the file's kept
        assert list(held.values()).count(str(tmp_path / "out.txt")) == 1
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.prlimit(term.proc.pid, resource.RLIMIT_NOFILE, (max(held) + 1, hard))
        term.send(b"hi\r")
        said = term.expect(b"bob> ", timeout=10)
        assert fds(term.proc.pid)[1] == held[2]   # lent again, at the next prompt
        term.send(b"\x04")
        assert term.proc.wait(10) == 0
    finally:
        term.close()
    assert said.count(b"Too many open files") == 1, said   # the turn's, said once
