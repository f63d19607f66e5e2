"""bob_cli: bob's command line. Reads agent.toml, wires the adapters, runs a REPL or prompts.

    python bob_cli.py --demo                       # no key, no config: a scripted session
    python bob_cli.py                              # REPL on ./agent.toml (/help lists commands)
    python bob_cli.py -p "What is 2 + 40?"         # one turn; only the answer goes to stdout
    printf 'hi\\nand again\\n' | python bob_cli.py   # each line a turn of one session
    python bob_cli.py replay run.jsonl             # re-run a trace offline; exit 1 if it differs

Sections: 1. Configuration  2. Demo, event printer  3. The turn's view  4. Shell  5. Modes  6. main
Needs bob.py beside it; bob_mcp.py and the `mcp` package only when agent.toml lists MCP servers.
"""
from __future__ import annotations

import argparse
import atexit
import codecs
import contextlib
import difflib
import functools
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
import unicodedata
import uuid
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Literal, TextIO

import bob

__all__ = ["Config", "Shell", "load_config", "main"]


# ---- 1. Configuration: agent.toml -> Config ----------------------------------------------------
# Each table has a schema, key -> kind. Errors name file, table and key, never a value (secrets).

def _all_of(kind, item):
    """The check of a `kind` (list or dict) of values that are all `item`s (a dict's values)."""
    return lambda v: isinstance(v, kind) and all(
        isinstance(x, item) for x in (v.values() if kind is dict else v))


_KINDS = {   # a kind's name -> its check
    "a string": lambda v: isinstance(v, str),
    "a boolean": lambda v: isinstance(v, bool),
    # TOML's values are of exactly these types: bool, a subclass of int, is neither
    "an integer": lambda v: type(v) is int,
    "a number": lambda v: type(v) in (int, float),
    "a list of strings": _all_of(list, str),
    "an array of tables": _all_of(list, dict),
    "a table": lambda v: isinstance(v, dict),
    "a table of strings": _all_of(dict, str),
}
_POLICY_KEYS = [f.name for f in fields(bob.TurnPolicy)]
_SCHEMA = {   # a table -> its keys -> their kinds
    "top level": dict.fromkeys(("runtime", "llm", "store", "policy", "mcp"), "a table"),
    "runtime": {"default_model": "a string", "action_mode": "a string",
                "system_prompt": "a string", **dict.fromkeys(_POLICY_KEYS, "an integer")},
    "llm": {"retry_max": "an integer", "stream_default": "a boolean", "base_url": "a string",
            "api_key_env": "a string", "temperature": "a number", "seed": "an integer",
            "max_tokens": "an integer", "json_response_format": "a boolean",
            "max_response_bytes": "an integer", "tool_choice": "a string",
            "headers": "a table of strings", "extra_body": "a table"},
    "store": {"path": "a string"},
    "policy": {"deny_tools": "a list of strings", "ask_tools": "a list of strings"},
    "mcp": {"servers": "an array of tables"},
}
_RANGES = {"retry_max": (0, 10), "max_tokens": (1, 10**7), "temperature": (0, 2)}  # [llm]
_VAR = re.compile(r"\$\{([^}]*)\}")   # any ${...}; of them bob expands the forms below
_FORM = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(:-[^${]*)?")   # ${VAR}, ${VAR:-default}
_NAMES = {"env": r"[^=\0]+", "headers": bob.HEADER_NAME.pattern}   # env, header names


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
    mcp_servers: tuple[Any, ...] = field(default=(), repr=False)  # bob_mcp.McpServerConfig


def _checked(values, label, where, kinds):
    """The table, unknown keys refused (naming the nearest) and wrong kinds (None: unchecked).
    `values` is a table: the kinds of the table holding it said so ("a table", "an array of
    tables"), and TOML's top level is one."""
    for key, value in values.items():
        if key not in kinds:
            near = difflib.get_close_matches(key, kinds, n=1)
            raise bob.ConfigError(f"{where}: unknown key {key!r} in {label}; "
                                  + (f"did you mean {near[0]!r}? " if near else "")
                                  + f"valid keys: {', '.join(kinds)}")
        if kinds[key] and not _KINDS[kinds[key]](value):
            raise bob.ConfigError(f"{where}: {label} {key} must be {kinds[key]}, "
                                  f"got {type(value).__name__}")
    return values


def _expand(value, where, environ):
    """${VAR} and ${VAR:-default} replaced from `environ` in a string, list or table; a
    variable unset without a default is a ConfigError."""
    if isinstance(value, dict):
        return {k: _expand(v, f"{where}.{k}", environ) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_expand(v, where, environ) for v in value)
    if not isinstance(value, str):   # a wrong kind: McpServerConfig names it
        return value

    def one(m):
        # ${VAR:-default} as in sh: the default when the variable is unset or empty; any other
        # form (${VAR-x}, ${VAR:=x}, a nested one) is refused, never sent as it is written
        form = _FORM.fullmatch(m[1])
        if not form or form[1] not in environ and form[2] is None:
            raise bob.ConfigError(f"{where}: {m[1]} is not set, or {m[0]} is not a form bob "
                                  "expands: export the variable, or write ${VAR} or "
                                  "${VAR:-default}")
        return environ.get(form[1]) or (form[2] or "")[2:]
    return _VAR.sub(one, value)


def _path(value, what, base):
    """`value` (~ expanded) relative to `base`; a NUL or an unknown ~user is a ConfigError."""
    if "\0" in value:
        raise bob.ConfigError(f"{what} holds a NUL character; fix the path")
    try:
        return base / Path(value).expanduser()
    except RuntimeError as e:   # "Could not determine home directory."
        raise bob.ConfigError(f"{what}: {e} ({value.split('/')[0]}); fix the path") from None


def _mcp_server(raw, n, where, base, environ):
    """One [[mcp.servers]] entry: ${VAR}s expanded, checked by McpServerConfig, paths absolute."""
    import bob_mcp   # cheap: the mcp SDK itself loads only when a server starts
    label = f"[[mcp.servers]] #{n}"
    keys = dict.fromkeys(f.name for f in fields(bob_mcp.McpServerConfig))   # kinds: its own
    server = _checked(raw, label, where, keys)   # this parse's own: expanded in place
    if "id" not in server:
        raise bob.ConfigError(f"{where}: {label} needs the required key 'id'")
    for key in ("args", "env", "headers", "url"):
        if key in server:
            server[key] = _expand(server[key], f"{where}: {label} {key}", environ)
    try:
        cfg = bob_mcp.McpServerConfig(**server)
    except bob.ConfigError as e:
        raise bob.ConfigError(f"{where}: {label}, {e}") from None
    here = f"{where}: {label}, MCP server id={cfg.id!r}:"
    for key, rule in _NAMES.items():   # else the server's start or the HTTP client fails
        if bad := [name for name in getattr(cfg, key) or {} if not re.fullmatch(rule, name)]:
            raise bob.ConfigError(f"{here} {key} name {bad[0]!r} is not valid (env: no '=' or "
                                  "NUL; headers: ASCII letters, digits and !#$%&'*+-.^_`|~)")
    if "\0" in "".join([cfg.command or "", *cfg.args]):
        raise bob.ConfigError(f"{here} command or args hold a NUL character; remove it")
    cwd = cfg.cwd and str(_path(cfg.cwd, f"{here} cwd", base))   # like [store] path
    if cwd and not Path(cwd).is_dir():
        raise bob.ConfigError(f"{here} cwd {cwd} is not a directory")
    return replace(cfg, cwd=cwd, roots=[str(_path(r, f"{here} roots", base)) for r in cfg.roots])


def _check_url(url, what):
    import bob_mcp   # the rule lives there (for MCP urls too); the mcp SDK is not loaded
    if problem := bob_mcp.url_problem(url):
        raise bob.ConfigError(f"{what} {problem}")


def _bounded(read, what, mib=16):
    """read(), up to `mib` MiB (16: no model reads more): `bob < /dev/zero` took all memory.
    A read that fails is a ConfigError naming `what` (stdin open for writing only: `[Errno 9]
    Bad file descriptor` alone named nothing)."""
    try:
        data = read((mib << 20) + 1)
    except OSError as e:   # (-v's traceback shows the OSError too)
        raise bob.ConfigError(f"cannot read {what}: {e}")
    if len(data) > mib << 20:
        raise bob.ConfigError(f"{what} holds over {mib} MiB; is it the right input?")
    return data


def _read_toml(path):
    """The parsed file; a missing file, bad TOML (line, column), over 1 MiB: a ConfigError."""
    try:
        with open(path, "rb") as f:
            data = _bounded(f.read, f"config file {path}", mib=1)
        return tomllib.loads(data.decode())   # CRLF lines too: TOML allows them
    except FileNotFoundError:
        raise bob.ConfigError(f"config file {path} not found; fix --config, or leave it out "
                              "to run on ./agent.toml or the built-in defaults") from None
    except tomllib.TOMLDecodeError as e:
        raise bob.ConfigError(f"{path}: invalid TOML: {e}") from None
    except RecursionError:
        raise bob.ConfigError(f"{path}: invalid TOML: nested too deeply") from None
    except (OSError, UnicodeDecodeError) as e:
        raise bob.ConfigError(f"cannot read config file {path}: {e}") from None


def load_config(path: str | os.PathLike[str], environ: dict[str, str] | None = None) -> Config:
    """Read and check an agent.toml; every problem is a ConfigError naming file, table and key."""
    path = _path(os.fspath(path), "--config", Path()).absolute()
    env = os.environ if environ is None else environ   # only read
    doc = _checked(_read_toml(path), "the top level", path, _SCHEMA["top level"])
    t = {name: _checked(doc.get(name, {}), f"[{name}]", path, _SCHEMA[name])
         for name in _SCHEMA["top level"]}
    llm = t["llm"]
    for key, (low, high) in _RANGES.items():
        if key in llm and not low <= llm[key] <= high:
            raise bob.ConfigError(f"{path}: [llm] {key} must be between {low} and {high}")
    if "base_url" in llm:
        _check_url(llm["base_url"], f"{path}: [llm] base_url")
    if "headers" in llm:   # a key for a header: api-key = "${AZURE_OPENAI_API_KEY}"
        llm["headers"] = _expand(llm["headers"], f"{path}: [llm] headers", env)
    servers = tuple(_mcp_server(s, n, path, path.parent, env)
                    for n, s in enumerate(t["mcp"].get("servers", []), 1))
    rt = t["runtime"]
    store = t["store"].get("path")
    if rt.get("action_mode", "json") not in ("json", "native"):
        raise bob.ConfigError(f'{path}: [runtime] action_mode must be "json" or "native"')
    try:  # TurnPolicy checks its own values
        policy = bob.TurnPolicy(**{k: v for k, v in rt.items() if k in _POLICY_KEYS})
    except bob.ConfigError as e:
        raise bob.ConfigError(f"{path}: [runtime] {e}") from None
    return Config(path, **{k: v for k, v in rt.items() if k not in _POLICY_KEYS}, policy=policy,
                  llm=llm, **{k: tuple(v) for k, v in t["policy"].items()},  # deny_, ask_tools
                  mcp_servers=servers,
                  store_path=None if store is None else _path(store, f"{path}: [store] path",
                                                            path.parent))


_TEMPLATE = """\
# bob's agent.toml, from bob --init. Every key is optional; README "Configuration" has them all.
[runtime]
# default_model = "openai:gpt-4o-mini"    # provider:model; --model and $BOB_MODEL win
# default_model = "local:qwen2.5"         # a local server (base_url below): no key needed
# max_steps = 12                          # LLM calls per turn
[llm]
# base_url = "http://127.0.0.1:8080/v1"   # any OpenAI-compatible server
# api_key_env = "OPENAI_API_KEY"          # the variable holding the key
[policy]
# ask_tools = ["fs__write_*"]             # a person approves each such call

# [[mcp.servers]]                         # an MCP server's tools, as fs__<tool>
# id = "fs"
# command = "npx"
# args = ["-y", "@modelcontextprotocol/server-filesystem", "."]
"""


def _init():
    """--init: a commented agent.toml in the current directory, never over an existing one."""
    try:
        with open("agent.toml", "x", encoding="utf-8") as f:
            f.write(_TEMPLATE)
    except FileExistsError:
        raise bob.ConfigError("agent.toml exists here already; edit it, or move it away "
                              "and run bob --init again") from None
    except OSError as e:
        raise bob.BobError(f"cannot write agent.toml in this directory: {e.strerror}") from None
    _note(f"wrote {Path('agent.toml').absolute()}: uncomment what you need")
    return 0


# ---- 2. Demo, event printer ---------------------------------------------------------------------
# --demo needs no key and no config: ScriptedLlm plays the model; these functions are real tools.

def word_count(text: str) -> int:
    """Count the words in a text."""
    return len(text.split())


def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


_DEMO_PROMPT = "How many words are in 'the quick brown fox jumps', plus 37?"
_DEMO_REPLIES = (
    ('{"type": "tool_call", "name": "word_count", "arguments": {"text": '
     '"the quick brown fox jumps"}}'),
    '{"type": "tool_call", "name": "add", "arguments": {"a": 5, "b": 37}}',
    '{"type": "final", "content": "The text has 5 words; 5 + 37 = 42."}',   # canned as the rest
)

# control characters made harmless, and the bidi controls (U+202E drew the rest of a line right
# to left: "txt.exe" read "exe.txt"); a tab or line break is a space (a display is one line)
_CONTROLS = dict.fromkeys([*range(32), *range(127, 160), *map(ord, "\u061c\u200e\u200f"
                           "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")], "\ufffd")
_CONTROLS |= dict.fromkeys(map(ord, "\t\n\r"), " ")
_LINES = _CONTROLS | {10: 10}   # the same for text of many lines (a report, -v's logs): "\n" stays


def _plain():
    """TERM=dumb or NO_COLOR: no status line, no dim text (no escape sequences at all)."""
    return os.environ.get("TERM", "dumb") == "dumb" or "NO_COLOR" in os.environ


def _cut(text, reserve=0):
    """One line of `text` that fits the terminal, less `reserve` columns: cut, with "...", by
    the columns its characters take (60 CJK characters are 120 columns, not 60). Text from the
    model or a server must not drive the terminal: control characters are made harmless."""
    # $COLUMNS, else stdout's terminal, else stderr's (`bob > file`: the one the user sees)
    room = shutil.get_terminal_size(os.get_terminal_size(2) if os.isatty(2) else (80, 24)
                                    ).columns - reserve
    # 4 characters a column at most: a combining mark takes none, and a line of 200,000 of
    # them was written whole (1 MB of them took a second); Thai or Hindi use under 2
    text = text[:room * 4].translate(_CONTROLS)
    used = end = 0   # the columns so far; the characters that leave room for "..."
    for i, char in enumerate(text):   # a line may be a 20 MB message
        # The columns a character takes: 2 when East Asian wide or fullwidth (CJK, most
        # emoji), 0 for a combining mark (the accent of e + U+0301), else 1. Never fewer than
        # a terminal draws, but for a few spacing marks of rare scripts: an emoji's variation
        # selector (U+FE0F, which makes the heart U+2764 two columns wide) counts 1.
        if not unicodedata.combining(char):
            used += 2 if unicodedata.east_asian_width(char) in "WF" else 1
        if used > room:   # a terminal 1 or 2 columns wide gets what fits of "..."
            return text[:end] + "..."[:room]
        if used <= room - 3:
            end = i + 1
    return text


@dataclass
class _EventPrinter:
    """An EventSink printing each event as one line, `[step] kind  summary` (--demo, and -v)."""
    out: TextIO

    def emit(self, event):
        """State transitions as `from -> to`, other data as JSON, cut to the terminal's width."""
        text = (f"{event.data['from']} -> {event.data['to']}" if event.kind == "state"
                else json.dumps(event.data, default=str, ensure_ascii=False))
        print(_cut(f"  [{event.step}] {event.kind:<20} {text}"), file=self.out, flush=True)


# ---- 3. The turn's view: streamed answer, status line, notes ------------------------------------

# A json-mode final action as it streams in: its head (1), then its content's whole characters
# so far (2: no half escape)
_FINAL = re.compile(r'(\s*(?:```(?:json)?\s*)?\{\s*"type"\s*:\s*"final"\s*,\s*"content"\s*:\s*")'
                    r'((?:[^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*)')


def _final_more(raw):
    """What a json-mode reply streaming in adds to the content of its `final` action, decoded,
    and the reply less that: its head, then what is not decoded yet (a half escape or half a
    surrogate pair waits for the rest). Only what is new is decoded: decoding all so far at
    each piece took 39 s of CPU for a 100 KB answer streamed in 4-char pieces."""
    final = _FINAL.match(raw)
    if not final:
        return "", raw
    head, chars = final.groups()
    text = json.loads(f'"{chars}"', strict=False)
    end = final.end()
    if "\ud800" <= text[-1:] <= "\udbff":   # half a pair ("" is none): an escape, or a char
        text = text[:-1]
        end -= 6 if raw[end - 6:end - 4] == "\\u" else 1
    return text, head + raw[end:]


@dataclass(repr=False)   # a failing sink is named by its repr: not its stream and lock
class _TurnView:
    """What a person sees of a turn: the answer streamed to stdout, as Shell.turn prints it
    (json mode: a `final`'s content; `shown`: what the last LLM call printed); on a terminal
    (`out`) a status line and tool calls above it; the notes said after a turn (a failed save,
    a reply cut short)."""
    out: Any = None   # the terminal (stderr), or None: no status line, no tool calls
    max_steps: int = 0   # the N of "step k/N" on the status line
    calls: bool = True   # tool calls are shown
    json_mode: bool = True
    _lock: Any = field(default_factory=threading.Lock)   # the worker's events, the main thread

    def begin(self):
        """A turn starts (loading the session and, at first, waiting for MCP servers): the
        turn's fields below are set here (Shell._run calls it before the turn's first event)."""
        self.t0 = time.monotonic()
        self.state = "start"
        self.step = 0
        self.raw = ""     # the reply streamed so far, less what was decoded (json mode)
        self.shown = ""   # what of it was printed
        self.drawing = self.out is not None
        # why the session could not be saved (a str): Shell.turn sets it from the StoreError
        # that run() raises (a turn's own error is raised in its place: then nothing reads it)
        self.error = None
        self.cut = False                # a reply was cut by the token limit

    def emit(self, event):
        """Note what the event changes (the next tick() draws it); print streamed text."""
        kind, d = event.kind, event.data
        self.step = event.step
        if kind == "text_delta":   # the status line goes for good: the answer takes its place
            self.draw("\r\x1b[K", stop=True)
            new = d["text"]
            if self.json_mode:   # a final's content
                new, self.raw = _final_more(self.raw + new)
            # Not once the turn is done: a piece that passed the turn's cancel check just before
            # the cancel comes later (its masking took a while), and the prompt may hold fd 1
            # by then (_input). The turn is done before Shell._run's last tick takes the lock
            with self._lock:
                if new and self.state != "done":
                    # shown, even if the print fails: what it could not write stays in stdout's
                    # buffer (a full disk: the next prompt shows it); printed again, it came twice
                    self.shown += new
                    with contextlib.suppress(BrokenPipeError):   # the reader left (`| head`):
                        print(new, end="", flush=True)   # the answer's print after the turn
                        # says so (exit 141)
        elif kind == "llm_call_started":
            if self.shown:  # text shown before a tool call stays; the next goes below it
                print()
            self.raw = self.shown = ""
        elif kind == "state":
            self.state = d["to"]
        elif kind == "tool_call_started" and self.calls:
            line = f"  -> {d['name']} {json.dumps(d['arguments'], ensure_ascii=False)}"
            self.draw(f"\r\x1b[K{_cut(line)}\n")
        elif kind == "tool_call_completed" and self.calls:
            mark = "error: " if d["is_error"] else ""
            ms = f" ({d['duration_ms']:.0f} ms)"   # kept when the line is cut
            line = f"  <- {d['name']}: {mark}{d['content'].strip()}"
            self.draw(f"\r\x1b[K{_cut(line, len(ms))}{ms}\n")
        elif kind == "llm_call_completed" and d["finish_reason"] == "length":
            self.cut = True

    def tick(self, stop=False):
        """Redraw the status line, as the time moves on; stop: erase it until the next begin().
        A plain terminal (TERM=dumb, NO_COLOR) gets no status line, only the tool calls."""
        status = "" if stop or _plain() else (f"  {self.state}  step {self.step}/"
                                             f"{self.max_steps}  {time.monotonic() - self.t0:.1f}s")
        self.draw(f"\r\x1b[K{_cut(status)}", stop)   # a line that wraps is drawn again below

    def draw(self, text, stop=False):
        """Write `text` on the terminal while the status line is drawn (no escapes if plain)."""
        with self._lock:   # the worker's events and the main thread's ticks
            if self.drawing:   # "\x1b[K" erases the line, from where "\r" took the cursor
                print(text.replace("\x1b[K", "") if _plain() else text, end="", file=self.out,
                      flush=True)
            self.drawing &= not stop

    def stats(self, r):
        """steps, tool calls, tokens in/out (? when the server said nothing), elapsed."""
        tokens = (f"{r.usage.prompt_tokens} in / {r.usage.completion_tokens} out"
                  if r.usage.total_tokens else "? in / ? out")
        return (f"LLM calls {r.steps}, tool calls {r.tool_calls}, tokens {tokens}, "
                f"{time.monotonic() - self.t0:.1f} s")


# ---- 4. Shell: turns, approvals, commands -------------------------------------------------------

_GUARD_KEYS = {"turn_timeout": "turn_timeout_ms", "loop_detected": "max_repeated_batches",
               "stagnation": "max_stagnation_steps"}   # the others are named as their key
_HELP = """  /tools         the tools the model may call: name, server, description
  /reset         start a new session (the old one stays in the store)
  /sessions      the stored sessions; /resume ID goes back to one
  /history       this session's messages, one line each (/usage: its tokens)
  /model NAME    use another model (provider:model) from the next turn on
  /save FILE     write this session as Markdown
  /exit          quit (or Ctrl-D). Ctrl-C cancels a running turn, or clears the line.
A line ending in \\ goes on; lines between two \"\"\" lines are one message; so is a paste."""


def _one_line(e):
    return " ".join(str(e).split()).translate(_CONTROLS) or type(e).__name__   # a server's text


class _Above(logging.StreamHandler):  # type: ignore[type-arg]
    """Log records on stderr. While bob waits at a prompt (an MCP server dies then), a record
    goes on a new line, and the prompt and what was typed so far are drawn again."""
    prompt = ""   # _input's, while it waits for a line

    def format(self, record):   # -v's too: a server's text in it (an MCP SDK warning quoting
        return super().format(record).translate(_LINES)   # an SSE event's name) is shown inert

    def emit(self, record):
        if not self.prompt:
            return super().emit(record)
        readline = sys.modules.get("readline")
        self.stream.write("\n")
        super().emit(record)
        self.stream.write(self.prompt + (readline.get_line_buffer() if readline else ""))
        self.flush()


@functools.cache
def _answers():
    """A copy of fd 1 as bob found it (`bob > file`: the file), made once (_start makes it
    before MCP servers take descriptors), from which _input gives fd 1 back after each prompt.
    A copy made at each prompt took a descriptor each time: with none left (ulimit -n reached)
    every prompt failed at once, and the REPL said "Too many open files" forever."""
    return os.dup(1)


def _input(prompt):
    """input(), while a log record goes above the prompt (_Above). With stdout not a terminal
    (`bob > file`), stderr takes fd 1 while it reads: the prompt goes where notes do, not into
    the file with the answers, and on a terminal readline edits the line (input() uses it only
    when fd 1 is a terminal). Nothing else writes to fd 1 meanwhile: a turn's worker waits for
    the approval prompt, and MCP servers write to their pipe."""
    # What is buffered is the file's (input() flushes it first). A file that cannot take it (a
    # full disk) was said after the turn: input() then shows it on the terminal, not lost
    with contextlib.suppress(OSError):
        sys.stdout.flush()
    held = _answers()   # taken before fd 1 is lent, the first time too
    try:   # (a Ctrl-C right after the prompt is set still unsets it)
        _Above.prompt = prompt
        if not sys.stdout.isatty():
            os.dup2(2, 1)
        return input(prompt)
    finally:   # Ctrl-C, Ctrl-D too. Python raises a signal's KeyboardInterrupt after a call
        # returns, never before this block's first one: a Ctrl-C as input() returns cannot
        # leave fd 1 on the terminal
        _Above.prompt = ""
        os.dup2(held, 1)


def _note(text):
    """A line for the human on stderr (stdout carries only answers)."""
    print(f"bob: {text}", file=sys.stderr)   # line-buffered: no flush needed


def _interrupted(signum, frame):
    """SIGINT's handler at the approval prompt: ends it, as Python's default handler does (a
    KeyboardInterrupt). A function of its own, so that Shell._run's worker tells the prompt
    from the REPL's `bob> `, which reads with the default one."""
    raise KeyboardInterrupt


class _Approvals:
    """The approver for [policy] ask_tools: in the REPL a person decides on the main thread
    (Shell._run hands the call over); -p and piped runs allow all with --yes, else decline."""

    def __init__(self, interactive=False, yes=False):
        self.interactive = interactive
        self.yes = yes
        self.always = set()   # (session, tool name) pairs answered "always"
        self.session = ""
        self.cancel = bob.CancelToken()   # the running turn's
        # and its queue of (call, a queue for its bob.Approval): Shell._run makes one a turn

    def __call__(self, call):
        """On the runtime's worker: decide now, or wait for the person's answer."""
        if self.yes or (self.session, call.name) in self.always:
            return bob.Approval(True)
        if not self.interactive:
            _note(f"warning: {call.name} not run: [policy] ask_tools needs a person's approval; "
                  "pass --yes to allow such calls")
            return bob.Approval(False, "declined: no one can approve tool calls in this run")
        answer = queue.SimpleQueue()
        self.asks.put((call, answer))
        while not self.cancel.cancelled:
            with contextlib.suppress(queue.Empty):
                return answer.get(timeout=0.1)
        raise bob.Cancelled("cancelled at the approval prompt")

    def ask(self, call):
        """On the main thread: show the call, read y / n (and a reason) / a; Ctrl-C cancels.
        A turn that has ended is not asked about (see turn_ended)."""
        previous = signal.signal(signal.SIGINT, _interrupted)   # first: then the token is read
        try:
            if not self.cancel.cancelled:   # else the turn ended while its call came over
                _note(f"{call.name} wants to run with")
                for name, value in call.arguments.items():   # an argument a line, cut
                    print(_cut(f"    {name}: {json.dumps(value, ensure_ascii=False)}"),
                          file=sys.stderr)
                import termios   # POSIX; the prompt runs on a terminal only
                termios.tcflush(sys.stdin, termios.TCIFLUSH)   # typed ahead: must not answer
                while (reply := _input("[y]es / [n]o / [a]lways for this tool this session? ")
                       .strip().lower()) not in "y yes n no a always".split():
                    pass
                if reply.startswith("n"):
                    reason = _input("why not? (optional, told to the model) ").strip()
                    return bob.Approval(False, reason or "declined by the user")
                if reply.startswith("a"):
                    self.always.add((self.session, call.name))   # the session's (/reset...)
                return bob.Approval(True)
        except (KeyboardInterrupt, EOFError):
            self.cancel.cancel()
        finally:   # a SIGINT pending now (the worker's, as the turn ended) is handled by
            # signal.signal before it changes the handler: the KeyboardInterrupt left this one
            # set, the worker sending more, one reaching `bob> `. Again until it is changed
            while True:
                with contextlib.suppress(KeyboardInterrupt):
                    signal.signal(signal.SIGINT, previous)
                    break
        return bob.Approval(False, "cancelled")

    def turn_ended(self):
        """On the turn's worker, as the turn ends (its time ran out, say): its approval prompt
        must not wait on, the answer would go nowhere. ask() sets the prompt's handler, then
        reads the token; this cancels the token, then reads the handler: one of the two sees
        the other. So a prompt not up yet is not shown, and one up (or coming up) is ended by
        a Ctrl-C, sent again every 50 ms while it reads: one that lands before readline waits
        in select() is handled, but readline does not see it and waits on. Shell._run calls
        this before it gives the outcome: after that, the main thread may have left the turn
        (SIGTERM's path restores its own handler) and a Ctrl-C would hit what reads next."""
        self.cancel.cancel()
        while signal.getsignal(signal.SIGINT) is _interrupted:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.05)


def _calls(m):
    """A message's tool calls, each `-> name {arguments}`, secrets masked."""
    return [f"-> {c.name} {json.dumps(bob.redact(c.arguments), ensure_ascii=False)}"
            for c in m.tool_calls]


def _resumed(store, session_id):
    """None when the session is not stored; else say `resumed session ID (N messages)` and
    return the _STICKY flags it last ran with ({}: none kept, or a file not bob's)."""
    if (state := store.load(session_id)) is None:   # a bad id is a StoreError
        return None
    _note(f"resumed session {session_id} ({len(state.messages)} messages)")
    with contextlib.suppress(OSError, ValueError, AttributeError):
        kept = json.loads(_flags_file(store, session_id).read_text())
        return {key: kept[key] for key in _STICKY if isinstance(kept.get(key), str)}
    return {}


def _owner_only(path):
    """Create the file owner-only (0600) if it is not there; an existing one keeps its mode."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o600))


_STICKY = ("model", "base_url", "api_key_env")   # the flags a session remembers


def _flags_file(store, session_id):
    """Where the session's _STICKY flags are kept (JSON), beside its file."""
    return store.path_for(session_id).with_suffix(".flags")


def _forget(store, session_id):
    """Delete the session's files; whether it was stored (an id no store takes never is)."""
    try:
        _flags_file(store, session_id).unlink(missing_ok=True)
        store.path_for(session_id).unlink()
    except (FileNotFoundError, bob.StoreError):
        return False
    return True


def _remembered(use, session_id, kept, fix):
    """use(), which puts the LLM on a session's `kept` flags and those typed. Its ConfigError
    names the flags the session remembers (a hand-edited ID.flags, a key variable since unset)
    and `fix` or --forget; it does not say which failed: a flag typed may be the one."""
    try:
        return use()
    except bob.ConfigError as e:
        if not kept:
            raise
        names = " ".join(f"--{key.replace('_', '-')}" for key in kept)
        raise bob.ConfigError(f"{e} (session {session_id} remembers {names}: {fix}, or "
                              f"--forget {session_id})") from None


def _new_session_id():
    return f"cli-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


@dataclass
class Shell:
    """One conversation: runs turns (Ctrl-C cancels them), prints answers, runs /commands."""
    runtime: bob.AgentRuntime
    session_id: str
    config_name: str = "agent.toml"
    mcp: Any = None                     # a bob_mcp.McpToolPort
    view: _TurnView = field(default_factory=_TurnView)   # no status line, no tool calls
    cancel: bob.CancelToken = field(default_factory=bob.CancelToken)
    approvals: _Approvals = field(default_factory=_Approvals)   # declines every ask_tools call
    llm_for: Callable[..., Any] | None = None   # _STICKY flags (a dict) -> their adapter
    flags: dict[str, str] = field(default_factory=dict)   # _STICKY's, kept beside the session

    def turn(self, text: str) -> bob.AgentRunResult:
        """Run a turn, print its answer and notices; a failed save raises StoreError after.
        A new session whose first turn failed (a wrong model name, a refused key) is not kept."""
        store = self.runtime.store   # the CLI's: a JsonFileSessionStore; the public Shell: any
        new = isinstance(store, bob.JsonFileSessionStore) and not store.path_for(
            self.session_id).exists()
        try:
            result = self._run(text)
        except bob.StoreError as e:   # the save failed: show the answer, then say so
            self.view.error = _one_line(e)
            if e.result is None:
                raise self._unsaved() from None
            result = e.result
        except bob.BobError:
            if new:
                _forget(store, self.session_id)
            raise
        shown, content = self.view.shown, result.content
        if result.finish_reason is bob.FinishReason.CANCELLED:   # one line says it all
            if shown:
                print(flush=True)
            _note("warning: turn cancelled; the session is kept")
        else:
            try:
                print(content[len(shown):] if content.startswith(shown) else "\n" + content,
                      flush=True)
            except OSError:   # a file that cannot take it (`> out.txt` on a full disk): main
                # or the REPL says so. If the turn was not saved either (most likely for that
                # same full disk), that is said first: the answer is in no file and no session
                if self.view.error:   # (a reason: never empty, _one_line)
                    _note(f"error: {self._unsaved()}")
                raise
        if guard := getattr(result.guard_reason, "value", None):
            _note(f"warning: turn stopped by the {guard} guard; raise "
                  f"{_GUARD_KEYS.get(guard, guard)} under [runtime] in {self.config_name}")
        if self.view.cut:
            _note("warning: the reply was cut by the token limit; raise max_tokens under [llm] "
                  f"in {self.config_name}")
        if self.view.out and result.finish_reason is not bob.FinishReason.CANCELLED:
            stats = f"  {self.view.stats(result)}"
            print(stats if _plain() else f"\x1b[2m{stats}\x1b[0m", file=sys.stderr)
        if self.view.error:
            raise self._unsaved()
        return result

    def _unsaved(self):
        return bob.StoreError(f"could not save session {self.session_id}: {self.view.error}")

    def _run(self, text):
        """runtime.run on a worker thread: SIGINT, which Python handles on the main thread, then
        only sets the cancel token, and the runtime returns within 100 ms of it. A turn saved
        has the session's _STICKY flags written beside it (ID.flags)."""
        cancel = self.cancel = self.approvals.cancel = bob.CancelToken()
        self.approvals.session = self.session_id
        # a queue of the turn's own: a call put on it as the turn ended, after this thread's
        # last look, is not asked about in the next turn (its token is this one's, fired)
        self.approvals.asks = queue.SimpleQueue()
        outcome = queue.SimpleQueue()   # the turn's result, or what it raised

        def work():
            try:
                result = self.runtime.run(bob.AgentRequest(text, self.session_id), cancel)
            except BaseException as e:  # re-raised on the main thread below
                result = e
            self.approvals.turn_ended()   # no prompt left up for it
            outcome.put(result)
        worker = threading.Thread(target=work, name="bob-turn", daemon=True)
        previous = signal.signal(signal.SIGINT, lambda signum, frame: cancel.cancel())
        try:
            self.view.begin()
            worker.start()
            while worker.is_alive():
                worker.join(0.1)
                with contextlib.suppress(queue.Empty):   # a call waits for the person's approval:
                    call, answer = self.approvals.asks.get_nowait()   # ask them now
                    self.view.draw("\r\x1b[K")   # the prompt goes where the status line was
                    answer.put(self.approvals.ask(call))
                self.view.tick()
        except SystemExit:   # SIGTERM or SIGHUP (see main): the turn is cancelled and saved first
            cancel.cancel()
            outcome.get()   # not worker.join(): a join an exception cut short breaks the thread
            raise
        finally:
            signal.signal(signal.SIGINT, previous)
            self.view.tick(stop=True)
        if isinstance(result := outcome.get(), BaseException):
            raise result
        if self.flags:   # saved: `bob -c` runs with the flags again (kept before any print)
            with contextlib.suppress(OSError):
                path = _flags_file(self.runtime.store, self.session_id)
                # a symlink planted there is removed, never written through (as the store does
                # with its files); then a new file, owner-only as the session's
                path.unlink(missing_ok=True)
                _owner_only(path)
                path.write_text(json.dumps(self.flags))
        return result

    def command(self, line: str) -> bool:
        """Run a /command; returns False when the user wants to quit."""
        name, _, arg = line.strip().partition(" ")
        store, arg = self.runtime.store, arg.strip()
        match name:
            case "/help":
                print(_HELP)
            case "/tools":
                self._print_tools()
            case "/reset":
                self.session_id = _new_session_id()
                print(f"new session {self.session_id}")
            case "/usage":
                u = self._state().usage
                print(f"session {self.session_id}: {u.prompt_tokens} prompt + "
                      f"{u.completion_tokens} completion = {u.total_tokens} tokens")
            case "/sessions":
                _list_sessions(store)
            case "/resume" if arg:
                if (kept := _resumed(store, arg)) is None:
                    print(f"no session {arg} in {store.directory}; /sessions lists them")
                else:   # on the model and endpoint it ran with, if it remembers them and
                    self.session_id = arg   # they work
                    _remembered(lambda: self._use(kept), arg, kept, "the session goes on with "
                                "the running model: /model NAME")
            case "/history":   # one line a message
                for m in (messages := self._state().messages):   # loaded once: it may be 20 MB
                    print(_cut(" ".join([f"{m.role}:", m.content, *_calls(m)])))
                if not messages:
                    print(f"session {self.session_id} is empty: no messages yet")
            case "/model" if arg:
                self._use({"model": arg})
            case "/save" if arg:
                self._save(_path(arg, "/save", Path()))   # ~nosuchuser: a ConfigError
            case "/exit" | "/quit":
                return False
            case "/save" | "/resume" | "/model":   # with no argument
                print(f"{name} needs an argument; /help shows it")
            case _:
                print(f"unknown command {line.strip()!r}; /help lists the commands")
        return True

    def _use(self, flags):
        """Run on these _STICKY flags from the next turn on; the session keeps them (turn).
        None given: nothing changes (a Shell without llm_for resumes sessions too)."""
        if flags:
            self.runtime.llm = self.llm_for(self.flags | flags)
            self.flags |= flags
            print(f"model: {self.runtime.llm.describe()}")

    def _state(self):
        return self.runtime.store.load(self.session_id) or bob.SessionState()

    def _save(self, path):
        """The transcript as Markdown: a heading a message, its text, its tool calls as code."""
        parts = [f"# bob session {self.session_id}"] + [f"## {m.role}\n\n{m.content}" + "".join(
            f"\n\n`{call}`" for call in _calls(m)) for m in self._state().messages]
        if path.exists():
            raise bob.BobError(f"{path} exists already; /save to another file")
        with path.open("x", encoding="utf-8", errors="bob") as f:   # never over a file, as vim's :w
            f.write("\n\n".join(parts) + "\n")   # an OSError: the REPL says why
        print(f"saved {len(parts) - 1} messages to {path}")

    def _print_tools(self):
        tools = self.mcp.list_tools() if self.mcp else []
        if not tools:
            print("no tools (MCP servers are listed under [[mcp.servers]])")
            return
        sources = self.mcp.tool_sources()   # (after list_tools: its servers have started)
        width = max(len(t.name) for t in tools)
        for t in tools:
            mark = ("  (denied by [policy])" if bob.is_denied(t.name, self.runtime.deny_tools)
                    else "")
            print(_cut(f"  {t.name:<{width}}  {sources.get(t.name, '?'):<12} {t.description}",
                       len(mark)) + mark)

    def close(self) -> None:
        """Cancel a running turn and stop every MCP server; idempotent."""
        self.cancel.cancel()
        if self.mcp:
            self.mcp.close()


# ---- 5. Modes: piped, REPL, demo ----------------------------------------------------------------

def _exit_code(result):
    return 3 if result.finish_reason in (bob.FinishReason.GUARD_EXCEEDED,
                                         bob.FinishReason.CANCELLED) else 0


def _run_piped(shell, lines):
    """Each non-empty line is a turn of one session (`/` lines too); a cancel stops reading."""
    code = 0
    for line in filter(str.strip, lines):
        result = shell.turn(line.strip())
        code = max(code, _exit_code(result))
        if result.finish_reason is bob.FinishReason.CANCELLED:
            break
    return code


def _prompt(prompt, stdin):
    """-p's text: `-` is all of stdin; piped text follows the prompt after a blank line."""
    piped = "" if stdin.isatty() and prompt != "-" else _bounded(stdin.read, "stdin")
    if prompt != "-":   # -p TEXT with text piped in: the text, then what was piped
        return f"{prompt}\n\n{piped}" if piped.strip() else prompt
    if not piped.strip():
        raise bob.ConfigError("-p -: stdin is empty; pipe the prompt in, or pass -p TEXT")
    return piped


def _by_use(store):
    """(mtime, file) of the sessions, least recently used first; a FIFO or dangling link is none."""
    return sorted((p.stat().st_mtime, p) for p in store.directory.glob("*.json") if p.is_file())


def _list_sessions(store):
    """--sessions: id, last used, turns, the first user line; newest last."""
    for mtime, path in _by_use(store):
        try:
            state = store.load(path.stem)
            users = [m.content for m in (state.messages if state else []) if m.role == "user"]
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(mtime))
            # flushed: a file that cannot take it (a full disk) is said by main, not at exit
            print(_cut(f"{path.stem}  {used}  turns {len(users):>3}  {(users or [''])[0]}"),
                  flush=True)
        except bob.StoreError as e:   # a file cut short: named, not left out without a word
            _note(f"warning: {_one_line(e)}")
    return 0


def _save_history(readline, path):
    with contextlib.suppress(OSError):  # e.g. a read-only HOME: not worth a traceback at exit
        readline.write_history_file(path)


def _read_message(prompt):
    """One message: a line ending in `\\` goes on; `\"\"\"` opens a block; a paste comes whole."""
    lines = [_input(prompt).strip()]
    with contextlib.suppress(EOFError):   # Ctrl-D sends what was typed; the next one quits
        if lines == ['"""']:   # up to the next line that is just """, kept as typed
            lines = []
            lines.extend(iter(lambda: _input("... "), '"""'))
        else:
            while lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1]
                lines.append(_input("... "))
    return "\n".join(lines)


def _run_repl(shell, banner):
    """Read-eval-print until /exit or Ctrl-D; a failed turn is reported and the REPL goes on."""
    with contextlib.suppress(ImportError):  # without readline, plain input() still works
        import readline
        path = os.path.expanduser("~/.bob_history")
        with contextlib.suppress(OSError):
            _owner_only(path)
        with contextlib.suppress(OSError):
            readline.read_history_file(path)
        readline.set_history_length(1000)
        if not _plain():   # a paste of many lines: one message (bracketed paste: escapes)
            readline.parse_and_bind("set enable-bracketed-paste on")
        atexit.register(_save_history, readline, path)
    _note(banner)
    asked = False   # the last turn ended on a question to the user
    while True:
        try:
            line = _read_message("your answer to bob's question> " if asked else "bob> ")
            if line in ("help", "exit", "quit"):   # a newcomer's words, not a message
                line = f"/{line}"
            if line.startswith("/"):
                # what a /command prints is for the person, never an answer: with stdout
                # redirected (`bob > answers.txt`) it goes to the terminal, with the notes
                with contextlib.redirect_stdout(sys.stdout if sys.stdout.isatty() else sys.stderr):
                    if not shell.command(line):
                        return 0
                asked = False   # after /reset or /resume no question waits
            elif line:
                asked = shell.turn(line).finish_reason is bob.FinishReason.ASK_USER
        except (KeyboardInterrupt, EOFError) as e:   # Ctrl-C drops the line, Ctrl-D quits
            print(file=sys.stderr)
            if isinstance(e, EOFError):
                return 0
        except BrokenPipeError:   # stdout's reader left (`bob | head`): end as -p does, 141
            raise
        except (bob.BobError, OSError) as e:   # OSError: e.g. /save to a directory not there
            _note(f"error: {_one_line(e)}")
            import bob_mcp   # cheap; loaded already when MCP servers are configured
            if isinstance(e, bob_mcp.McpError):
                return 1    # e.g. a required MCP server did not start: stop, as -p does


def _run_demo(sinks):
    """A scripted model (bob.ScriptedLlm) drives real tools through the real loop, shown live."""
    runtime = bob.AgentRuntime(bob.ScriptedLlm(_DEMO_REPLIES), bob.FunctionTools([word_count, add]),
                               events=[_EventPrinter(sys.stdout), *sinks])
    print("bob --demo: bob.ScriptedLlm plays the model (no key needed); the tools and the turn "
          f"loop are real, and every event is shown.\nuser> {_DEMO_PROMPT}", flush=True)
    result = runtime.run(bob.AgentRequest(_DEMO_PROMPT, "demo"))
    print(f"answer> {result.content}\n({result.finish_reason.value}: {result.steps} LLM calls, "
          f"{result.tool_calls} tool calls)", flush=True)
    return _exit_code(result)


# ---- 6. main ------------------------------------------------------------------------------------

def _parser():
    p = argparse.ArgumentParser(prog="bob", description="The bob agent: a REPL, one turn with "
                                "-p, or a turn per piped line.", epilog="the API key: in "
                                "$OPENAI_API_KEY (or the provider's variable, or --api-key-env); "
                                "none for a local server or --demo. In the REPL /help lists the "
                                "commands. Sessions live in $XDG_DATA_HOME/bob/sessions "
                                "(~/.local/share/bob/sessions). Exit codes: 0 ok, 1 runtime "
                                "error, 2 usage or config error, 3 a guard or a cancel")
    add = p.add_argument
    add("--config", metavar="PATH", help="default: ./agent.toml, else $XDG_CONFIG_HOME/bob/")
    add("-p", "--prompt", help="one turn, then exit; piped stdin follows PROMPT; '-': all stdin")
    add("--session", metavar="ID", help="the session to resume or start (kept across runs)")
    add("-c", "--continue", dest="resume", action="store_true", help="resume the last session")
    add("--sessions", action="store_true", help="list the stored sessions and exit")
    add("--forget", metavar="ID", help="delete a stored session, list those left and exit")
    add("--model", help="provider:model (default: $BOB_MODEL, else [runtime] default_model)")
    add("--base-url", metavar="URL", help="an OpenAI-compatible endpoint ($OPENAI_BASE_URL)")
    add("--api-key-env", metavar="NAME", help="the environment variable holding the API key")
    add("--system", metavar="TEXT", help="the system prompt for this run")
    add("--stream", action=argparse.BooleanOptionalAction, help="print the answer as it streams")
    add("--max-steps", metavar="N", type=int, help="LLM calls per turn at most")
    add("--yes", action="store_true", help="approve the calls [policy] ask_tools holds (-p, pipes)")
    add("-q", "--quiet", action="store_true", help="do not show tool calls as they run")
    add("--trace", metavar="FILE", help="append every event to FILE as JSON lines")
    add("-v", "--verbose", action="store_true", help="every event as a line, logs, tracebacks")
    add("--demo", action="store_true", help="a scripted session with real tools; needs no key")
    add("--init", action="store_true", help="write a commented agent.toml here (never over one)")
    add("--version", action="version", version=f"bob {bob.__version__}")
    return p


class _Voice(logging.Formatter):
    """Without -v, log warnings read like bob's own: `bob: warning: ...`, no traceback."""

    def format(self, record):   # no cause: an MCP SDK error quotes a server's answer, which
        # may echo a secret header (bob_mcp masks only its own messages' secrets)
        return f"bob: {record.levelname.lower()}: {_one_line(record.getMessage())}"


class _Trace(bob.JsonlEventSink):
    """--trace FILE, as bob's warning names it when a write fails (a full disk, /dev/full)."""

    def __repr__(self):
        return f"--trace {self.path}"


def _sinks(args):
    """-v: each event as a line, and INFO logs (MCP servers' stderr); --trace: events as JSONL."""
    handler = _Above(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
                         if args.verbose else _Voice())
    # the root logger stays at WARNING, its default: httpx's INFO records name URLs (tokens)
    logging.basicConfig(handlers=[handler])
    if args.verbose:
        logging.getLogger("bob").setLevel(logging.INFO)
    sinks = [_EventPrinter(sys.stderr)] if args.verbose and not args.demo else []
    if args.trace:
        try:  # the sink opens it at the first event: find a bad path now, not once per event
            _owner_only(args.trace)
        except OSError as e:
            raise bob.ConfigError(f"--trace {args.trace}: cannot write it ({e.strerror})") from None
        sinks.append(_Trace(args.trace))
    return sinks


def _xdg(name, default):
    """$name if it is an absolute path (the XDG spec ignores relative ones), else ~/default."""
    value = os.getenv(name, "")
    return Path(value) if os.path.isabs(value) else Path.home() / default


def _find_config(arg, verbose):
    """--config PATH, else ./agent.toml, else $XDG_CONFIG_HOME/bob/agent.toml; None: defaults."""
    if arg is not None:
        return Path(arg)
    xdg = _xdg("XDG_CONFIG_HOME", ".config") / "bob"
    found = [p for p in (Path("agent.toml"), xdg / "agent.toml") if p.is_file()]
    if not found and verbose:   # every run of the flags-only quick start: only when asked
        _note(f"no agent.toml here or in {xdg}: running on built-in defaults")
    return found[0] if found else None


def _llm(cfg, args):
    """The adapter: flags first, then the environment people already use, then [llm]."""
    options = dict(cfg.llm)   # a copy: its base_url and api_key_env are set
    env = os.environ
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
    stream = options.pop("stream_default", False)   # [llm]'s, not an option of the adapter
    try:   # --stream or --no-stream wins
        return bob.OpenAICompatLlm(model, stream=stream if args.stream is None else args.stream,
                                   **options)
    except bob.ConfigError as e:
        hint = (f"; a local server needs none: {'' if url else 'pass --base-url URL and '}a "
                "model of a provider bob does not know, e.g. --model local:NAME; --demo shows "
                "bob without any key" if "no API key" in str(e) else "")
        # what to fix: the file, unless a --model (given or remembered) is in use: the error
        # names the model; else the built-in defaults
        where = f"{cfg.path}: " if cfg.path and not args.model else ""
        raise bob.ConfigError(f"{where}{e}{hint}") from None


def _llm_or_ask(cfg, args, interactive):
    """_llm; with no API key, the REPL asks for a local server instead (-p and pipes: exit 2)."""
    while True:
        try:
            return _llm(cfg, args)
        except bob.ConfigError as e:
            if "no API key" not in str(e) or not interactive:
                raise
            _note(e)
            url, _, name = _input("bob: or type a local server's URL and its model's name, e.g. "
                                 "http://127.0.0.1:8080/v1 qwen2.5 (Enter quits)> "
                                 ).strip().partition(" ")
            if not url:
                raise
            args.base_url, args.model = url, f"local:{name.strip() or 'default'}"


def _store(cfg, args):
    """The session store ([store] path, else $XDG_DATA_HOME/bob/sessions), the session id, and
    the _STICKY flags a resumed session fills in `args` (those not given)."""
    store = bob.JsonFileSessionStore(cfg.store_path or _xdg("XDG_DATA_HOME", ".local/share")
                                     / "bob" / "sessions")
    try:   # conversations: owner-only
        store.directory.mkdir(0o700, parents=True, exist_ok=True)
    except OSError as e:   # a file there, no permission: said before any turn, not at its save
        raise bob.ConfigError(f"{cfg.path or 'built-in defaults'}: [store] path: cannot make the "
                              f"sessions directory {store.directory} ({e.strerror}); set [store] "
                              "path to a directory bob may create") from None
    session_id = args.session
    if args.resume and not session_id:
        if recent := _by_use(store):
            session_id = recent[-1][1].stem   # the last used
        else:
            _note(f"--continue: no session in {store.directory} yet; starting a new one")
    try:  # a bad --session id is a usage error, found before any turn
        store.path_for("x" if session_id is None else session_id)   # "": refused
    except bob.StoreError as e:
        raise bob.ConfigError(f"--session: {e}") from None
    kept = {key: value for key, value in (session_id and _resumed(store, session_id) or {}).items()
            if getattr(args, key) is None}   # {}: a new session; a flag given again wins
    vars(args).update(kept)
    return store, session_id or _new_session_id(), kept


def _build_shell(cfg, args):
    """Wire what the config names: the LLM (its key checked now), store, sinks, MCP servers."""
    store, session_id, kept = _store(cfg, args)   # first: a resumed session's flags fill args
    approvals = _Approvals(args.prompt is None and sys.stdin.isatty(), args.yes)   # the REPL
    llm = _remembered(lambda: _llm_or_ask(cfg, args, approvals.interactive), session_id, kept,
                      "a flag given again wins")
    policy = cfg.policy
    if args.max_steps is not None:
        try:
            policy = replace(policy, max_steps=args.max_steps)
        except bob.ConfigError as e:
            raise bob.ConfigError(f"--max-steps: {e}") from None
    view = _TurnView(sys.stderr if sys.stderr.isatty() and not args.verbose else None,
                     policy.max_steps, not args.quiet, cfg.action_mode == "json")
    mcp = None
    if cfg.mcp_servers:   # they start in the background: the prompt does not wait for them
        import bob_mcp
        try:
            mcp = bob_mcp.McpToolPort(cfg.mcp_servers).start(wait=False)
        except bob.ConfigError as e:   # an id used twice
            raise bob.ConfigError(f"{cfg.path}: {e}") from None
    runtime = bob.AgentRuntime(llm, mcp, store=store, policy=policy,
                               events=[view, *_sinks(args)],
                               system_prompt=args.system or cfg.system_prompt,
                               action_mode=cfg.action_mode, deny_tools=cfg.deny_tools,
                               ask_tools=cfg.ask_tools, approver=approvals)
    return Shell(runtime, session_id, Path(cfg.path or "agent.toml").name, mcp, view,
                 approvals=approvals, llm_for=lambda flags: _llm(cfg, argparse.Namespace(
                     **vars(args) | flags)),
                 flags={key: value for key in _STICKY   # a login (user:key@) is a secret
                        if (value := getattr(args, key)) and (
                            key != "base_url" or "@" not in value)})


def _fail(e, code, verbose):
    """Report an error on stderr in one line (and its traceback with -v); return `code`."""
    if verbose:
        logging.getLogger("bob").error("the traceback:", exc_info=e)
    # an OSError is the system's (a full disk, a sessions directory without permission), not
    # a bug: its message (errno, reason, file) says what happened
    label = "" if isinstance(e, bob.BobError | OSError) else f"internal error: {type(e).__name__}: "
    try:
        _note(f"error: {label}{_one_line(e)}")
    except OSError:   # stderr on a full disk (`2> err.txt`): the code alone says what happened
        _silenced(2)
    return code


def _silenced(*fds):
    """Point these descriptors at /dev/null: what is still buffered for them goes nowhere (else
    Python's exit writes it again, fails, and exits 120: `Exception ignored in: <stdout>`)."""
    for fd in fds:
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)


def _start(args, opened):
    """Pick the mode: --init, --demo, --sessions, -p, piped stdin or the REPL."""
    if sys.stdout is None:   # `>&-`: print() would drop every answer without a word
        raise bob.BobError("stdout is closed, so answers would be lost; redirect it to a file "
                           "or to /dev/null")
    if args.init:
        return _init()
    if args.demo:
        return _run_demo(_sinks(args))
    found = _find_config(args.config, args.verbose)
    cfg = load_config(found) if found else Config()
    if args.sessions or args.forget is not None:   # need no key ("": an unset $VAR, refused)
        store = _store(cfg, args)[0]
        if args.forget is not None and not _forget(store, args.forget):
            raise bob.ConfigError(f"--forget: no session {args.forget!r} in {store.directory}; "
                                  "--sessions lists them")
        return _list_sessions(store)   # --forget: the sessions left
    _answers()   # now, while descriptors are free: a prompt takes none (and never fails so)
    shell = _build_shell(cfg, args)
    opened.append(shell)
    if args.prompt is not None:
        return _exit_code(shell.turn(_prompt(args.prompt, sys.stdin)))
    if not sys.stdin.isatty():
        return _run_piped(shell, iter(lambda: _bounded(sys.stdin.readline, "a stdin line"), ""))
    servers = f"; {len(cfg.mcp_servers)} MCP server(s) starting" if cfg.mcp_servers else ""
    return _run_repl(shell, f"{shell.runtime.llm.describe()}, session "
                     f"{shell.session_id}{servers}. /help lists commands, Ctrl-D quits.")


def _run_replay(argv):
    """`bob replay TRACE`: one line per turn, the first divergence in full; exit 0 same,
    1 a divergence, 2 an unreadable or incomplete trace (or a bad config)."""
    p = argparse.ArgumentParser(prog="bob replay", description="Replay a --trace file offline: "
                                "the recorded replies answer; stop at the first difference.")
    p.add_argument("trace", help="the JSONL trace to replay")
    p.add_argument("--live-tools", action="store_true",
                   help="run the tools of --config (MCP servers) instead of recorded results")
    p.add_argument("--config", metavar="PATH", default="agent.toml",
                   help="the agent.toml whose tools --live-tools runs (default: ./agent.toml)")
    args = p.parse_args(argv)
    mcp = None
    try:   # recorded tools, or the config's (no MCP server: none)
        cfg = load_config(args.config) if args.live_tools else Config()
        if cfg.mcp_servers:
            import bob_mcp
            mcp = bob_mcp.McpToolPort(cfg.mcp_servers).start()
        report = bob.replay(args.trace, tools=(mcp or bob.FunctionTools()) if args.live_tools
                            else None, deny_tools=cfg.deny_tools)
    except bob.BobError as e:   # TraceError, ConfigError, a server that would not start
        return _fail(e, 2, False)
    finally:   # (main: Ctrl-C is 130, a reader that left 141, a full disk 1)
        if mcp:
            mcp.close()
    # a trace's text (a field replay does not compare, shown as it is) must not drive the
    # terminal
    print(str(report).translate(_LINES), flush=True)   # a reader that left: main says 141
    return 0 if report.ok else 1


_ENDING = (signal.SIGTERM, signal.SIGHUP)   # what main() turns into an exit (128 + N)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI on `argv` (default sys.argv[1:]); returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    # A closed terminal sends SIGHUP; the exit stops MCP servers (`replay --live-tools` too:
    # killed outright, it left them running)
    for signum in _ENDING:
        signal.signal(signum, lambda n, frame: sys.exit(128 + n))
    replay = argv[:1] == ["replay"]   # `bob replay TRACE`, with flags of its own
    parser = _parser()
    args = parser.parse_args([] if replay else argv)
    if args.prompt is not None and not args.prompt.strip():
        parser.error("-p needs a prompt (or '-' to read it from stdin)")
    sys.stdin = sys.stdin or open(os.devnull)   # closed (bob <&-): read as empty
    sys.stderr = sys.stderr or open(os.devnull, "w")
    # Out: a lone surrogate (a cut emoji) prints as U+FFFD; in: bytes not UTF-8 read as U+FFFD.
    codecs.register_error("bob", lambda e: ("\ufffd".encode(e.encoding, "replace"), e.end))
    for stream, errors in ((sys.stdin, "replace"), (sys.stdout, "bob"), (sys.stderr, "bob")):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors=errors)
    opened = []   # the Shell _start built, if it did: closed as main ends
    try:   # replay: the same exits, a reader that left (`| head`) and Ctrl-C
        code = _run_replay(argv[1:]) if replay else _start(args, opened)
        sys.stderr.flush()   # raises if -v's reader left (`2>&1 | head`): Python's exit says 120
        return code
    except OSError as e:   # BrokenPipeError: the reader left (`bob -p ... | head -1`), say nothing
        # more; else a file that cannot take the answer (`> out.txt` on a full disk): say so
        code = 141 if isinstance(e, BrokenPipeError) else _fail(e, 1, args.verbose)
        # stdout, stderr: nothing more is said. Only here: after any other error, what MCP
        # servers log as they stop is still shown
        _silenced(1, 2)
        return code
    except Exception as e:  # ConfigError: 2, a bad config or flag; any other BobError
        # (LlmError, AgentError, StoreError...) or a bug: 1
        return _fail(e, 2 if isinstance(e, bob.ConfigError) else 1, args.verbose)
    except (KeyboardInterrupt, EOFError):   # EOFError: Ctrl-D at a question before the REPL
        return 130
    finally:   # stop MCP servers; bounded, so a second Ctrl-C may not cut it short
        held = {n: signal.signal(n, signal.SIG_IGN) for n in (signal.SIGINT, *_ENDING)}
        for shell in opened:
            shell.close()
        for signum, handler in held.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
