"""bob_cli: bob's command line. Reads agent.toml, wires the adapters, runs a REPL or prompts.

    python bob_cli.py --demo                       # no key, no config: a scripted session
    python bob_cli.py                              # REPL on ./agent.toml (/help lists commands)
    python bob_cli.py -p "What is 2 + 40?"         # one turn; only the answer goes to stdout
    printf 'hi\\nand again\\n' | python bob_cli.py   # each line a turn of one session
    python bob_cli.py --session work --trace run.jsonl -v

Exit codes: 0 ok, 1 runtime error, 2 usage or config error (a missing API key included),
3 a guard trip or a cancel ended a one-shot or piped turn, 128+N killed by signal N.

Sections:
    1. Configuration: agent.toml -> Config      4. Shell: MCP tools, turns, commands
    2. Demo: tools, script, event printer       5. Modes: piped, REPL, demo
    3. Terminal sinks: status line, streaming   6. main

Needs bob.py beside it; bob_mcp.py and the `mcp` package only when agent.toml lists MCP servers.
"""
from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import difflib
import io
import json
import logging
import os
import queue
import re
import shutil
import signal
import sys
import threading
import time
import tomllib
import typing
import uuid
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, TextIO

import bob

__all__ = ["Config", "Shell", "load_config", "main"]
__version__ = "0.1.0"   # as in pyproject.toml


# ---- 1. Configuration: agent.toml -> Config ----------------------------------------------------
# Each table has a schema, key -> kind. Errors name the file, the table and the key; values are
# never echoed, since MCP env and headers hold secrets.

_KINDS: dict[str, Callable[[Any], bool]] = {
    "a string": lambda v: isinstance(v, str),
    "a boolean": lambda v: isinstance(v, bool),
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "a list of strings": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "a table of strings": lambda v: isinstance(v, dict) and all(
        isinstance(x, str) for x in v.values()),
    "an array of tables": lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
    "a table": lambda v: isinstance(v, dict),
}
_POLICY_KEYS = [f.name for f in fields(bob.TurnPolicy)]
_SCHEMA: dict[str, dict[str, str]] = {
    "top level": dict.fromkeys(("runtime", "llm", "store", "policy", "mcp"), "a table"),
    "runtime": {"default_model": "a string", "action_mode": "a string",
                "system_prompt": "a string", **dict.fromkeys(_POLICY_KEYS, "an integer")},
    "llm": {"retry_max": "an integer", "stream_default": "a boolean", "base_url": "a string",
            "api_key_env": "a string", "temperature": "a number", "seed": "an integer",
            "max_tokens": "an integer", "json_response_format": "a boolean",
            "max_response_bytes": "an integer", "tool_choice": "a string"},
    "store": {"path": "a string"},
    "policy": {"deny_tools": "a list of strings", "ask_tools": "a list of strings"},
    "mcp": {"servers": "an array of tables"},
    "mcp.servers": {"id": "a string", "transport": "a string", "command": "a string",
                    "args": "a list of strings", "env": "a table of strings", "cwd": "a string",
                    "url": "a string", "headers": "a table of strings",
                    "tool_timeout_ms": "an integer", "startup_timeout_ms": "an integer",
                    "required": "a boolean", "roots": "a list of strings",
                    "secret_env": "a list of strings"},
}
_RANGES = {"retry_max": (0, 10), "max_tokens": (1, 10**7), "temperature": (0, 2)}  # [llm]
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_NEEDS = {"stdio": "command", "streamable_http": "url"}   # MCP transport -> its required key
_DAY_MS = 86_400_000   # longer timeouts overflow thread waits; TurnPolicy caps its own the same


@dataclass(frozen=True)
class Config:
    """A checked agent.toml. Paths are absolute; MCP entries have their ${VAR}s expanded."""
    path: Path | None = None
    default_model: str = "openai:gpt-4o-mini"
    action_mode: Literal["json", "native"] = "json"
    system_prompt: str | None = None
    policy: bob.TurnPolicy = field(default_factory=bob.TurnPolicy)
    llm: dict[str, Any] = field(default_factory=dict)   # [llm] as given; OpenAICompatLlm defaults
    store_path: Path | None = None
    deny_tools: tuple[str, ...] = ()
    ask_tools: tuple[str, ...] = ()
    mcp_servers: tuple[dict[str, Any], ...] = field(default=(), repr=False)  # holds secrets


def _checked(values: Any, label: str, where: str, schema: str) -> dict[str, Any]:
    """The table, after refusing unknown keys (naming the nearest valid one) and wrong kinds."""
    kinds = _SCHEMA[schema]
    if not isinstance(values, dict):
        raise bob.ConfigError(f"{where}: {label} must be a table")
    for key, value in values.items():
        if key not in kinds:
            near = difflib.get_close_matches(key, list(kinds), n=1)
            raise bob.ConfigError(f"{where}: unknown key {key!r} in {label}; "
                                  + (f"did you mean {near[0]!r}? " if near else "")
                                  + f"valid keys: {', '.join(kinds)}")
        if not _KINDS[kinds[key]](value):
            raise bob.ConfigError(f"{where}: {label} {key} must be {kinds[key]}, "
                                  f"got {type(value).__name__}")
    return values


def _expand(value: Any, where: str, environ: dict[str, str]) -> Any:
    """${VAR} replaced from `environ` in a string, list or table; unset is a ConfigError."""
    if isinstance(value, dict):
        return {k: _expand(v, f"{where}.{k}", environ) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_expand(v, where, environ) for v in value)
    for name in _VAR.findall(value):
        if name not in environ:
            raise bob.ConfigError(f"{where}: environment variable {name} is not set; "
                                  "export it or change the value")
    return _VAR.sub(lambda m: environ[m.group(1)], value)


def _path(value: str, what: str, base: Path) -> Path:
    """`value` (~ expanded) relative to `base`; a NUL or an unknown ~user is a ConfigError."""
    if "\0" in value:
        raise bob.ConfigError(f"{what} holds a NUL character; fix the path")
    try:
        return base / Path(value).expanduser()
    except RuntimeError as e:   # "Could not determine home directory."
        raise bob.ConfigError(f"{what}: {e} ({value.split('/')[0]}); fix the path") from None


def _check_url(url: str, what: str) -> None:
    """An http(s) URL with a host, or a ConfigError; the URL is not echoed (it may hold a key)."""
    import urllib.parse
    try:
        parts = urllib.parse.urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != -1
    except ValueError:   # a bad port or a broken [IPv6] literal
        ok = False
    if not ok:
        raise bob.ConfigError(f"{what} must be an http:// or https:// URL with a host and a "
                              "valid port, like http://127.0.0.1:8080/v1")


def _mcp_server(raw: Any, n: int, where: str, base: Path,
                environ: dict[str, str]) -> dict[str, Any]:
    """One [[mcp.servers]] entry: keys checked, required keys present, ${VAR}s expanded."""
    server = dict(_checked(raw, f"[[mcp.servers]] #{n}", where, "mcp.servers"))
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", server.get("id", "")):  # as bob_mcp requires
        raise bob.ConfigError(f"{where}: [[mcp.servers]] #{n} needs the required key 'id': "
                              "1-64 letters, digits, '_' or '-' (tools become <id>__<tool>)")
    here = f"{where}: [[mcp.servers]] id={server['id']!r}"
    transport = server.get("transport", "stdio")
    if transport not in _NEEDS:
        raise bob.ConfigError(f'{here} transport must be "stdio" or "streamable_http"')
    if not server.get(_NEEDS[transport]):
        raise bob.ConfigError(f"{here} is missing {_NEEDS[transport]!r}, "
                              f"required by transport {transport!r}")
    for key in ("args", "env", "headers", "url"):
        if key in server:
            server[key] = _expand(server[key], f"{here} {key}", environ)
    for key in ("tool_timeout_ms", "startup_timeout_ms"):
        if not 1 <= server.get(key, 1) <= _DAY_MS:
            raise bob.ConfigError(f"{here} {key} must be between 1 and {_DAY_MS} (a day)")
    if transport == "streamable_http":
        _check_url(server["url"], f"{here} url")
    for table in ("env", "headers"):   # e.g. a stray CR from a ${VAR}; the value stays unsaid
        for name, value in server.get(table, {}).items():
            if not value.isprintable() or (table == "headers" and not value.isascii()):
                raise bob.ConfigError(f"{here} {table}.{name} holds a control character "
                                      "(a stray CR or LF?); fix the value")
    if "cwd" in server:  # like [store] path: relative to the config file
        server["cwd"] = str(_path(server["cwd"], f"{here} cwd", base))
        if not Path(server["cwd"]).is_dir():
            raise bob.ConfigError(f"{here} cwd {server['cwd']} is not a directory")
    if "roots" in server:
        server["roots"] = tuple(str(_path(r, f"{here} roots", base)) for r in server["roots"])
    return server


def _read_toml(path: Path) -> dict[str, Any]:
    """The parsed file; a missing file or a syntax error (line and column) is a ConfigError."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise bob.ConfigError(f"config file {path} not found; fix --config, or leave it out "
                              "to run on ./agent.toml or the built-in defaults") from None
    except tomllib.TOMLDecodeError as e:
        raise bob.ConfigError(f"{path}: invalid TOML: {e}") from None
    except RecursionError:
        raise bob.ConfigError(f"{path}: invalid TOML: arrays or tables nested too deeply") from None
    except (OSError, UnicodeDecodeError) as e:
        raise bob.ConfigError(f"cannot read config file {path}: {e}") from None


def load_config(path: str | os.PathLike[str], environ: dict[str, str] | None = None) -> Config:
    """Read and check an agent.toml; every problem is a ConfigError naming file, table and key."""
    path = _path(os.fspath(path), "--config", Path()).absolute()
    where, env = str(path), dict(os.environ if environ is None else environ)
    doc = _checked(_read_toml(path), "the top level", where, "top level")
    t = {name: _checked(doc.get(name, {}), f"[{name}]", where, name)
         for name in _SCHEMA["top level"]}
    for key, (low, high) in _RANGES.items():
        if key in t["llm"] and not low <= t["llm"][key] <= high:
            raise bob.ConfigError(f"{where}: [llm] {key} must be between {low} and {high}")
    if "base_url" in t["llm"]:
        _check_url(t["llm"]["base_url"], f"{where}: [llm] base_url")
    servers = tuple(_mcp_server(s, n, where, path.parent, env)
                    for n, s in enumerate(t["mcp"].get("servers", []), 1))
    ids = [s["id"] for s in servers]
    if len(set(ids)) != len(ids):
        raise bob.ConfigError(f"{where}: [[mcp.servers]] ids must be unique, got {ids}")
    rt, store = t["runtime"], t["store"].get("path")
    if rt.get("action_mode", "json") not in ("json", "native"):
        raise bob.ConfigError(f'{where}: [runtime] action_mode must be "json" or "native"')
    try:  # TurnPolicy checks its own values
        policy = bob.TurnPolicy(**{k: v for k, v in rt.items() if k in _POLICY_KEYS})
    except bob.ConfigError as e:
        raise bob.ConfigError(f"{where}: [runtime] {e}") from None
    return Config(path, **{k: v for k, v in rt.items() if k not in _POLICY_KEYS}, policy=policy,
                  llm=t["llm"], deny_tools=tuple(t["policy"].get("deny_tools", ())),
                  ask_tools=tuple(t["policy"].get("ask_tools", ())),
                  store_path=None if store is None else _path(store, f"{where}: [store] path",
                                                            path.parent),
                  mcp_servers=servers)


# ---- 2. Demo: tools, script, event printer ------------------------------------------------------
# --demo needs no key and no config: ScriptedLlm plays the model; these functions are real tools.

def word_count(text: str) -> int:
    """Count the words in a text."""
    return len(text.split())


def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


def current_time() -> str:
    """The local date and time, ISO 8601."""
    return time.strftime("%Y-%m-%dT%H:%M:%S")


_DEMO_PROMPT = "How many words are in 'the quick brown fox jumps', plus 37? And what time is it?"
_DEMO_REPLIES = (
    ('{"type": "tool_call", "name": "word_count", "arguments": {"text": '
     '"the quick brown fox jumps"}}'),
    '{"type": "tool_call", "name": "add", "arguments": {"a": 5, "b": 37}}',
    '{"type": "tool_call", "name": "current_time", "arguments": {}}',
    lambda req, cancel: json.dumps({   # quotes the time: the last word of the tool result
        "type": "final", "content": "The text has 5 words; 5 + 37 = 42; the time is "
        f"{req.messages[-1].content.split()[-1]}."}),
)


def _cut(text: str, room: int) -> str:
    return text if len(text) <= room else text[:room - 3] + "..."


class EventPrinter:
    """An EventSink printing each event on stdout as one line, `[step] kind  summary` (--demo)."""

    def emit(self, event: bob.AgentEvent) -> None:
        """State transitions as `from -> to`, other data as JSON cut to 90 characters."""
        d = event.data
        text = (f"{d['from']} -> {d['to']}" if event.kind == "state"
                else json.dumps(d, default=str, ensure_ascii=False))
        print(f"  [{event.step}] {event.kind:<20} {_cut(text, 90)}", flush=True)


# ---- 3. Terminal sinks: status line, streaming --------------------------------------------------

_SURROGATE = re.compile("[\ud800-\udfff]")   # in a str, only a lone one: unencodable


def printable(text: str) -> str:
    """`text` with any lone surrogate (e.g. half of a cut emoji) as U+FFFD, so it can be printed."""
    return _SURROGATE.sub("\ufffd", text)


class StatusLine:
    """An EventSink keeping one stderr line current while a turn runs (state, step n/max,
    elapsed), with each tool call shown above it as it starts and ends. The Shell calls begin(),
    then tick() every 100 ms, then clear(); streamed text clears it too. Terminals only."""

    def __init__(self, out: TextIO, max_steps: int, calls: bool = True):
        self.out, self.max_steps, self._lock = out, max_steps, threading.Lock()
        self.calls = calls   # show each tool call as it starts and ends (-q: not)
        self._t0: float | None = None          # None: nothing to draw until begin()
        self._state, self._step = "start", 0

    def begin(self) -> None:
        """A turn starts (loading the session and, at first, waiting for MCP servers)."""
        self._t0, self._state, self._step = time.monotonic(), "start", 0

    def emit(self, event: bob.AgentEvent) -> None:
        """Note what the event changes; the next tick() draws it."""
        kind, d = event.kind, event.data
        if kind == "text_delta":
            return self.clear()
        self._step = event.step
        if kind == "state":
            self._state = d["to"]
        elif kind == "tool_call_started":
            self.say(f"-> {d['name']} {_cut(json.dumps(d.get('arguments', {})), 100)}")
        elif kind == "tool_call_completed":
            first = (str(d.get("content", "")).strip().splitlines() or [""])[0]
            mark = "error: " if d.get("is_error") else ""
            self.say(f"<- {d['name']}: {mark}{_cut(first, 60)} ({d['duration_ms']:.0f} ms)")

    def say(self, line: str) -> None:
        """A line above the status line (which the next tick redraws)."""
        if self.calls:
            with self._lock:
                self.out.write(f"\r\x1b[K  {printable(line)}\n")
                self.out.flush()

    def tick(self) -> None:
        """Redraw: the elapsed time moves on."""
        with self._lock:
            if self._t0 is not None:
                self.out.write(f"\r\x1b[K  {self._state}  step {self._step}/{self.max_steps}"
                               f"  {time.monotonic() - self._t0:.1f}s")
                self.out.flush()

    def clear(self) -> None:
        """Erase the line; nothing is drawn until the next begin()."""
        with self._lock:
            if self._t0 is not None:
                self.out.write("\r\x1b[K")
                self.out.flush()
            self._t0 = None


_FINAL_HEAD = re.compile(r'\s*(```(json)?\s*)?\{\s*"type"\s*:\s*"final"\s*,\s*"content"\s*:\s*"')
_WHOLE_CHARS = re.compile(r'(?:[^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')  # no half escape


def _final_so_far(raw: str) -> str:
    """The content of a json-mode `final` action that is still streaming in, decoded so far.
    It only grows as `raw` does: a half escape or half a surrogate pair waits for the rest."""
    head = _FINAL_HEAD.match(raw)
    if not head:
        return ""
    whole = _WHOLE_CHARS.match(raw, head.end())  # it always matches, perhaps nothing
    text = json.loads(f'"{whole.group(0) if whole else ""}"', strict=False)
    return text[:-1] if text and "\ud800" <= text[-1] <= "\udbff" else text


class StreamPrinter:
    """An EventSink writing streamed answer text to stdout as it arrives.

    In json mode it shows only the content of a `final` action, decoded while it streams.
    `shown` is what the current LLM call put on screen, so the caller prints just the rest.
    """

    def __init__(self, out: TextIO, json_mode: bool):
        self.out, self.json_mode, self.raw, self.shown = out, json_mode, "", ""

    def emit(self, event: bob.AgentEvent) -> None:
        """Start afresh at each LLM call; print the new part of the text at each delta."""
        if event.kind == "llm_call_started":
            if self.shown:  # text shown before a tool call stays; the next goes below it
                self.out.write("\n")
            self.raw = self.shown = ""
        elif event.kind == "text_delta":
            self.raw += event.data["text"]
            text = _final_so_far(self.raw) if self.json_mode else self.raw
            if len(text) > len(self.shown):
                self.out.write(printable(text[len(self.shown):]))
                self.out.flush()
                self.shown = text


# ---- 4. Shell: MCP tools, turns, commands -------------------------------------------------------

class McpTools:
    """The MCP servers as a ToolPort, set up on a background thread: importing bob_mcp loads the
    mcp SDK (about a second), and the prompt should not wait for it. list_tools and call_tool
    wait for the import; McpToolPort.start(wait=False) then makes them wait for the servers."""

    def __init__(self, servers: Iterable[dict[str, Any]]):
        self._port: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._lock, self._closed = threading.Lock(), False
        self._started: Any = None   # the started McpToolPort, once there is one
        threading.Thread(target=self._start, args=(list(servers),), name="bob-mcp-start",
                         daemon=True).start()

    def _start(self, servers: list[dict[str, Any]]) -> None:
        try:
            import bob_mcp
            known = {f.name for f in fields(bob_mcp.McpServerConfig)}   # secret_env is new
            port = bob_mcp.McpToolPort([bob_mcp.McpServerConfig(
                **{k: v for k, v in s.items() if k in known or k != "secret_env"})
                for s in servers])
            with self._lock:   # a close() that came first wins: then nothing is started
                self._started = None if self._closed else port.start(wait=False)
            self._port.set_result(port)
        except BaseException as e:  # raised to whoever uses the tools
            self._port.set_exception(bob.ConfigError(f"MCP servers are configured but {e}")
                                     if isinstance(e, ImportError) else e)

    def port(self, timeout_s: float = 60.0) -> Any:
        """The McpToolPort; raises what setting it up raised."""
        try:
            return self._port.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise bob.AgentError(f"loading the mcp SDK took over {timeout_s:.0f} s") from None

    def startup_error(self) -> BaseException | None:
        """Why the MCP servers did not start, once that is known; else None."""
        if not self._port.done():
            return None
        return self._port.exception() or self._port.result().startup_error()

    def list_tools(self) -> list[bob.ToolDescriptor]:
        """Every server's tools, named <server_id>__<tool>."""
        return self.port().list_tools()

    def call_tool(self, call: bob.ToolCall, timeout_s: float,
                  cancel: bob.CancelToken | None = None) -> bob.ToolResult:
        """Route the call to its server (a cancel reaches the server as a cancelled request)."""
        return self.port().call_tool(call, timeout_s, cancel=cancel)

    def close(self) -> None:
        """Stop every server process; idempotent."""
        with self._lock:
            self._closed, port = True, self._started
        if port is not None:
            port.close()


_GUARD_KEYS = {"turn_timeout": "turn_timeout_ms", "loop_detected": "max_repeated_batches",
               "stagnation": "max_stagnation_steps"}   # the others are named as their key
_HELP = """  /help    this list
  /tools   the tools the model may call: name, server, description
  /reset   start a new session (the old one stays in the store)
  /usage   tokens used in this session
  /exit    quit (or Ctrl-D). Ctrl-C cancels a running turn, or clears the line."""


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _note(text: str) -> None:
    """A line for the human on stderr (stdout carries only answers)."""
    print(f"bob: {text}", file=sys.stderr, flush=True)


class TurnNotes:
    """An EventSink noting what is said after a turn: a failed save, a cut reply, the time."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.cut, self.t0 = False, time.monotonic()

    def emit(self, event: bob.AgentEvent) -> None:
        """Keep the cause of a failed save; note a `length` finish."""
        if event.kind == "turn_started":
            self.error, self.cut, self.t0 = None, False, time.monotonic()
        elif event.kind == "error" and event.data.get("where") == "store.save":
            self.error = str(event.data.get("error", "")).removeprefix("StoreError: ")
        elif event.kind == "llm_call_completed" and event.data.get("finish_reason") == "length":
            self.cut = True

    def stats(self, r: bob.AgentRunResult) -> str:
        """steps, tool calls, tokens in/out (? when the server said nothing), elapsed."""
        u = r.usage
        tokens = (f"{u.prompt_tokens} in / {u.completion_tokens} out" if u.total_tokens
                  else "? in / ? out")
        return (f"{r.steps} LLM calls, {r.tool_calls} tool calls, {tokens} tokens, "
                f"{time.monotonic() - self.t0:.1f} s")


class Approvals:
    """The approver for [policy] ask_tools. In the REPL the person decides at a prompt on the
    main thread (Shell._run hands the call over); -p and piped runs allow all with --yes, else
    decline and say how to allow."""

    def __init__(self, interactive: bool, yes: bool):
        self.interactive, self.yes, self.always = interactive, yes, set[str]()
        self.asks: queue.SimpleQueue[tuple[bob.ToolCall, Any]] = queue.SimpleQueue()
        self.cancel = bob.CancelToken()   # the running turn's

    def __call__(self, call: bob.ToolCall) -> bob.Approval:
        """On the runtime's worker: decide now, or wait for the person's answer."""
        if self.yes or call.name in self.always:
            return bob.Approval(True)
        if not self.interactive:
            _note(f"warning: {call.name} not run: [policy] ask_tools needs a person's approval; "
                  "pass --yes to allow such calls")
            return bob.Approval(False, "declined: no one can approve tool calls in this run")
        answer: queue.SimpleQueue[bob.Approval] = queue.SimpleQueue()
        self.asks.put((call, answer))
        while not self.cancel.cancelled:
            with contextlib.suppress(queue.Empty):
                return answer.get(timeout=0.1)
        raise bob.Cancelled("cancelled at the approval prompt")

    def ask(self, call: bob.ToolCall) -> bob.Approval:
        """On the main thread: show the call, read y / n (and a reason) / a; Ctrl-C cancels."""
        lines = json.dumps(call.arguments, indent=2, ensure_ascii=False).splitlines()
        shown = "\n    ".join([_cut(x, 96) for x in lines[:6]] + ["..."] * (len(lines) > 6))
        print(printable(f"bob: {call.name} wants to run with\n    {shown}"), file=sys.stderr)
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            while (reply := input("[y]es / [n]o / [a]lways for this tool this session? ")
                   .strip().lower()) not in ("y", "yes", "n", "no", "a", "always"):
                pass
            if reply.startswith("n"):
                reason = input("why not? (optional, told to the model) ").strip()
                return bob.Approval(False, reason or "declined by the user")
            if reply.startswith("a"):
                self.always.add(call.name)
            return bob.Approval(True)
        except (KeyboardInterrupt, EOFError):
            self.cancel.cancel()
            return bob.Approval(False, "cancelled")
        finally:
            signal.signal(signal.SIGINT, previous)


def new_session_id() -> str:
    """A fresh session id, safe as a file name: cli-YYYYmmdd-HHMMSS-xxxxxx."""
    return f"cli-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


@dataclass
class Shell:
    """One conversation: runs turns (Ctrl-C cancels them), prints answers, runs /commands."""
    runtime: bob.AgentRuntime
    session_id: str
    config_name: str = "agent.toml"
    mcp: McpTools | None = None
    status: StatusLine | None = None
    printer: StreamPrinter | None = None
    cancel: bob.CancelToken = field(default_factory=bob.CancelToken)
    notes: TurnNotes = field(default_factory=TurnNotes)
    approvals: Approvals | None = None

    def turn(self, text: str) -> bob.AgentRunResult:
        """Run one turn, print its answer (stdout) and any notice (stderr), return the result.
        A session that could not be saved raises StoreError once the answer is shown."""
        try:
            result = self._run(text)
        except bob.StoreError as e:   # the save failed: show the answer, then say so
            self.notes.error = _one_line(e)
            if e.result is None:
                raise self._unsaved() from None
            result = e.result
        shown = printable(self.printer.shown if self.printer else "")
        content = printable(result.content)
        if result.finish_reason is bob.FinishReason.CANCELLED:   # one line says it all
            if shown:
                print(flush=True)
            _note("warning: turn cancelled; the session is kept")
        else:
            print(content[len(shown):] if content.startswith(shown) else "\n" + content,
                  flush=True)
        if self.printer:
            self.printer.shown = ""
        if result.guard_reason is not None:
            guard = result.guard_reason.value
            _note(f"warning: turn stopped by the {guard} guard; raise "
                  f"{_GUARD_KEYS.get(guard, guard)} under [runtime] in {self.config_name}")
        if self.notes.cut:
            _note("warning: the reply was cut by the token limit; raise max_tokens under [llm] "
                  f"in {self.config_name}")
        if self.status and result.finish_reason is not bob.FinishReason.CANCELLED:
            print(f"\x1b[2m  {self.notes.stats(result)}\x1b[0m", file=sys.stderr, flush=True)
        if self.notes.error is not None:
            raise self._unsaved()
        return result

    def _unsaved(self) -> bob.StoreError:
        return bob.StoreError(f"could not save session {self.session_id}: {self.notes.error}")

    def _run(self, text: str) -> bob.AgentRunResult:
        """runtime.run on a worker thread: SIGINT, which Python handles on the main thread, then
        only sets the cancel token, and the runtime returns within 100 ms of it."""
        cancel = self.cancel = bob.CancelToken()
        if self.approvals:
            self.approvals.cancel = cancel
        outcome: list[Any] = []

        def work() -> None:
            try:
                outcome.append(self.runtime.run(bob.AgentRequest(text, self.session_id), cancel))
            except BaseException as e:  # re-raised on the main thread below
                outcome.append(e)
        worker = threading.Thread(target=work, name="bob-turn", daemon=True)
        previous = signal.signal(signal.SIGINT, lambda signum, frame: cancel.cancel())
        try:
            if self.status:
                self.status.begin()
            worker.start()
            while worker.is_alive():
                worker.join(0.1)
                self._answer()
                if self.status:
                    self.status.tick()
        finally:
            signal.signal(signal.SIGINT, previous)
            if self.status:
                self.status.clear()
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def _answer(self) -> None:
        """Ask the person about a call waiting for approval, if one is."""
        with contextlib.suppress(queue.Empty):
            call, answer = self.approvals.asks.get_nowait() if self.approvals else (None, None)
            if self.status:   # the prompt goes where the status line was
                sys.stderr.write("\r\x1b[K")
            answer.put(typing.cast(Approvals, self.approvals).ask(call))

    def command(self, line: str) -> bool:
        """Run a /command; returns False when the user wants to quit."""
        match line.split()[0]:
            case "/help":
                print(_HELP)
            case "/tools":
                self._print_tools()
            case "/reset":
                self.session_id = new_session_id()
                print(f"new session {self.session_id}")
            case "/usage":
                state = self.runtime.store.load(self.session_id)
                u = state.usage if state else bob.Usage()
                print(f"session {self.session_id}: {u.prompt_tokens} prompt + "
                      f"{u.completion_tokens} completion = {u.total_tokens} tokens")
            case "/exit" | "/quit":
                return False
            case name:
                print(f"unknown command {name}; /help lists the commands")
        return True

    def _print_tools(self) -> None:
        port = self.mcp.port() if self.mcp else None
        tools, sources = (port.list_tools(), port.tool_sources()) if port else ([], {})
        width = max((len(t.name) for t in tools), default=0)
        for t in tools:
            denied = bob.is_denied(t.name, self.runtime.deny_tools)
            mark = "  (denied by [policy])" if denied else ""
            room = max(20, shutil.get_terminal_size().columns - width - 18 - len(mark))
            about = (t.description.strip().splitlines() or [""])[0][:room]
            print(f"  {t.name:<{width}}  {sources.get(t.name, '?'):<12} {about}{mark}")
        if not tools:
            print("no tools (MCP servers are listed under [[mcp.servers]])")

    def close(self) -> None:
        """Cancel a running turn and stop every MCP server; idempotent."""
        self.cancel.cancel()
        if self.mcp is not None:
            self.mcp.close()


# ---- 5. Modes: piped, REPL, demo ----------------------------------------------------------------

def exit_code(result: bob.AgentRunResult) -> int:
    """3 when a guard or a cancel ended the turn, else 0."""
    return 3 if result.finish_reason in (bob.FinishReason.GUARD_EXCEEDED,
                                         bob.FinishReason.CANCELLED) else 0


def run_piped(shell: Shell, lines: Iterable[str]) -> int:
    """Each non-empty line is a turn of one session (`/` lines too); a cancel stops reading."""
    code = 0
    for line in filter(str.strip, lines):
        result = shell.turn(line.strip())
        code = max(code, exit_code(result))
        if result.finish_reason is bob.FinishReason.CANCELLED:
            break
    return code


def _prompt(prompt: str, stdin: TextIO) -> str:
    """-p's text: `-` is all of stdin; piped text follows the prompt after a blank line."""
    if prompt == "-":
        return stdin.read()
    piped = "" if stdin.isatty() else stdin.read()
    return f"{prompt}\n\n{piped}" if piped.strip() else prompt


def list_sessions(store: bob.JsonFileSessionStore) -> int:
    """--sessions: id, last used, turns, the first user line; newest last."""
    for path in sorted(store.directory.glob("*.json"), key=lambda f: f.stat().st_mtime):
        with contextlib.suppress(bob.StoreError):
            state = store.load(path.stem)
            users = [m.content for m in (state.messages if state else []) if m.role == "user"]
            first = " ".join((users or [""])[0].split())[:60]
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime))
            print(f"{path.stem}  {used}  {len(users):>3} turns  {first}")
    return 0


def _save_history(readline: Any, path: str) -> None:
    with contextlib.suppress(OSError):  # e.g. a read-only HOME: not worth a traceback at exit
        readline.write_history_file(path)


def run_repl(shell: Shell, banner: str) -> int:
    """Read-eval-print until /exit or Ctrl-D; a failed turn is reported and the REPL goes on."""
    with contextlib.suppress(ImportError):  # without readline, plain input() still works
        import readline
        path = os.path.expanduser("~/.bob_history")
        with contextlib.suppress(OSError):
            readline.read_history_file(path)
        readline.set_history_length(1000)
        atexit.register(_save_history, readline, path)
    print(banner, file=sys.stderr, flush=True)
    prompt = "bob> "
    while True:
        try:
            line = input(prompt).strip()
            if line.startswith("/") and not shell.command(line):
                return 0
            if line and not line.startswith("/"):
                asked = shell.turn(line).finish_reason is bob.FinishReason.ASK_USER
                prompt = "your answer to bob's question> " if asked else "bob> "
        except KeyboardInterrupt:   # Ctrl-C at the prompt drops the line (in a turn: cancels)
            print()
        except EOFError:
            print()
            return 0
        except bob.BobError as e:
            _note(f"error: {_one_line(e)}")
            if shell.mcp is not None and shell.mcp.startup_error() is not None:
                return 1    # a required MCP server did not start: stop, as -p does


def run_demo(sinks: list[Any]) -> int:
    """A scripted model (bob.ScriptedLlm) drives real tools through the real loop, shown live."""
    runtime = bob.AgentRuntime(bob.ScriptedLlm(_DEMO_REPLIES),
                               bob.FunctionTools([word_count, add, current_time]),
                               events=[EventPrinter(), *sinks])
    print("bob --demo: bob.ScriptedLlm plays the model (no key needed); the tools and the turn "
          f"loop are real, and every event is shown.\nuser> {_DEMO_PROMPT}", flush=True)
    result = runtime.run(bob.AgentRequest(_DEMO_PROMPT, session_id="demo"))
    print(f"answer> {result.content}\n({result.finish_reason.value}: {result.steps} LLM calls, "
          f"{result.tool_calls} tool calls)", flush=True)
    return exit_code(result)


# ---- 6. main ------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bob", description="Run the bob agent: a REPL on a terminal, one turn with -p, or "
        "one turn per line of piped stdin.", epilog="exit codes: 0 ok, 1 runtime error, "
        "2 usage or config error, 3 a guard or a cancel ended the turn")
    add = p.add_argument
    add("--config", metavar="PATH", help="the agent.toml (default: ./agent.toml, else "
        "$XDG_CONFIG_HOME/bob/agent.toml, else none)")
    add("-p", "--prompt", help="run one turn, print the answer, exit; piped stdin is appended "
        "to PROMPT; '-' reads the whole prompt from stdin")
    add("--session", metavar="ID", help="the session to resume or start (kept across runs)")
    add("-c", "--continue", dest="resume", action="store_true", help="resume the last session")
    add("--sessions", action="store_true", help="list the stored sessions and exit")
    add("--model", help="provider:model (default: $BOB_MODEL, else [runtime] default_model)")
    add("--base-url", metavar="URL", help="an OpenAI-compatible endpoint, e.g. "
        "http://127.0.0.1:8080/v1 (default: [llm] base_url, else $OPENAI_BASE_URL)")
    add("--api-key-env", metavar="NAME", help="the environment variable holding the API key")
    add("--system", metavar="TEXT", help="the system prompt for this run")
    add("--stream", action=argparse.BooleanOptionalAction, help="print the answer as it streams")
    add("--max-steps", metavar="N", type=int, help="LLM calls per turn at most")
    add("--yes", action="store_true", help="approve every tool call that [policy] ask_tools "
        "holds for a person (-p and piped runs; else such calls are declined)")
    add("-q", "--quiet", action="store_true", help="do not show tool calls as they run")
    add("--trace", metavar="FILE", help="append every event to FILE as JSON lines")
    add("-v", "--verbose", action="store_true", help="log every event and traceback on stderr")
    add("--demo", action="store_true", help="a scripted session with real tools; needs no key")
    add("--version", action="version", version=f"bob {__version__}")
    return p


class _Voice(logging.Formatter):
    """Without -v, log warnings read like bob's own: `bob: warning: ...`, no traceback."""

    def format(self, record: logging.LogRecord) -> str:
        return f"bob: {record.levelname.lower()}: {' '.join(record.getMessage().split())}"


def _sinks(args: argparse.Namespace) -> list[Any]:
    """What the flags ask for: -v logs every event, --trace writes them as JSON lines. Without
    -v only warnings are logged (MCP servers' stderr is logged at INFO: shown only with -v)."""
    sinks: list[Any] = []
    if args.verbose:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        sinks.append(bob.LoggingEventSink())
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Voice())
        logging.basicConfig(level=logging.WARNING, handlers=[handler])
    if args.trace:
        try:  # the sink opens it at the first event: find a bad path now, not once per event
            open(args.trace, "a", encoding="utf-8").close()
        except OSError as e:
            raise bob.ConfigError(f"--trace {args.trace}: cannot write it ({e.strerror})") from None
        sinks.append(bob.JsonlEventSink(args.trace))
    return sinks


def find_config(arg: str | None) -> Path | None:
    """--config PATH, else ./agent.toml, else $XDG_CONFIG_HOME/bob/agent.toml; None: defaults."""
    if arg is not None:
        return Path(arg)
    xdg = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "bob"
    found = [p for p in (Path("agent.toml"), xdg / "agent.toml") if p.is_file()]
    if not found:
        _note(f"no agent.toml here or in {xdg}: running on built-in defaults")
    return found[0] if found else None


def _llm(cfg: Config, args: argparse.Namespace) -> bob.OpenAICompatLlm:
    """The adapter: flags first, then the environment people already use, then [llm]."""
    options, env = dict(cfg.llm), os.environ
    options.pop("stream_default", None)
    model = args.model or env.get("BOB_MODEL") or cfg.default_model
    provider = model.partition(":")[0]
    env_url = env.get("OPENAI_BASE_URL") if provider == "openai" or (
        provider not in bob.PROVIDERS) else None   # ollama and the like keep their own
    for name, value in (("--base-url", args.base_url), ("OPENAI_BASE_URL", env_url)):
        if value:   # [llm] base_url was checked at load time
            _check_url(value, name)
    url = args.base_url or options.get("base_url") or env_url
    key_env = args.api_key_env or options.get("api_key_env") or (
        "OPENAI_API_KEY" if provider not in bob.PROVIDERS and env.get("OPENAI_API_KEY") else None)
    options.update(base_url=url, api_key_env=key_env)
    stream = cfg.llm.get("stream_default", False) if args.stream is None else args.stream
    try:
        return bob.OpenAICompatLlm(model, stream=stream, **options)
    except bob.ConfigError as e:
        hint = ("; for a local server pass --base-url URL; --demo shows bob without any key"
                if "no API key" in str(e) else "")
        where = "--model: " if args.model else f"{cfg.path}: " if cfg.path else ""
        raise bob.ConfigError(f"{where}{e}{hint}") from None


def _store(cfg: Config, args: argparse.Namespace) -> tuple[bob.JsonFileSessionStore, str]:
    """The session store ([store] path, else $XDG_DATA_HOME/bob/sessions) and the session id."""
    data = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    store = bob.JsonFileSessionStore(cfg.store_path or data / "bob" / "sessions")
    session_id = args.session
    if args.resume and not session_id:
        recent = sorted(store.directory.glob("*.json"), key=lambda f: f.stat().st_mtime)
        session_id = recent[-1].stem if recent else None
        if not recent:
            _note(f"--continue: no session in {store.directory} yet; starting a new one")
    try:  # a bad --session id is a usage error, found before any turn
        store.path_for(session_id or "x")
    except bob.StoreError as e:
        raise bob.ConfigError(f"--session: {e}") from None
    state = store.load(session_id) if session_id else None
    if state is not None:
        _note(f"resumed session {session_id} ({len(state.messages)} messages)")
    return store, session_id or new_session_id()


def build_shell(cfg: Config, args: argparse.Namespace) -> Shell:
    """Wire what the config names: the LLM (its key checked now), store, sinks, MCP servers."""
    llm, (store, session_id) = _llm(cfg, args), _store(cfg, args)
    policy = cfg.policy
    if args.max_steps is not None:
        try:
            policy = replace(policy, max_steps=args.max_steps)
        except bob.ConfigError as e:
            raise bob.ConfigError(f"--max-steps: {e}") from None
    status = StatusLine(sys.stderr, policy.max_steps, not args.quiet) if (
        sys.stderr.isatty() and not args.verbose) else None
    printer = StreamPrinter(sys.stdout, cfg.action_mode == "json") if llm.stream else None
    mcp = McpTools(cfg.mcp_servers) if cfg.mcp_servers else None
    notes = TurnNotes()
    approvals = Approvals(args.prompt is None and sys.stdin.isatty(), args.yes)
    runtime = bob.AgentRuntime(llm, mcp, store=store, policy=policy,
                               events=[s for s in (status, printer, notes) if s] + _sinks(args),
                               system_prompt=args.system or cfg.system_prompt,
                               action_mode=cfg.action_mode, deny_tools=cfg.deny_tools,
                               ask_tools=cfg.ask_tools, approver=approvals)
    return Shell(runtime, session_id, Path(cfg.path or "agent.toml").name, mcp, status, printer,
                 notes=notes, approvals=approvals)


def _fail(e: BaseException, code: int, verbose: bool) -> int:
    """Report an error on stderr in one line (and its traceback with -v); return `code`."""
    if verbose:
        logging.getLogger("bob").error("the traceback:", exc_info=e)
    internal = "" if isinstance(e, bob.BobError) else f"internal error: {type(e).__name__}: "
    _note(f"error: {internal}{_one_line(e)}")
    return code


def _start(args: argparse.Namespace, opened: list[Shell]) -> int:
    """Pick the mode: --demo, --sessions, -p, piped stdin or the REPL."""
    if args.demo:
        return run_demo(_sinks(args))
    found = find_config(args.config)
    cfg = load_config(found) if found else Config()
    if args.sessions:   # needs no key
        return list_sessions(_store(cfg, args)[0])
    shell = build_shell(cfg, args)
    opened.append(shell)
    if args.prompt is not None:
        return exit_code(shell.turn(_prompt(args.prompt, sys.stdin)))
    if not sys.stdin.isatty():
        return run_piped(shell, sys.stdin)
    servers = f"; {len(cfg.mcp_servers)} MCP server(s) starting" if cfg.mcp_servers else ""
    llm = typing.cast(bob.OpenAICompatLlm, shell.runtime.llm)
    return run_repl(shell, f"bob: {llm.describe()}, session "
                    f"{shell.session_id}{servers}. /help lists commands, Ctrl-D quits.")


def _close(shell: Shell) -> None:
    """Stop the shell's servers; close() is bounded, so a second Ctrl-C must not cut it short."""
    held = {s: signal.signal(s, signal.SIG_IGN)
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        shell.close()
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI on `argv` (default sys.argv[1:]); returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.prompt is not None and not args.prompt.strip():
        parser.error("-p needs a prompt (or '-' to read it from stdin)")
    for stream in (sys.stdout, sys.stderr):   # a stray lone surrogate never ends a run
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="replace")
    for signum in (signal.SIGTERM, signal.SIGHUP):   # a closed terminal sends SIGHUP; the
        signal.signal(signum, lambda n, frame: sys.exit(128 + n))  # exit stops MCP servers
    opened: list[Shell] = []
    try:
        return _start(args, opened)
    except bob.ConfigError as e:
        return _fail(e, 2, args.verbose)
    except BrokenPipeError:  # e.g. `bob -p ... | head -1`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # BobError (LlmError, AgentError, StoreError...) or a bug
        return _fail(e, 1, args.verbose)
    except KeyboardInterrupt:
        return 130
    finally:
        for shell in opened:
            _close(shell)


if __name__ == "__main__":
    sys.exit(main())
