"""bob_mcp: the tools of MCP servers as one bob ToolPort, while bob's loop stays synchronous.

    from bob import AgentRequest, AgentRuntime, OpenAICompatLlm
    from bob_mcp import McpServerConfig, McpToolPort

    fs = McpServerConfig("fs", command="npx",
                         args=("-y", "@modelcontextprotocol/server-filesystem", "."))
    with McpToolPort([fs]) as tools:                  # starts the servers, stops them at exit
        agent = AgentRuntime(OpenAICompatLlm("openai:gpt-4o-mini"), tools)
        print(agent.run(AgentRequest("List the files here.")).content)   # calls fs__list_directory

Sections:
    1. Errors and configuration
    2. Names and results
    3. One server: the task that owns its SDK session
    4. McpToolPort: the loop thread and the sync API

Threading: the port owns one asyncio loop thread. Each server is owned by one task that enters
the SDK's transport and session context managers and exits them itself (the SDK's task groups
must be exited by the task that entered them). Sync callers hand coroutines to the loop and always
wait with a timeout; no SDK object is touched outside the loop thread.
Vendoring: copy this file next to bob.py; it needs the `mcp` package, version 2.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from bob import BobError, ConfigError, ToolCall, ToolDescriptor, ToolResult

try:
    import anyio
    from mcp import ClientSession, MCPError, StdioServerParameters, stdio_client
    from mcp import types as mcp_types
    from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"bob_mcp needs the MCP SDK ({e}); install it with: pip install mcp") from e

__all__ = ["McpError", "McpServerConfig", "McpToolPort", "exposed_name"]

log = logging.getLogger("bob.mcp")

_TAIL_LINES = 8         # stderr lines kept per server for error messages
_POLL_S = 0.2           # how often a stdio server's owner checks that its process is alive
_GRACE_S = 7.0          # beyond configured timeouts: the SDK's own bounded shutdown steps
_CLOSE_S = 8.0          # close(): total budget before process groups are killed outright


# ---- 1. Errors and configuration ----------------------------------------------------------------

class McpError(BobError):
    """An MCP server could not be started or reached; the message names the server and the cause."""


@dataclass(frozen=True)
class McpServerConfig:
    """One `[[mcp.servers]]` entry. env and header values never appear in repr, logs or errors."""
    id: str
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
    roots: tuple[str, ...] | None = None      # answered to roots/list; default: bob's cwd

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", tuple(self.args))
        if self.roots is not None:
            object.__setattr__(self, "roots", tuple(self.roots))
        where = f"MCP server {self.id!r}"
        if not isinstance(self.id, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.id):
            raise ConfigError(f"{where}: id must be 1-64 letters, digits, '_' or '-'")
        if self.transport not in ("stdio", "streamable_http"):
            raise ConfigError(f"{where}: transport must be 'stdio' or 'streamable_http', "
                              f"got {self.transport!r}")
        if self.transport == "stdio" and not self.command:
            raise ConfigError(f"{where}: transport 'stdio' needs command = \"...\"")
        if self.transport == "streamable_http" and not str(self.url or "").startswith("http"):
            raise ConfigError(f"{where}: transport 'streamable_http' needs url = \"http...\"")
        if not all(isinstance(a, str) for a in self.args):
            raise ConfigError(f"{where}: args must be a list of strings")
        for name in ("env", "headers"):       # checked here: the SDK's errors would echo values
            value = getattr(self, name)
            if value is not None and not (isinstance(value, dict) and all(
                    isinstance(k, str) and isinstance(v, str) for k, v in value.items())):
                raise ConfigError(f"{where}: {name} must be a table of strings")
        for name in ("tool_timeout_ms", "startup_timeout_ms"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{where}: {name} must be a positive integer, got {value!r}")


# ---- 2. Names and results -----------------------------------------------------------------------
# Providers accept tool names matching ^[a-zA-Z0-9_-]{1,64}$; MCP tool names are freer.

def exposed_name(server_id: str, tool: str) -> str:
    """`<server_id>__<tool>` made provider-safe; past 64 chars, cut and suffixed with a hash."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", f"{server_id}__{tool}")
    if len(name) <= 64:
        return name
    return f"{name[:55]}_{hashlib.sha256(f'{server_id}/{tool}'.encode()).hexdigest()[:8]}"


def _block_text(block: Any) -> tuple[str, bool]:
    """(text, is_text) of one content block: text as it is, anything else summarised."""
    kind, res = getattr(block, "type", "unknown"), getattr(block, "resource", None)
    if kind == "text" or hasattr(res, "text"):
        return (block.text if kind == "text" else res.text), True
    if kind in ("image", "audio"):
        size = len(block.data) * 3 // 4 - block.data[-2:].count("=")
        return f"[{kind}: {block.mime_type}, {size} bytes]", False
    if kind == "resource":
        return f"[resource {res.uri}: {res.mime_type}, ~{len(res.blob) * 3 // 4} bytes]", False
    if kind == "resource_link":
        return f"[resource link {block.uri}: {block.mime_type or 'unknown type'}]", False
    return f"[{kind} content]", False


def _result_text(result: Any) -> str:
    """Text blocks joined, other blocks summarised; structuredContent when there is no text."""
    parts = [_block_text(b) for b in result.content]
    if not any(is_text for _, is_text in parts) and result.structured_content is not None:
        parts.insert(0, (json.dumps(result.structured_content, ensure_ascii=False), True))
    return "\n".join(text for text, _ in parts)


def _leaf(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups, skipping cancellations."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves = [_leaf(e) for e in exc.exceptions]
    return ([e for e in leaves if not isinstance(e, asyncio.CancelledError)] or leaves)[0]


# ---- 3. One server: the task that owns its SDK session ------------------------------------------

def _kill_group(pgid: int | None) -> None:
    """SIGKILL a server's process group; safe from any thread (it touches no SDK object)."""
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


async def _list_all(session: Any) -> list[Any]:
    """Every tool of a session, following tools/list pagination."""
    tools, cursor = [], None
    while True:
        page = await session.list_tools(
            params=mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools, cursor = tools + page.tools, page.next_cursor
        if not cursor:
            return tools


class _Server:
    """One MCP server; everything here runs on the port's loop thread."""

    def __init__(self, cfg: McpServerConfig, roots: tuple[str, ...]):
        self.cfg, self.roots = cfg, roots
        self.tools: list[Any] = []          # mcp Tool objects of the current session
        self.pgid: int | None = None        # a plain int, so close() may use it from any thread
        self.failed = False                 # a restart failed: its tools are gone for good
        self.closing = False                # stop() was called: exiting is not a death
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.session = self.task = self._scope = self.dead = None
        self.list_changed = False

    async def start(self) -> None:
        """Start (or restart) the owner task; return once it is ready, or raise McpError."""
        self.session = self._process = self._scope = self._broken = self.dead = None
        self.pgid = None
        self.list_changed = False
        self.tail.clear()
        self._stop, self._ready = asyncio.Event(), asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(self._own(), name=f"mcp-{self.cfg.id}")
        await self._ready

    async def _own(self) -> None:
        error, self._stderr = None, None
        try:
            deadline = anyio.current_time() + self.cfg.startup_timeout_ms / 1000
            with anyio.CancelScope(deadline=deadline) as self._scope:
                if not self.closing:
                    await self._session_lifetime()
        except Exception as e:
            error = e
        finally:
            self.session = None
            # The SDK stopped the server (stdin, SIGTERM, SIGKILL); what is left in its group
            # are orphans, e.g. the node process of an npx that died: kill them too.
            _kill_group(self.pgid)
            if self._stderr is not None:
                self._drain(self._stderr, final=True)
            self._finish(error)

    async def _session_lifetime(self) -> None:
        async with contextlib.AsyncExitStack() as stack:
            read, write = await self._open_transport(stack)
            session = await stack.enter_async_context(ClientSession(
                read, write, list_roots_callback=self._roots, message_handler=self._on_message,
                client_info=mcp_types.Implementation(name="bob", version="1")))
            await session.initialize()
            self.tools = await _list_all(session)
            self.session, self._scope.deadline = session, math.inf
            self._ready.set_result(None)
            while not self._stop.is_set() and getattr(self._process, "returncode", None) is None:
                with anyio.move_on_after(_POLL_S):    # a stdio server may also just exit
                    await self._stop.wait()

    async def _open_transport(self, stack: contextlib.AsyncExitStack) -> Any:
        cfg = self.cfg
        if cfg.transport == "streamable_http":
            client = await stack.enter_async_context(create_mcp_http_client(headers=cfg.headers))
            return await stack.enter_async_context(
                streamable_http_client(cfg.url, http_client=client))
        self._stderr, write_fd = os.pipe()   # the server's stderr: to the log, never the terminal
        os.set_blocking(self._stderr, False)
        asyncio.get_running_loop().add_reader(self._stderr, self._drain, self._stderr)
        self._partial = b""
        with os.fdopen(write_fd, "w") as errlog:     # closed here once the child holds a copy
            cm = stdio_client(StdioServerParameters(
                command=cfg.command, args=list(cfg.args), env=cfg.env, cwd=cfg.cwd), errlog)
            streams = await stack.enter_async_context(cm)
        # The SDK keeps the Process in a local of stdio_client and exposes it nowhere. We read it
        # (never write) for its exit code and its pid, which is its process group (new session).
        frame = getattr(getattr(cm, "gen", None), "ag_frame", None)
        self._process = frame.f_locals.get("process") if frame is not None else None
        self.pgid = getattr(self._process, "pid", None)
        return streams

    def _finish(self, error: BaseException | None) -> None:
        tail = "; stderr:\n  " + "\n  ".join(self.tail) if self.tail else ""
        if not self._ready.done():
            self._ready.set_exception(McpError(
                f"MCP server {self.cfg.id!r} failed to start: {self._cause(error)}{tail}"))
        elif not self.closing:
            cause = self._cause(error)
            verb = "" if cause.startswith(("exited", "closed")) else "failed: "
            self.dead = f"server {self.cfg.id} {verb}{cause}{tail}"
            log.warning("MCP %s\nbob will try to restart it on the next turn", self.dead)

    def _cause(self, error: BaseException | None) -> str:
        error, code = error or self._broken, getattr(self._process, "returncode", None)
        if self.closing and not self._ready.done():
            return "stopped while starting"
        if not self._ready.done() and self._scope is not None and self._scope.cancelled_caught:
            return f"no answer to the MCP handshake within {self.cfg.startup_timeout_ms} ms"
        if code is not None or error is None:
            return "closed the connection" if code is None else f"exited (code {code})"
        leaf = _leaf(error)
        hint = " (is it installed and on PATH?)" if isinstance(leaf, FileNotFoundError) else ""
        return f"{type(leaf).__name__}: {leaf}{hint}"

    def _drain(self, fd: int, final: bool = False) -> None:
        """Move the server's stderr into the log (INFO), keeping the last lines for errors."""
        data = None
        with contextlib.suppress(BlockingIOError):
            while data := os.read(fd, 65536):
                *lines, self._partial = (self._partial + data).split(b"\n")
                for line in lines:
                    self._keep(line)
                if not final:                 # the loop calls again while there is more
                    return
        if final or data == b"":              # EOF, or the owner is done with the server
            if self._partial:
                self._keep(self._partial)
            self._partial = b""
            asyncio.get_running_loop().remove_reader(fd)
        if final:
            os.close(fd)

    def _keep(self, line: bytes) -> None:
        self.tail.append(line.decode("utf-8", "replace").rstrip())
        log.info("[%s] %s", self.cfg.id, self.tail[-1])

    async def _roots(self, context: Any) -> Any:
        return mcp_types.ListRootsResult(roots=[
            mcp_types.Root(uri=Path(p).resolve().as_uri(), name=Path(p).name) for p in self.roots])

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, mcp_types.ToolListChangedNotification):
            self.list_changed = True          # acted on before the next turn
        elif isinstance(message, Exception):
            log.debug("MCP server %r transport error: %r", self.cfg.id, message)

    async def call(self, tool: str, arguments: dict[str, Any], timeout_s: float
                   ) -> tuple[str, bool]:
        """(text, is_error) of one tool call; a server that is gone becomes error text too."""
        if self.dead or self.session is None:
            why = self.dead or f"server {self.cfg.id} is not running"
            return f"executor unavailable: {why}", True
        try:
            result = await self.session.call_tool(tool, arguments, read_timeout_seconds=timeout_s)
            return _result_text(result), bool(result.is_error)
        except MCPError as e:
            if e.error.code == mcp_types.REQUEST_TIMEOUT:
                return f"tool {tool} timed out after {round(timeout_s * 1000)} ms", True
            if e.error.code != mcp_types.CONNECTION_CLOSED:
                return f"MCP error from server {self.cfg.id}: {e.error.message}", True
        except (RuntimeError, ValueError) as e:   # it answered, but not with a valid result
            return f"invalid result from server {self.cfg.id}: {e}", True
        except Exception as e:                    # the transport failed (e.g. HTTP refused)
            self._broken = e
        self._stop.set()                          # let the owner exit and say why
        await asyncio.wait({self.task}, timeout=_GRACE_S)
        return f"executor unavailable: {self.dead or f'server {self.cfg.id} stopped'}", True

    async def refresh(self) -> None:
        """Re-list the tools after notifications/tools/list_changed."""
        self.list_changed = False
        with anyio.fail_after(self.cfg.startup_timeout_ms / 1000):
            self.tools = await _list_all(self.session)

    async def stop(self, timeout_s: float) -> None:
        """Stop the server (the SDK closes stdin, then terminates and kills the group), bounded."""
        self.closing = True
        if self.task is None:                     # start() has not run yet; it will see closing
            return
        if self.session is not None:
            self._stop.set()                      # the owner exits its context managers itself
        elif self._scope is not None:
            self._scope.cancel()                  # still starting
        if not (await asyncio.wait({self.task}, timeout=max(timeout_s, 0.05)))[0]:
            _kill_group(self.pgid)
            self.task.cancel()
            await asyncio.wait({self.task}, timeout=1.0)


# ---- 4. McpToolPort: the loop thread and the sync API -------------------------------------------

class McpToolPort:
    """A ToolPort over MCP servers, tools exposed as `<server_id>__<tool>`; a context manager."""

    def __init__(self, servers: Sequence[McpServerConfig]):
        ids = [s.id for s in servers]
        for dup in sorted({i for i in ids if ids.count(i) > 1}):
            raise ConfigError(f"MCP server id {dup!r} is used twice; ids must be unique")
        self._configs = tuple(servers)
        self._servers: list[_Server] = []                  # running ones, in config order
        self._names: dict[str, tuple[_Server, str]] = {}   # exposed name -> (server, MCP name)
        self._tools: list[ToolDescriptor] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: concurrent.futures.Future | None = None
        self._lock, self._closed = threading.Lock(), False
        startup_ms = max((s.startup_timeout_ms for s in servers), default=0)
        self._startup_s = startup_ms / 1000 + _GRACE_S

    def __enter__(self) -> McpToolPort:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, wait: bool = True) -> McpToolPort:
        """Start all servers concurrently. With wait=False it returns at once, and the first
        list_tools/call_tool waits for startup instead (re-raising its McpError)."""
        with self._lock:
            if self._closed:
                raise McpError("this McpToolPort is closed; create a new one")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._run_loop, name="bob-mcp", daemon=True)
                self._thread.start()
                atexit.register(self.close)       # no server outlives bob, whatever happens
                self._started = asyncio.run_coroutine_threadsafe(self._start_all(), self._loop)
        if wait:
            self._wait_started()
        return self

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.close()

    async def _start_all(self) -> None:
        servers = self._servers = [_Server(c, c.roots or (os.getcwd(),)) for c in self._configs]
        results = await asyncio.gather(*(s.start() for s in servers), return_exceptions=True)
        failed = [r for s, r in zip(servers, results) if r is not None and s.cfg.required]
        for s, r in zip(servers, results):
            if r is not None and not s.cfg.required:
                log.warning("%s\nSkipping it (required = false); the other servers run.", r)
        self._servers = [s for s, r in zip(servers, results) if r is None]
        try:
            if failed:
                raise failed[0] if len(failed) == 1 else McpError("\n".join(map(str, failed)))
            self._publish()
        except BaseException:
            await self._stop_all(_CLOSE_S)
            raise

    def _publish(self) -> None:
        """Rebuild the name map and the descriptors from the servers' tool lists."""
        names: dict[str, tuple[_Server, str]] = {}
        tools = []
        for server in (s for s in self._servers if not s.failed):
            for tool in server.tools:
                name = exposed_name(server.cfg.id, tool.name)
                if name in names:
                    other, other_tool = names[name]
                    raise McpError(
                        f"MCP tool name clash: server {other.cfg.id!r} tool {other_tool!r} and "
                        f"server {server.cfg.id!r} tool {tool.name!r} are both exposed as "
                        f"{name!r}; rename one of the server ids")
                names[name] = (server, tool.name)
                tools.append(ToolDescriptor(name, tool.description or "", tool.input_schema))
        self._names, self._tools = names, tools   # swapped whole: read by other threads

    def _wait_started(self) -> None:
        if self._started is None:
            raise McpError("this McpToolPort is not started: call start(), or use it in a with")
        try:
            self._started.result(self._startup_s)
        except concurrent.futures.TimeoutError:
            raise McpError(f"MCP servers did not finish starting in {self._startup_s:.0f} s")
        except Exception:
            self.close()                  # a failed start leaves nothing running
            raise
        if self._closed:
            raise McpError("this McpToolPort is closed; create a new one")

    def _run(self, coro: Any, timeout_s: float) -> Any:
        """Run a coroutine on the loop and wait at most timeout_s; on timeout cancel it there."""
        # Leaner than run_coroutine_threadsafe: the result is handed over the moment the
        # coroutine returns, not one loop iteration later (measured in bench/mcp_overhead.py).
        future: concurrent.futures.Future = concurrent.futures.Future()
        tasks: list[asyncio.Task] = []

        async def bridge() -> None:
            try:
                future.set_result(await coro)
            except BaseException as e:  # handed to the waiting thread, never lost
                future.set_exception(e)

        self._loop.call_soon_threadsafe(lambda: tasks.append(self._loop.create_task(bridge())))
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:   # scheduled after the append above: FIFO
            self._loop.call_soon_threadsafe(lambda: tasks[0].cancel())
            raise

    def list_tools(self) -> list[ToolDescriptor]:
        """The tools of every running server. The runtime calls it once per turn, so this is
        also where a server that died is restarted (once) and list_changed is acted on."""
        self._wait_started()
        try:
            self._run(self._before_turn(), self._startup_s)
        except concurrent.futures.TimeoutError:
            raise McpError(f"restarting or re-listing MCP servers took over {self._startup_s} s")
        return list(self._tools)

    async def _before_turn(self) -> None:
        todo = [s for s in self._servers if (s.dead and not s.failed) or s.list_changed]
        for server in todo:
            try:
                await (server.start() if server.dead else server.refresh())
            except McpError as e:
                server.failed = True
                log.warning("%s\nIts tools are unavailable until bob restarts.", e)
            except Exception as e:
                log.warning("MCP server %r: listing tools failed: %r", server.cfg.id, e)
        if todo:
            try:
                self._publish()
            except McpError as e:
                log.error("%s\nKeeping the previous tool list.", e)

    def call_tool(self, call: ToolCall, timeout_s: float) -> ToolResult:
        """Call a tool on its server. Tool errors, timeouts and a dead server are is_error
        results; raises McpError only when the port itself is unusable (not started, closed)."""
        self._wait_started()
        start = time.monotonic()
        entry = self._names.get(call.name)
        if entry is None:
            text, is_error = f"unknown tool {call.name!r}; call one of the listed tools", True
        else:
            server, tool = entry
            limit = max(0.001, min(timeout_s, server.cfg.tool_timeout_ms / 1000))
            try:   # the SDK times the call out itself; this wait is only the backstop
                text, is_error = self._run(server.call(tool, call.arguments, limit), limit + 1.0)
            except concurrent.futures.TimeoutError:
                text, is_error = f"tool {tool} timed out after {round(limit * 1000)} ms", True
        return ToolResult(call.id, call.name, text, is_error, (time.monotonic() - start) * 1000)

    def tool_sources(self) -> dict[str, str]:
        """Exposed tool name -> id of the server providing it (for listings such as /tools)."""
        return {name: server.cfg.id for name, (server, _) in self._names.items()}

    async def _stop_all(self, budget_s: float) -> None:
        deadline = time.monotonic() + budget_s
        for server in reversed(self._servers):
            await server.stop(deadline - time.monotonic())

    def close(self) -> None:
        """Stop every server in reverse order, then the loop thread. Bounded in time,
        idempotent, and registered with atexit by start(), so no server outlives bob."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        if self._loop is None:
            return
        try:
            self._run(self._stop_all(_CLOSE_S), _CLOSE_S + 2.0)
            concurrent.futures.wait([self._started], timeout=1.0)   # let a startup finish
        except Exception as e:  # the loop is stuck: kill the servers from this thread
            log.warning("MCP servers did not stop in time (%r); killing them", e)
            for server in self._servers:
                _kill_group(server.pgid)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2.0)
