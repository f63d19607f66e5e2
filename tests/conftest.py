"""Shared test helpers, defined once and imported by the test modules (`from conftest import
final`): `wait_until`; JSON-mode replies `tc` and `final`; `ListSink`, an event sink that keeps
events; `assert_well_formed`, the history invariant; `make_llm`, an OpenAICompatLlm on a fake
server; and the fixtures `srv` (a FakeOpenAI server) and `hang` (ports that block until the test
lets them go):

    def test_x(hang):
        release = hang()                  # a threading.Event a blocking port waits on
        ...                               # at teardown every release is set, and the test
                                          # waits until bob's abandoned workers have drained
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bob.py etc., uninstalled too

import bob  # noqa: E402
from fake_openai import FakeOpenAI  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CLI = REPO / "bob_cli.py"
MCP_SERVER = REPO / "tests" / "mcp_server.py"
KEY = "sk-test-" + "s3cret" * 3   # the fake servers' API key (never a real one)


def tc(name: str, **arguments) -> str:
    """A JSON-mode tool_call reply."""
    return json.dumps({"type": "tool_call", "name": name, "arguments": arguments})


def final(text: str) -> str:
    """A JSON-mode final reply."""
    return json.dumps({"type": "final", "content": text})


class ListSink:
    """Keeps every event (thread-safe: text deltas arrive from worker threads)."""

    def __init__(self) -> None:
        self.events: list[bob.AgentEvent] = []
        self._lock = threading.Lock()

    def emit(self, event: bob.AgentEvent) -> None:
        with self._lock:
            self.events.append(event)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]

    def of(self, kind: str) -> list[dict]:
        return [e.data for e in self.events if e.kind == kind]


def assert_well_formed(history: list[bob.Message]) -> None:
    """Every assistant tool call has exactly one tool result, right after it, in call order."""
    i = 0
    while i < len(history):
        m = history[i]
        assert m.role != "tool", f"tool result at {i} follows no assistant call: {m}"
        if m.role == "assistant" and m.tool_calls:
            ids = [c.id for c in m.tool_calls]
            results = history[i + 1:i + 1 + len(ids)]
            assert [r.role for r in results] == ["tool"] * len(ids), history
            assert [r.tool_call_id for r in results] == ids, history
            i += 1 + len(ids)
        else:
            i += 1


def batch(*calls: tuple[str, str, dict], text: str = "") -> bob.LlmResponse:
    """A native-mode reply carrying several tool calls: (id, name, arguments) each."""
    return bob.LlmResponse(text, tuple(bob.ToolCall(i, n, a) for i, n, a in calls))


def cancel_once_entered(entered: threading.Event, token: bob.CancelToken) -> dict:
    """Cancel `token` from another thread as soon as the port is entered; stamp the time."""
    stamp: dict[str, float] = {}

    def fire() -> None:
        if entered.wait(5):
            stamp["t"] = time.monotonic()
            token.cancel()
    threading.Thread(target=fire, daemon=True).start()
    return stamp


def marked_pids(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line carries `marker`."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids


class Counter:
    """Trivial tools that count how often they ran."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def tools(self) -> bob.FunctionTools:
        def echo(x: int = 0, a: int = 0, b: int = 0) -> str:
            """Echo x."""
            self.calls.append(("echo", {"x": x, "a": a, "b": b}))
            return f"echo {x}"

        def fail(n: int = 0) -> str:
            """Always fails."""
            self.calls.append(("fail", {"n": n}))
            raise RuntimeError(f"fail #{n}")

        return bob.FunctionTools([echo, fail])


def agent(replies, *, tools=None, mode="json", events=None, **policy) -> bob.AgentRuntime:
    """A runtime on ScriptedLlm(replies) with a TurnPolicy of the given fields."""
    return bob.AgentRuntime(bob.ScriptedLlm(replies), tools, events=events, action_mode=mode,
                            policy=bob.TurnPolicy(**policy))


def assert_tripped(result: bob.AgentRunResult, reason: bob.GuardReason, field: str) -> None:
    """The turn ended on this guard, says so, and left a well-formed history."""
    assert result.finish_reason is bob.FinishReason.GUARD_EXCEEDED
    assert result.guard_reason is reason
    assert field in result.content, result.content
    assert_well_formed(result.history)


def make_llm(server: FakeOpenAI, **kw) -> bob.OpenAICompatLlm:
    """An OpenAICompatLlm on the fake server, with the test key and fast backoff."""
    kw.setdefault("api_key", KEY)
    kw.setdefault("backoff_base_s", 0.01)
    return bob.OpenAICompatLlm("test:gpt-x", base_url=server.url, **kw)


@pytest.fixture
def srv():
    """A FakeOpenAI server on 127.0.0.1, closed after the test."""
    with FakeOpenAI() as server:
        yield server


def wait_until(predicate, timeout: float = 3.0) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds pass; return its last value.
    (Imported by the test modules: `from conftest import wait_until`.)"""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return predicate()
        time.sleep(0.002)
    return True


@pytest.fixture
def hang():
    """Factory of release events; all are set at teardown, then abandoned workers must end."""
    before = bob.abandoned_workers()
    events: list[threading.Event] = []

    def make() -> threading.Event:
        ev = threading.Event()
        events.append(ev)
        return ev

    yield make
    for ev in events:
        ev.set()
    assert wait_until(lambda: bob.abandoned_workers() <= before), "blocked workers never ended"


class Together:
    """Processes that several tests of a module run, started all at once when the first of
    them asks and each collected by its own test: each takes a second or more of CPU (bob and
    its MCP server each import the MCP SDK), so they run side by side on the second core.

        @pytest.fixture(scope="module")
        def runs():
            with Together({"a": [sys.executable, "-c", "..."], ...}) as started:
                yield started            # a test: started.result("a"), a CompletedProcess
    """

    def __init__(self, commands: dict, env: dict | None = None,   # {key: argv}
                 cwd: dict | None = None) -> None:                # {key: its directory}
        self.procs = {key: subprocess.Popen(command, stdin=subprocess.DEVNULL, text=True,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            env=env, cwd=(cwd or {}).get(key))
                      for key, command in commands.items()}

    def result(self, key, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        proc = self.procs[key]
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def __enter__(self) -> Together:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


# ---- The CLI: config files, runs, a pseudo terminal ----

def child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A clean environment: no API keys but the test one, HOME in the temp dir."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "LANG": "C.UTF-8", "TERM": "dumb", "BOB_TEST_KEY": KEY}
    env.update(extra)
    return env


def xdg_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """child_env with XDG_CONFIG_HOME, XDG_DATA_HOME and XDG_STATE_HOME inside tmp_path."""
    return child_env(tmp_path, XDG_CONFIG_HOME=str(tmp_path / "xc"),
                     XDG_DATA_HOME=str(tmp_path / "xd"), XDG_STATE_HOME=str(tmp_path / "xs"),
                     **extra)


def write_config(tmp_path: Path, srv: FakeOpenAI | None, extra: str = "",
                 runtime: str = "") -> Path:
    """An agent.toml pointing base_url at the fake server; `extra` follows the [llm] keys."""
    url = srv.url if srv else "http://127.0.0.1:9/v1"
    timeout = "" if "turn_timeout_ms" in runtime else "turn_timeout_ms = 5000\n"
    text = (f'[runtime]\ndefault_model = "openai:test"\n{timeout}{runtime}\n'
            f'[llm]\nbase_url = "{url}"\napi_key_env = "BOB_TEST_KEY"\nretry_max = 0\n{extra}')
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


def run_cli(tmp_path: Path, *args: str, stdin: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CLI), *args], check=False, cwd=tmp_path,
                          env=env or child_env(tmp_path), input=stdin,
                          stdin=subprocess.DEVNULL if stdin is None else None,
                          capture_output=True, text=True, timeout=15)


def messages_of(request: dict) -> str:
    return json.dumps(request["body"]["messages"])


# The numbers of poll, select, pselect6 and ppoll, as /proc/PID/syscall shows them.
POLL_SYSCALLS = {"x86_64": ("7", "23", "270", "271"), "aarch64": ("72", "73")}


class Terminal:
    """The CLI on a pseudo terminal (its controlling tty), read with select and a deadline."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None,
                 stdout=None):   # a file: stdout redirected (`bob > file` on a terminal)
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
        self.proc = subprocess.Popen(
            [sys.executable, str(CLI), *args], cwd=tmp_path, env=env or child_env(tmp_path),
            stdin=slave, stdout=stdout or slave, stderr=slave, start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))  # noqa: PLW1509 - no lock
        os.close(slave)                                              # taken: just one syscall
        self.fd, self.seen = master, b""

    def expect(self, text: bytes, timeout: float = 3.0) -> bytes:
        """Read until `text` appears; return everything up to it and consume it."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            ready = select.select([self.fd], [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                raise AssertionError(f"{text!r} not seen in time; output: {self.seen[-600:]!r}")
            try:
                data = os.read(self.fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                data = b""
            if not data:
                raise AssertionError(f"{text!r} not seen before EOF; output: {self.seen!r}")
            self.seen += data
        head, _, self.seen = self.seen.partition(text)
        return head

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait_blocked_reading(self, timeout: float = 1.0) -> None:
        """Wait until the CLI's main thread sleeps in select(): CPython's readline misses a
        SIGINT that lands just before it enters select() (no human is that fast; a test is).
        Seen in wchan, or where the kernel hides it ("0") in the syscall the main thread is
        blocked in; where both are hidden this just waits `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                wchan = Path(f"/proc/{self.proc.pid}/wchan").read_text()
                if "poll" in wchan or "select" in wchan:   # "0" means running, not sleeping
                    return
            with contextlib.suppress(OSError, IndexError):
                call = Path(f"/proc/{self.proc.pid}/syscall").read_text().split()[0]
                if call in POLL_SYSCALLS.get(os.uname().machine, ()):   # else "running"
                    return
            time.sleep(0.005)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        if self.fd is not None:   # once: a test and the fixture that began it may both close
            os.close(self.fd)
            self.fd = None


# ---- CLI runs begun before their tests ask, side by side ----

@dataclasses.dataclass
class Begun:
    path: Path             # its directory
    srv: FakeOpenAI        # its model
    run: Any               # a Popen (collect it with collected()) or a Terminal


@contextlib.contextmanager
def begun_together(tmp_path_factory, begins: dict[str, Callable[[Path, FakeOpenAI], Any]]):
    """Runs of a module's tests that each take a second or more of CPU (a CLI that starts an MCP
    server imports the MCP SDK), begun all at once when the first of their tests asks (a module
    fixture), so that they run side by side on both cores. Each `begin(path, srv)` gets its own
    directory and model, prepares them, and starts its run; the test takes it over:

        @pytest.fixture(scope="module")
        def early(tmp_path_factory):
            with begun_together(tmp_path_factory, {"a": begin_a, ...}) as runs:
                yield runs            # a test: runs["a"].run, .srv, .path
    """
    with contextlib.ExitStack() as stack:
        runs = {}
        for name, begin in begins.items():
            path, srv = tmp_path_factory.mktemp(name), stack.enter_context(FakeOpenAI())
            runs[name] = Begun(path, srv, begin(path, srv))
            stack.callback(_ended, runs[name].run)
        yield runs


def begun_early(begins: dict[str, Callable[[Path, FakeOpenAI], Any]]):
    """begun_together's usual use, written once: a module fixture beginning `begins` together
    when the first of their tests asks; a module names it `early`:

        early = begun_early({"a": begin_a, ...})   # a test: early["a"].run, .srv, .path
    """
    @pytest.fixture(scope="module")
    def early(tmp_path_factory):
        with begun_together(tmp_path_factory, begins) as runs:
            yield runs
    return early


def _ended(run) -> None:
    """A run that its test left running (the test failed) is ended."""
    if isinstance(run, Terminal):
        run.close()
    elif run.poll() is None:
        run.kill()
        run.communicate()


def cli_begun(cwd: Path, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """The CLI started with stdin piped and empty, not waited for: see collected()."""
    proc = subprocess.Popen([sys.executable, str(CLI), *args], cwd=cwd, text=True, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdin.close()
    proc.stdin = None    # communicate() has nothing to send
    return proc


def collected(proc: subprocess.Popen[str], timeout: float = 15
              ) -> subprocess.CompletedProcess[str]:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
