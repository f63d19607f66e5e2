"""bob_mcp: the tools of MCP servers as one bob ToolPort, while bob's loop stays synchronous.

    from bob import AgentRequest, AgentRuntime, OpenAICompatLlm
    from bob_mcp import McpServerConfig, McpToolPort

    fs = McpServerConfig("fs", command="npx",
                         args=("-y", "@modelcontextprotocol/server-filesystem", "."))
    with McpToolPort([fs]) as tools:                  # starts the servers, stops them at exit
        agent = AgentRuntime(OpenAICompatLlm("openai:gpt-4o-mini"), tools)
        print(agent.run(AgentRequest("List the files here.")).content)   # calls fs__list_directory

Sections: 1. Errors and configuration  2. Names and results  3. One server  4. McpToolPort

Threading: one asyncio loop thread per port. Each server is owned by one task that enters the
SDK's transport and session context managers and exits them itself (the SDK's task groups demand
it); sync callers wait on the loop, always with a timeout, and 50 ms at most at a time (so a
Ctrl-C that the kernel handed to the loop thread reaches them at once). Vendoring: copy this
file next to bob.py; running servers needs mcp 2.3 (pinned: _stdio_process and _sdk_note reach
into it), which start() imports (not `import bob_mcp`).
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import contextvars
import hashlib
import json
import logging
import math
import os
import re
import signal
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from bob import (_CTRL_C_SLICE_S, TOOL_NAME, BobError, CancelToken, ConfigError, ToolCall,
                 ToolDescriptor, ToolResult, secret_name)

__all__ = ["McpError", "McpServerConfig", "McpToolPort", "exposed_name", "url_problem"]

log = logging.getLogger("bob.mcp")

# The MCP SDK and anyio (which it runs on) take ~0.7 s to import, so `import bob_mcp` does not
# load them: McpToolPort._start_all() binds these two names (a `global` import) when the first
# port starts, on the port's thread; every use of them below runs on a started port's loop.
anyio: Any = None
mcp: Any = None

_TAIL_LINES = 8         # stderr lines kept per server for error messages
_POLL_S = 0.2           # how often a stdio server's owner checks that its process is alive
_GRACE_S = 7.0          # beyond configured timeouts: the SDK's own bounded shutdown steps
_CLOSE_S = 8.0          # close(): total budget before process groups are killed outright
_SHOWN = 500            # characters of one line a server wrote that bob shows (logs, errors)
_INPUT_QUOTE = re.compile(r"input_value=[^\n]{0,300}(?=, input_type=)")   # pydantic's, cut short
_MAX_PAGES = 100        # tools/list pages followed; a nextCursor that never ends is an error
# Tools one server may list. Large real servers list tens to about a hundred (GitHub's official
# one ~100 with every toolset on); each tool costs the model ~100-200 prompt tokens in every
# request, so 1,000 tools (~100k-200k tokens) already fill or pass most models' context, and
# OpenAI's native `tools` field takes at most 128. More is a server bug or a misconfiguration.
_MAX_TOOLS = 1_000


# ---- 1. Errors and configuration ----------------------------------------------------------------

class McpError(BobError):
    """An MCP server could not be started or reached; the message names the server and the cause."""


def url_problem(url: str | None) -> str | None:
    """Why url is no http(s) URL with a host and a valid port (not quoting it: keys), or None."""
    with contextlib.suppress(ValueError, TypeError):   # a bad port, a broken [IPv6] literal
        parts = urllib.parse.urlsplit(url)
        if parts.scheme in ("http", "https") and parts.hostname and parts.port != -1:
            return None
    return ("must be an http:// or https:// URL with a host and a valid port, "
            "like http://127.0.0.1:8080/v1")


_DAY_MS = 86_400_000    # longer timeouts overflow thread waits
_LIST_FIELDS = ("args", "roots", "secret_env")   # lists of strings; kept as tuples


@dataclass(frozen=True)
class McpServerConfig:
    """One `[[mcp.servers]]` entry. env and header values never appear in repr, logs or errors."""
    id: str                                   # tools are exposed as <id>__<tool>
    transport: str = "stdio"                  # "stdio" or "streamable_http"
    command: str | None = None                # stdio: the executable, looked up on PATH
    args: tuple[str, ...] = ()
    env: dict[str, str] | None = field(default=None, repr=False, hash=False)  # over a safe base
    cwd: str | None = None
    url: str | None = None                    # streamable_http: the endpoint, e.g. .../mcp
    headers: dict[str, str] | None = field(default=None, repr=False, hash=False)
    tool_timeout_ms: int = 15_000             # per call; the runtime's limit may be shorter
    startup_timeout_ms: int = 10_000          # spawn + handshake + first tools/list
    required: bool = True                     # False: a server that fails to start is skipped
    roots: tuple[str, ...] = ()               # answered to roots/list; (): no roots
    secret_env: tuple[str, ...] = ()          # more env/header keys whose values are masked

    def __post_init__(self) -> None:
        if problem := _problem(self):
            raise ConfigError(f"MCP server id={self.id!r}: {problem}")
        for name in _LIST_FIELDS:
            object.__setattr__(self, name, tuple(getattr(self, name)))


def _problem(c: McpServerConfig) -> str | None:
    """The first thing wrong with a server's settings, or None (the SDK's errors echo values)."""
    if not (isinstance(c.id, str) and TOOL_NAME.fullmatch(c.id)):   # bob's one name rule
        return "'id' must be 1-64 letters, digits, '_' or '-' (tools become <id>__<tool>)"
    if c.transport not in ("stdio", "streamable_http"):
        return f'transport must be "stdio" or "streamable_http", got {c.transport!r}'
    for key in ("command", "cwd", "url", "required"):
        if not isinstance(getattr(c, key), bool if key == "required" else str | None):
            return f"{key} must be {'true or false' if key == 'required' else 'a string'}"
    for key in _LIST_FIELDS:
        value = getattr(c, key)
        if not isinstance(value, list | tuple) or not all(isinstance(x, str) for x in value):
            return f"{key} must be a list of strings"
    for key in ("env", "headers"):
        table = getattr(c, key) or {}
        texts = [*table, *table.values()] if isinstance(table, dict) else [None]
        if not all(isinstance(x, str) for x in texts):
            return f"{key} must be a table of strings"
        for name, value in table.items():  # e.g. a stray CR from a ${VAR}
            if not value.isprintable() or key == "headers" and not value.isascii():
                return (f"{key}.{name} holds a control or non-ASCII character (a stray CR "
                        "or LF?); fix the value")
    for key in ("tool_timeout_ms", "startup_timeout_ms"):
        value = getattr(c, key)
        if type(value) is not int or not 0 < value <= _DAY_MS:  # no bool
            return f"{key} must be between 1 and {_DAY_MS} (a day)"
    if c.transport == "stdio":
        return None if c.command else 'transport "stdio" needs command = "..."'
    return f"url {problem}" if (problem := url_problem(c.url)) else None


def _secrets(cfg: McpServerConfig) -> list[str]:
    """What to mask: values of env/header keys named secret (or in secret_env), any length, as
    JSON and URL text too, and their long words ("Bearer <token>"); others are configuration."""
    found = set()   # str
    # (a key in both env and headers, as a stdio config copied from an HTTP one may have: both)
    for key, value in [*(cfg.env or {}).items(), *(cfg.headers or {}).items()]:
        if secret_name(key) or key in cfg.secret_env:
            for v in {value.strip(), *[w for w in value.split() if len(w) >= 8]} - {""}:
                found |= {v, json.dumps(v)[1:-1], json.dumps(v, ensure_ascii=False)[1:-1],
                          urllib.parse.quote(v, safe=""), urllib.parse.quote_plus(v)}
    return sorted(found, key=len, reverse=True)   # the longest first: no half-masked forms


# ---- 2. Names and results -----------------------------------------------------------------------

def exposed_name(server_id: str, tool: str) -> str:
    """`<server_id>__<tool>` made provider-safe; past 64 chars, cut and suffixed with a hash."""
    name = "".join(c if TOOL_NAME.fullmatch(c) else "_" for c in f"{server_id}__{tool}")
    if TOOL_NAME.fullmatch(name):   # at most 64 characters
        return name
    return f"{name[:55]}_{hashlib.sha256(f'{server_id}/{tool}'.encode()).hexdigest()[:8]}"


def _block_text(block) -> tuple[str, bool]:
    """(text, is_text) of one content block: text as it is, anything else summarised."""
    kind = block.type   # the SDK's content models all have one
    res = getattr(block, "resource", None)   # resource blocks only
    if (text := getattr(res or block, "text", None)) is not None:   # a text block or resource
        return text, True
    if kind in ("image", "audio"):
        size = len(block.data) * 3 // 4 - block.data[-2:].count("=")
        return f"[{kind}: {block.mime_type}, {size} bytes]", False
    if kind == "resource":
        return f"[resource {res.uri}: {res.mime_type}, ~{len(res.blob) * 3 // 4} bytes]", False
    if kind == "resource_link":
        return f"[resource link {block.uri}: {block.mime_type or 'unknown type'}]", False
    return f"[{kind} content]", False


def _result_text(result) -> str:
    """Text blocks joined, other blocks summarised; structuredContent when there is no text."""
    parts = [_block_text(b) for b in result.content]
    if not any(is_text for _, is_text in parts) and result.structured_content is not None:
        parts.insert(0, (json.dumps(result.structured_content, ensure_ascii=False), True))
    return "\n".join(text for text, _ in parts)


def _masked(data, scrub):
    """JSON-like data (a tool's schema) with scrub() applied to every string in it, keys too."""
    if isinstance(data, dict):
        return {scrub(k): _masked(v, scrub) for k, v in data.items()}   # names quote it too
    if isinstance(data, list):
        return [_masked(v, scrub) for v in data]
    return scrub(data) if isinstance(data, str) else data


def _leaf(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups, skipping cancellations."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves = [_leaf(e) for e in exc.exceptions]
    return ([e for e in leaves if not isinstance(e, asyncio.CancelledError)] or leaves)[0]


# ---- 3. One server: the task that owns its SDK session ------------------------------------------

_serving = contextvars.ContextVar("bob_mcp_serving")   # the _Server whose task this is


def _sdk_note(record: logging.LogRecord) -> bool:
    """The SDK logs a stdout line that is not JSON-RPC, an HTTP answer it could not validate
    (it answers the request with an error itself), or a notification it could not validate,
    with a traceback quoting it (cut short: a secret's tail shows), at ERROR or WARNING: for
    our servers, one line, masked, at INFO. An answer it cannot read ("result": null, an
    array) it drops, and the request would wait for its timeout: that request fails now (the
    SDK has no API for this)."""
    server = _serving.get(None)
    if record.funcName not in ("_parse_line", "_on_notify",
                               "_handle_json_response") or server is None:
        return True
    exc = record.exc_info[1] if record.exc_info else None
    # what the server sent: a pydantic ValidationError (its errors are never [], each has the
    # input), or the record's exception itself, if any
    bad = exc.errors()[0]["input"] if hasattr(exc, "errors") else exc
    log.info("[%s] skipped output that is not JSON-RPC or not valid MCP: %s", server.cfg.id,
             server._show(f"{record.getMessage()}: {bad}"))
    if isinstance(bad, dict) and "result" in bad and server.session:   # as the content, which
        server.session._dispatcher._resolve_pending(   # call_tool refuses: an "invalid result"
            bad.get("id"), {"content": bad["result"]})
    return False


def _kill(pgid: int | None, pids: Sequence[int] = ()) -> None:
    """SIGKILL a server's process group and these pids; safe from any thread (no SDK object)."""
    for kill, target in [(os.killpg, pgid), *[(os.kill, pid) for pid in pids]]:
        # OSError: gone (ProcessLookupError) or not ours (PermissionError); TypeError: no group
        with contextlib.suppress(OSError, TypeError):
            kill(target, signal.SIGKILL)


def _descendants(pid: int | None) -> set[int]:
    """Every descendant of pid, from /proc (Linux): a setsid child is tied to it by nothing else."""
    parent = {}   # pid -> its parent's pid
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        with contextlib.suppress(OSError, ValueError, IndexError):   # gone, or not a process
            with open(f"/proc/{entry}/stat", "rb") as f:
                parent[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
    found, new = set(), {pid}   # pid None: no process has it as parent
    while new:
        found |= new
        new = {p for p, pp in parent.items() if pp in new} - found
    return found - {pid}


def _stdio_process(cm, server_id):
    """The stdio server's Process, read from inside the SDK; None, with a warning, if not found.

    A reach into the SDK's internals: mcp 2.3 keeps the Process in a local of stdio_client and
    exposes it nowhere (no attribute, no hook), so bob reads the suspended generator's frame.
    Only read: its returncode (the server exited) and its pid (its process group, whose
    descendants bob records). pyproject.toml pins mcp to the versions the suite checks this
    on (tests/test_round4_mcp.py); without it, bob still runs that server, less well."""
    with contextlib.suppress(AttributeError):   # not an async generator, or it has ended
        process = cm.gen.ag_frame.f_locals.get("process")
        if isinstance(process, anyio.abc.Process):
            return process
    log.warning("MCP server %r: bob cannot see its process in this mcp SDK version (it reads "
                "a local of mcp.client.stdio.stdio_client, checked on mcp 2.3), so orphan "
                "cleanup is off for it: a child that left its process group may outlive bob, "
                "and an exit is noticed at its next call", server_id)


async def _list_all(session: Any) -> list[Any]:
    """Every tool of a session, following tools/list pagination: at most _MAX_PAGES pages
    and _MAX_TOOLS tools (a page may hold any number), else an McpError saying which."""
    tools = []                         # mcp Tool objects
    params = None                      # the first page
    for _ in range(_MAX_PAGES):
        page = await session.list_tools(params=params)
        tools += page.tools
        if len(tools) > _MAX_TOOLS:
            raise McpError(f"it lists {len(tools)} tools or more, over bob's limit of "
                           f"{_MAX_TOOLS} per server; configure it to offer fewer tools (many "
                           "servers can enable only some toolsets), or leave it out")
        if not page.next_cursor:
            return tools
        params = mcp.types.PaginatedRequestParams(cursor=page.next_cursor)
    raise McpError(f"tools/list sent over {_MAX_PAGES} pages (a nextCursor that never ends?)")


class _Server:
    """One configured MCP server. Each run of it (its start, each restart) is owned by the task
    running _own(), on the loop; start() begins a run, once the last one has ended."""

    def __init__(self, cfg: McpServerConfig):
        self.cfg = cfg
        self.closing = False                # stop() was called: ending now is not a death
        self._secrets = _secrets(cfg)
        self.start()

    def start(self) -> None:
        """Begin a run: a new owner task connects, initializes and lists the tools. Not once
        stop() was called: a restart a call or a turn began while bob closes would outlive it."""
        if self.closing:
            return
        self.tools = []                     # mcp Tool objects of the session
        self.session = None                 # its ClientSession while it takes calls
        self.dead = None                    # why it stopped by itself (a str); restarted next turn
                                            # (after a 404, at once: see call())
        self.list_changed = False           # tools/list_changed came: re-list next turn
        self.pgid = None                    # a plain int, so close() may use it from any thread
        self._family = []                   # its descendants' pids, read just before it ends
        self.tail = collections.deque(maxlen=_TAIL_LINES)   # its last stderr lines (str)
        self._process = None                # the stdio server's Process, when we can see it
        self._error = None                  # why the run failed (an Exception): its owner's
                                            # error, else the transport's under a call
        self._stderr = -1                   # our end of the stderr pipe (stdio), once open
        self._partial = b""                 # stderr read and not yet logged: the start of a
                                            # line still being written
        self.status = 0                     # HTTP: 401, 403 or 404 once seen (_on_response)
        # the startup timeout's scope (cancelled by stop() too); then the wait's, in _own()
        self._scope = anyio.move_on_after(self.cfg.startup_timeout_ms / 1000)
        self.ready = asyncio.get_running_loop().create_future()   # awaited: None or McpError
        self.task = asyncio.create_task(self._own())   # the owner of this run

    async def _own(self) -> None:
        _serving.set(self)   # the SDK's reader tasks inherit it: _sdk_note names us
        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await self._connect(stack)
                # Sampling, elicitation, unconfigured roots: SDK defaults decline (unadvertised)
                session = await stack.enter_async_context(mcp.ClientSession(
                    read, write, list_roots_callback=self._roots if self.cfg.roots else None,
                    message_handler=self._on_message,
                    client_info=mcp.types.Implementation(name="bob", version="1")))
                await session.initialize()
                self.tools = await _list_all(session)
                self.session = session
                self._scope.deadline = math.inf   # started: the startup timeout is over
                self.ready.set_result(None)
                with anyio.CancelScope() as self._scope:  # cancelled: leave the SDK's managers
                    while getattr(self._process, "returncode", None) is None:   # it may exit
                        # Who to kill at the end, seen while it runs: once it died, a setsid
                        # child of it is re-parented, tied to it by nothing.
                        self._family = _descendants(self.pgid)
                        await anyio.sleep(_POLL_S)
        except Exception as e:
            self._error = e
        finally:
            self.session = None
            # The SDK stopped the server (stdin, SIGTERM, SIGKILL); what is left in its group
            # are orphans, e.g. the node process of an npx that died: kill them too.
            _kill(self.pgid, self._family)
            if self._stderr >= 0:
                self._read_stderr(final=True)
            self._finish()

    async def _connect(self, stack: contextlib.AsyncExitStack):
        """Open the transport, its context managers entered on `stack`: its (read, write)."""
        cfg = self.cfg
        if cfg.transport == "streamable_http":
            stack.enter_context(self._scope)   # (the startup timeout, stop(); see below)
            http = mcp.client.streamable_http
            client = await stack.enter_async_context(http.create_mcp_http_client(cfg.headers))
            client.event_hooks["response"].append(self._on_response)   # the SDK hides statuses
            return await stack.enter_async_context(
                http.streamable_http_client(cfg.url, http_client=client))  # url: checked
        self._stderr, write_fd = os.pipe()   # the server's stderr: to the log, never the terminal
        os.set_blocking(self._stderr, False)
        asyncio.get_running_loop().add_reader(self._stderr, self._read_stderr)
        with os.fdopen(write_fd, "w") as errlog:     # closed here once the child holds a copy
            cm = mcp.stdio_client(mcp.StdioServerParameters(
                command=cfg.command, args=cfg.args, env=cfg.env, cwd=cfg.cwd,
                encoding_error_handler="replace"),   # bad bytes: U+FFFD, the line goes on
                errlog)
            streams = await stack.enter_async_context(cm)
        self._process = _stdio_process(cm, cfg.id)
        self.pgid = getattr(self._process, "pid", None)   # its own process group
        # The startup timeout and stop() from here on, once its group is known: a stop() that
        # landed while it spawned (Ctrl-C or SIGTERM as bob starts) killed its pid alone
        # (asyncio's doing: bob never learnt it), and a child in its group outlived bob.
        # Spawning is bounded; a stop() meanwhile lands at the next await.
        stack.enter_context(self._scope)
        return streams

    def _finish(self) -> None:
        """Say why the owner ended: to start() while starting, else in `dead` for the calls."""
        code = getattr(self._process, "returncode", None)
        ready = self.ready.done()                 # False: it never started
        leaf = _leaf(self._error)                 # the real error (None if none)
        if isinstance(leaf, mcp.MCPError) and leaf.error.code == mcp.types.CONNECTION_CLOSED:
            leaf = None                   # it ended the connection; its exit code says more
            if code == -signal.SIGTERM:   # the SDK's stop, at EOF
                code = None
        if not ready and self.closing:
            cause = "stopped while starting"
        elif not ready and self._scope.cancelled_caught:
            cause = f"no answer to the MCP handshake within {self.cfg.startup_timeout_ms} ms"
        elif self.status in (401, 403):   # the SDK says "Server returned an error response"
            cause = (f"HTTP {self.status}: check the token in its headers "
                     f"{sorted(self.cfg.headers or {})}")
        elif self.status == 404:          # the SDK says "Session terminated" or "Not Found"
            cause = "HTTP 404: it does not know bob's session (it restarted?) or this URL"
        elif leaf is None:   # not what bob did to it after an error: the SDK's error says why
            cause = "closed the connection" if code is None else f"exited (code {code})"
        else:
            hint = " (is it installed and on PATH?)" if isinstance(leaf, FileNotFoundError) else ""
            cause = ("failed: " if ready else "") + f"{type(leaf).__name__}: {leaf}{hint}"
        tail = "; stderr:\n  " + "\n  ".join(self.tail) if self.tail else ""
        if not ready:   # dead too: a restart a call began is tried once more at the next turn
            self.dead = self._scrub(f"MCP server {self.cfg.id!r} failed to start: {cause}{tail}")
            self.ready.set_exception(McpError(self.dead))
            self.ready.exception()   # seen: when a call restarted it, none may await it
            self.status = 0          # a failed start is no lost session: calls do not retry it
        elif not self.closing:
            self.dead = self._scrub(f"server {self.cfg.id} {cause}{tail}")
            log.warning("MCP %s\nbob will try to restart it: at once for a call that met a "
                        "lost session (404), else on the next turn", self.dead)

    def _scrub(self, text: str) -> str:
        """The text with the server's secrets masked (its output, SDK or HTTP errors quote them).
        A validation error's quote of what a server sent is left out, wherever it comes (a start
        or a call failing, a tool result): pydantic cuts it short ("{'a': 'x', ... ...ALUE123'}"),
        and the head or tail of a secret cut so is no whole form to mask (a server echoing the
        Authorization header). One line of 300 characters at most: linear, and the rest stays."""
        text = _INPUT_QUOTE.sub("input_value=(left out)", text)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _show(self, text: str) -> str:
        """A line the server wrote, fit to show: masked, no controls, at most _SHOWN chars."""
        text = self._scrub(text)[:_SHOWN]
        return "".join(c if c.isprintable() else "\ufffd" for c in text)   # no ESC, no BEL

    def _read_stderr(self, final: bool = False) -> None:
        """Log stderr lines (INFO), keep the last; when readable, and once more (final) at exit."""
        last = final                              # no more to read: at exit, or at EOF
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self._stderr, 65536):
                self._partial += chunk
                if not final:                     # one read per call, the loop calls again
                    break
            else:
                last = True                       # every holder of the write end closed it
        lines = self._partial.split(b"\n")
        self._partial = b"" if last else lines.pop()[-65536:]  # a line without end
        if last:
            asyncio.get_running_loop().remove_reader(self._stderr)
        for line in filter(None, lines):
            self.tail.append(self._show(line.decode("utf-8", "replace").rstrip()))
            log.info("[%s] %s", self.cfg.id, self.tail[-1])
        if final:
            os.close(self._stderr)

    async def _on_response(self, response) -> None:
        """Keep the first status that says why a start or a call failed, where the SDK says
        only "Server returned an error response" or "Session terminated": 401 or 403 (check
        the token), 404 (the server lost the session: every request of it gets one)."""
        if response.status_code in (401, 403, 404) and not self.status:
            self.status = response.status_code

    async def _roots(self, context):   # the SDK's roots/list callback
        paths = [Path(p).resolve() for p in self.cfg.roots]
        return mcp.types.ListRootsResult(roots=[
            mcp.types.Root(uri=p.as_uri(), name=p.name) for p in paths])

    async def _on_message(self, message) -> None:
        if isinstance(message, mcp.types.ToolListChangedNotification):
            self.list_changed = True          # acted on before the next turn

    async def call(self, tool: str, arguments: dict[str, Any], timeout_s: float,
                   retry=True) -> tuple[str, bool]:
        """(text, is_error) of one tool call, unmasked; a server that is gone is error text.
        A Streamable HTTP server that answers 404 has lost bob's session (it restarted): as
        the MCP spec says, a new session (initialize again), then the same call once more
        (retry), all within timeout_s; a second 404 is the call's error result: the server's
        JSON-RPC error if it sent one (then the new session stays), else `HTTP 404`."""
        deadline = time.monotonic() + timeout_s
        try:
            json.dumps(arguments, ensure_ascii=False).encode()
        except UnicodeEncodeError:   # the SDK's writer would fail on it and end the session
            return "the arguments hold a lone surrogate (a cut emoji?): call with valid text", True
        # Started (at once, usually); or a restart under way: another call met a 404. The run
        # this call waits for may have ended as it began, and another call's restart begun
        # meanwhile: then it waits for the new run (it took the new run's state for the ended
        # one's: a start not done, and said `timed out` in ~30 ms).
        run = None
        while run is not self.task:
            run = self.task
            # Not started at the deadline (a restart still under way): call_tool says timed out
            if not (await asyncio.wait({self.ready}, timeout=deadline - time.monotonic()))[0]:
                raise TimeoutError
        if self.session:   # else it is gone already
            try:
                result = await self.session.call_tool(tool, arguments,
                                                      read_timeout_seconds=timeout_s)
                return _result_text(result), result.is_error
            except mcp.MCPError as e:   # a server may send the codes the SDK uses for its own
                err = e.error
                if err.code == mcp.types.REQUEST_TIMEOUT and err.message.startswith("Request "):
                    raise TimeoutError
                # The server's error, unless the session is gone: a 404 (below; but a second
                # one, on the session just begun, is the server's own JSON-RPC error if it sent
                # one: the SDK's stand-in for a body that is none says "Session terminated"), or
                # the SDK's own "Connection closed" (the session ended under the call)
                gone = self.status == 404 and (retry or err.message == "Session terminated")
                if not gone and (err.code, err.message, err.data) != (
                        mcp.types.CONNECTION_CLOSED, "Connection closed", None):
                    # the session answers: a 404 met on it is over (kept, the next error of
                    # the session was taken for a lost one, and the call sent twice)
                    self.status = 0
                    return f"MCP error from server {self.cfg.id}: {err.message}", True
            except (RuntimeError, ValueError) as e:   # it answered, but not with a valid result
                return f"invalid result from server {self.cfg.id}: {e}", True
            except Exception as e:                    # the transport failed (e.g. HTTP refused)
                self._error = e
            self._scope.cancel()                      # let the owner exit and say why
        # HTTP 404: the server lost the session, met by this call or by another that has not
        # begun the new session yet (calls in flight with it get "Connection closed"). Read
        # before the owner has ended: a restart resets it.
        lost = self.status == 404
        await asyncio.wait({run}, timeout=_GRACE_S)
        if lost and retry:
            if self.dead:                             # not restarted yet by another call
                self.start()
                self.list_changed = True              # the next turn publishes its new list
            return await self.call(tool, arguments, max(0.001, deadline - time.monotonic()),
                                   retry=False)
        return f"executor unavailable: {self.dead or f'server {self.cfg.id} stopped'}", True

    async def stop(self, timeout_s: float) -> None:
        """Stop the server, bounded: the SDK closes stdin, terminates, kills; then its group."""
        self.closing = True
        self._scope.cancel()                      # before start() too: the owner ends at once
        if not (await asyncio.wait({self.task}, timeout=max(timeout_s, 0.05)))[0]:
            _kill(self.pgid)
            self.task.cancel()
            await asyncio.wait({self.task}, timeout=1.0)


# ---- 4. McpToolPort: the loop thread and the sync API -------------------------------------------

def _outcome(future, timeout_s, what):
    """The future's result, waiting at most timeout_s (else McpError: "MCP servers did not
    <what> in N s"), and bob's _CTRL_C_SLICE_S at most at a time: a Ctrl-C the kernel hands to
    the port's loop thread reaches the caller at once. (Blocking SIGINT in the loop thread
    instead would leave it blocked in every server that thread starts.)"""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # Wakes at once when the future is done or cancelled, from any thread (a cancel wakes
        # no concurrent.futures.wait()); its own exception is returned, a TimeoutError too
        with contextlib.suppress(TimeoutError):   # this wait's
            future.exception(_CTRL_C_SLICE_S)
            break
    else:
        raise McpError(f"MCP servers did not {what} in {timeout_s:.0f} s")
    return future.result()


class McpToolPort:
    """A ToolPort over MCP servers, tools exposed as `<server_id>__<tool>`; a context manager."""

    def __init__(self, servers: Sequence[McpServerConfig]):
        ids = [s.id for s in servers]
        for server_id in ids:
            if ids.count(server_id) > 1:
                raise ConfigError(f"MCP server id {server_id!r} is used twice; ids must be unique")
        self._configs = tuple(servers)
        self._servers = []    # the running _Servers, in config order
        self._names = {}      # exposed name -> (_Server, MCP name of the tool)
        # self._tools, the ToolDescriptors list_tools() returns: set by _publish() once started
        # start() makes the loop thread (self._thread) and its asyncio event loop (self._loop)
        self._started = None         # the concurrent Future of _start_all, made by start()
        self._lock = threading.Lock()          # guards start() and close()
        self._closed = False
        self._close_done = concurrent.futures.Future()   # done once the first close() is done
        self._startup_s = max([s.startup_timeout_ms / 1000 for s in servers], default=0) + _GRACE_S

    def __enter__(self) -> McpToolPort:
        try:
            return self.start()
        except KeyboardInterrupt:   # the with's body and __exit__ never run: stop them here
            self.close()            # (a failed start closes the port itself, at once)
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, wait: bool = True) -> McpToolPort:
        """Start all servers concurrently; wait=False returns at once (first use waits instead)."""
        with self._lock:
            if self._closed:
                raise McpError("this McpToolPort is closed; create a new one")
            if self._started is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._run_loop, daemon=True)
                self._thread.start()
                atexit.register(self.close)       # no server outlives bob, whatever happens
                # (the filter is inert for records of other servers' or no server's tasks)
                for name in ("mcp.client.stdio", "mcp.client.streamable_http", "client"):
                    logging.getLogger(name).addFilter(_sdk_note)
                self._started = asyncio.run_coroutine_threadsafe(self._start_all(), self._loop)
        if wait:
            self._wait_started()
        return self

    def _run_loop(self) -> None:
        self._loop.run_forever()                  # until close() stops it
        self._loop.run_until_complete(self._loop.shutdown_default_executor())
        self._loop.close()

    async def _start_all(self) -> None:
        global anyio, mcp   # the module names at the top: bound here, on first start
        try:                # on the port's thread: start(wait=False) returns at once
            import anyio.abc
            import mcp.client.streamable_http
        except ImportError as e:
            raise McpError(f"MCP servers need the MCP SDK ({e}); pip install mcp") from e
        servers = self._servers = [_Server(c) for c in self._configs]
        results = await asyncio.gather(*(s.ready for s in servers), return_exceptions=True)
        self._servers = []
        failed = []
        for server, error in zip(servers, results):
            if error is None:
                self._servers.append(server)
            elif server.cfg.required:
                failed.append(error)
            else:
                log.warning("%s\nSkipping it (required = false); the other servers run.", error)
        if failed:   # _wait_started() closes the port, which stops the servers that did start
            raise McpError("\n".join(map(str, failed)))
        self._publish()

    def _publish(self) -> None:
        """Rebuild the name map and the descriptors from the servers' tool lists. Of two tools
        exposed under one name the first is kept, with a warning (a server's bug, or two ids
        that rename to one): no server fails for it, an optional one least of all."""
        names = {}   # as self._names
        tools = []
        clashes = []   # a warning per tool skipped (str): the first is logged, with the count
        for server in self._servers:
            for tool in server.tools:
                name = exposed_name(server.cfg.id, server._scrub(tool.name))  # as shown
                if name in names:
                    other, other_tool = names[name]
                    fix = "the server lists both" if other is server else "rename a server id"
                    clashes.append(f"MCP tool name clash: {other.cfg.id!r} tool {other_tool!r} "
                                   f"and {server.cfg.id!r} tool {tool.name!r} are both exposed as "
                                   f"{name!r}; skipping the second ({fix})")
                    continue
                names[name] = (server, tool.name)
                tools.append(ToolDescriptor(name, server._scrub(tool.description or ""),
                                            _masked(tool.input_schema, server._scrub)))
        if clashes:   # one line: a server listing one name 1,000 times would fill the log
            log.warning(f"{clashes[0]}; {len(clashes)} tools skipped in all")
        self._names, self._tools = names, tools   # swapped whole: read by other threads

    def _wait_started(self) -> None:
        if self._started is None:
            raise McpError("this McpToolPort is not started: call start(), or use it in a with")
        try:
            _outcome(self._started, self._startup_s, "start")
        except Exception:  # a failed start (or one stuck past its time) leaves nothing running;
                           # the error goes up at once
            threading.Thread(target=self.close, daemon=True).start()
            raise
        if self._closed:
            raise McpError("this McpToolPort is closed; create a new one")

    def list_tools(self) -> list[ToolDescriptor]:
        """Tools of the running servers; called once a turn: restarts the dead, re-lists changed."""
        self._wait_started()
        # Restarting or re-listing servers. A Ctrl-C or a timeout here does not cancel that
        # (each step is bounded): none is lost, and a later list_tools() returns what it found
        _outcome(asyncio.run_coroutine_threadsafe(self._before_turn(), self._loop),
                 self._startup_s, "answer")
        return list(self._tools)

    async def _before_turn(self) -> None:
        """Restart the dead servers and re-list the changed ones, all at once: each is bounded
        by its startup_timeout_ms, so together they end within the wait for them."""
        async def refresh(server):
            try:
                if server.dead:                   # restart it: a new run
                    server.start()
                    await server.ready
                else:
                    server.list_changed = False
                    with anyio.fail_after(server.cfg.startup_timeout_ms / 1000):
                        server.tools = await _list_all(server.session)
            except Exception as e:
                if server.dead:                   # the restart failed: drop it for good
                    self._servers = [s for s in self._servers if s is not server]
                    log.warning("%s\nIts tools are unavailable until bob restarts.", e)
                else:   # the re-listing failed (too many tools...): it keeps serving the old list
                    log.warning("MCP server %r: listing tools failed: %s", server.cfg.id,
                                server._scrub(repr(e)))
            self._publish()   # as each ends: a wait cut short has what ended listed already

        await asyncio.gather(*(refresh(s) for s in self._servers if s.dead or s.list_changed))

    def call_tool(self, call: ToolCall, timeout_s: float,
                  cancel: CancelToken | None = None) -> ToolResult:
        """Call a tool; `cancel` cancels the MCP request (notifications/cancelled). Failures are
        is_error results; raises McpError only if the port is unusable (not started, closed)."""
        self._wait_started()
        start = time.monotonic()
        entry = self._names.get(call.name)
        if entry is None:
            text, is_error = f"unknown tool {call.name!r}; call one of the listed tools", True
        else:
            server, tool = entry
            limit = max(0.001, min(timeout_s, server.cfg.tool_timeout_ms / 1000))
            future = asyncio.run_coroutine_threadsafe(server.call(tool, call.arguments, limit),
                                                      self._loop)
            forget = cancel.on_cancel(future.cancel) if cancel else lambda: None
            try:   # the SDK times the call out itself; this wait is only the backstop
                text, is_error = _outcome(future, limit + 1.0, "answer")
                text = server._scrub(text)
            except (McpError, TimeoutError):   # the backstop's timeout, or call()'s
                text, is_error = f"tool {tool} timed out after {round(limit * 1000)} ms", True
            except concurrent.futures.CancelledError:
                text, is_error = f"tool {tool} cancelled", True
            finally:   # a timeout, a cancel, a Ctrl-C: the server is told to stop working on it
                forget()
                future.cancel()   # a no-op once it is done
        return ToolResult(call.id, call.name, text, is_error, (time.monotonic() - start) * 1000)

    def tool_sources(self) -> dict[str, str]:
        """Exposed tool name -> id of the server providing it (for listings such as /tools)."""
        return {name: server.cfg.id for name, (server, _) in self._names.items()}

    async def _stop_all(self) -> None:
        deadline = time.monotonic() + _CLOSE_S
        for server in reversed(self._servers):
            await server.stop(deadline - time.monotonic())

    def close(self) -> None:
        """Stop every server (in reverse order), then the loop thread: bounded, idempotent, and
        registered with atexit by start(), so no server outlives bob."""
        with self._lock:
            first, self._closed = not self._closed, True
        if not first:   # another thread is closing: return once it is done (its own waits
            # end it in _CLOSE_S + 3 s at most; past _CLOSE_S + 5, McpError), or at a Ctrl-C
            _outcome(self._close_done, _CLOSE_S + 5.0, "stop")
            return
        try:
            if self._started is None:   # never started: nothing runs
                return
            try:   # the servers, on the loop (which goes on stopping them after a Ctrl-C)
                _outcome(asyncio.run_coroutine_threadsafe(self._stop_all(), self._loop),
                         _CLOSE_S + 2.0, "stop")
                concurrent.futures.wait([self._started], 1.0)  # let a startup finish
            except BaseException as e:  # the loop is stuck, or Ctrl-C: kill them from here
                log.warning("MCP servers were not stopped (%r); killing them", e)
                for server in self._servers:
                    server.closing = True   # so its end is no death (no restart, no warning)
                    _kill(server.pgid, server._family)
                if not isinstance(e, Exception):
                    raise
            self._loop.call_soon_threadsafe(self._loop.stop)   # then the loop
            self._thread.join(2.0)
        finally:
            self._close_done.set_result(None)
            atexit.unregister(self.close)   # only now: an exit meanwhile still waits for it
