"""The CLI's known gaps of issue 22 that the fourth round's last pass closed: `-v` into a reader
of stderr that left, a remembered flag that does not work. Every run is a real subprocess
against fake_openai, HOME and XDG_* in a temp dir."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import CLI, final, write_config, xdg_env


def gone_reader() -> int:
    """The write end of a pipe whose reader has left (`| head` that exited)."""
    read, write = os.pipe()
    os.close(read)
    return write


def bob(tmp_path: Path, *args: str, **streams) -> subprocess.CompletedProcess[bytes]:
    """The CLI in tmp_path, HOME and XDG_* inside tmp_path; stdout and stderr as given."""
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE} | streams
    try:
        return subprocess.run([sys.executable, str(CLI), *args], cwd=tmp_path, timeout=15,
                              env=xdg_env(tmp_path), stdin=subprocess.DEVNULL, check=False,
                              **streams)
    finally:
        for fd in {streams["stdout"], streams["stderr"]} - {subprocess.PIPE}:
            os.close(fd)


# ---- 1. -v into a reader of stderr that left ----

def test_verbose_into_a_reader_that_left_is_141(tmp_path, srv):
    # `bob -v -p ... 2>&1 | head`: exit 120 (Python could not flush stderr at its exit).
    srv.push(final("the answer"))
    write_config(tmp_path, srv)
    gone = gone_reader()
    assert bob(tmp_path, "-v", "-p", "hi", stdout=gone, stderr=os.dup(gone)).returncode == 141


def test_verbose_into_a_stderr_reader_that_left_is_141_the_answer_whole(tmp_path, srv):
    # `bob -v -p ... 2>&1 >answer.txt | head`: exit 120; the answer and the session are whole.
    srv.push(final("the answer"))
    write_config(tmp_path, srv)
    run = bob(tmp_path, "-v", "-p", "hi", stderr=gone_reader())
    assert run.returncode == 141 and run.stdout == b"the answer\n"
    (session,) = (tmp_path / "xd" / "bob" / "sessions").glob("*.json")
    assert "the answer" in session.read_text()


# ---- 2. a remembered flag that does not work ----

def test_a_remembered_flag_that_fails_says_so_and_how_to_override_it(tmp_path, srv):
    # A hand-edited ID.flags, or a key variable since unset, read as if typed:
    # `bob: error: --model: model 'x' must be 'provider:model'...`; now as the session's flags.
    srv.push(final("one"), final("two"))
    write_config(tmp_path, srv)
    assert bob(tmp_path, "--session", "s1", "-p", "hi", "--model", "local:m").returncode == 0
    flags = tmp_path / "xd" / "bob" / "sessions" / "s1.flags"
    assert json.loads(flags.read_text()) == {"model": "local:m"}
    flags.write_text(json.dumps({"model": "x"}))              # edited by hand
    run = bob(tmp_path, "--session", "s1", "-p", "again")
    error = run.stderr.decode().splitlines()[-1]
    assert run.returncode == 2 and "provider:model" in error, run.stderr
    assert "bob: error: model 'x'" in error, error
    assert error.endswith("(session s1 remembers --model: a flag given again wins, or "
                          "--forget s1)"), error
    flags.write_text(json.dumps({"model": "openai:x", "api_key_env": "GONE"}))   # since unset
    error = bob(tmp_path, "--session", "s1", "-p", "again").stderr.decode().splitlines()[-1]
    assert "GONE" in error and "(session s1 remembers --model --api-key-env: " in error, error
    run = bob(tmp_path, "--session", "s1", "-p", "again", "--model", "local:m",
              "--api-key-env", "BOB_TEST_KEY")   # a flag given wins: the session goes on
    assert run.returncode == 0 and run.stdout == b"two\n", run.stderr
    assert json.loads(flags.read_text()) == {"model": "local:m", "api_key_env": "BOB_TEST_KEY"}


def test_a_typed_flag_that_fails_is_not_blamed_on_the_remembered_ones(tmp_path, srv):
    # `bob --session s1 --base-url notaurl` said `session s1 remembers --model, which fails:
    # --base-url must be ...`: the remembered --model works; the flag typed does not
    srv.push(final("one"))
    write_config(tmp_path, srv)
    assert bob(tmp_path, "--session", "s1", "-p", "hi", "--model", "local:m").returncode == 0
    run = bob(tmp_path, "--session", "s1", "-p", "again", "--base-url", "notaurl")
    error = run.stderr.decode().splitlines()[-1]
    assert run.returncode == 2 and "bob: error: --base-url must be" in error, error
    assert "which fails" not in error, error
    assert error.endswith("(session s1 remembers --model: a flag given again wins, or "
                          "--forget s1)"), error


def test_a_flag_given_that_fails_is_not_blamed_on_the_session(tmp_path, srv):
    srv.push(final("one"))
    write_config(tmp_path, srv)
    assert bob(tmp_path, "--session", "s1", "-p", "hi", "--model", "local:m").returncode == 0
    run = bob(tmp_path, "--session", "s1", "-p", "again", "--model", "x")
    assert run.returncode == 2 and "remembered" not in run.stderr.decode(), run.stderr
