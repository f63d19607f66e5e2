"""bob: a small, synchronous LLM agent turn loop you can read in one sitting.

    from bob import AgentRuntime, AgentRequest, FunctionTools, OpenAICompatLlm

    def add(a: int, b: int) -> int:
        "Add two integers."
        return a + b

    llm = OpenAICompatLlm("openai:gpt-4o-mini")          # or "ollama:llama3.2", ...
    agent = AgentRuntime(llm, FunctionTools([add]))
    result = agent.run(AgentRequest("What is 2 + 40? Use the tool."))
    print(result.content, result.finish_reason)

Sections:
    1. Errors                 7. Session stores
    2. Domain types           8. Masking, event sinks and the trace
    3. Ports                  9. Workers: threads with deadlines and cancel
    4. Actions and prompts   10. The scheduler: State, _Turn, AgentRuntime
    5. LoopGuard             11. LLM adapters: ScriptedLlm, OpenAICompatLlm
    6. Tools                 12. Replay

A turn in brief (section 10). AgentRuntime.run walks one _Turn through these states,
checking each step against TRANSITIONS and emitting it. Each state is one method of _Turn
(the table _Turn.WORK) that does its work and returns the next state; the guards it checks
are LoopGuard's (section 5). A tripped guard, a cancel, an answer, a question or a pause ends
the turn through _Turn.end; AgentRuntime._done saves it.

    START         _Turn.start: loads the session, lists the tools (the turn deadline and
                  cancel hold), adds the input or takes up a paused batch.
    BUILD_PROMPT  _Turn.build_prompt: the system prompt and the history cut to
                  max_history_messages, in the wire shape of the action mode.
    LLM_INFER     _Turn.llm_infer: checks cancel, then before_llm_call (turn_timeout_ms,
                  max_consecutive_errors, max_steps); calls the model, again with half the
                  history while the endpoint says the request is too long.
    PARSE_ACTION  _Turn.parse_action: the reply as an action (one re-prompt if it is none). An
                  answer or a question ends the turn; tool calls first pass check_text
                  (max_stagnation_steps).
    CALL_TOOL     _Turn.call_tool: checks cancel, max_parallel_tools (the batch is refused and
                  the loop goes on), check_loop (max_repeated_batches); each call's deny_tools
                  and unknown names, and ask_tools decisions (the approver, or a pause);
                  check_budget (turn_timeout_ms, max_tool_calls). Then runs the batch, each
                  call within tool_timeout_ms, and appends the results in call order.
    DONE          AgentRuntime._done: saves the session, emits turn_completed, returns the
                  result or raises.

Vendoring: copy this file. It needs Python >= 3.11 and the standard library; `requests` is
imported only when an OpenAICompatLlm is created. Nothing happens at import time.
"""
from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import email.utils
import enum
import fnmatch
import functools
import hashlib
import html
import inspect
import bisect
import itertools
import json
import logging
import math
import os
import queue
import random
import re
import select
import socket
import stat
import threading
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Protocol, Sequence, Union

__all__ = [
    "BobError", "ConfigError", "LlmError", "ActionParseError", "StoreError", "AgentError",  # errors
    "Cancelled", "TraceError",
    # domain
    "Message", "ToolDescriptor", "ToolCall", "ToolResult", "Final", "CallTools", "AskUser",
    "AgentAction", "TurnPolicy", "Usage", "FinishReason", "GuardReason", "AgentRequest", "Approval",
    "AgentRunResult", "CancelToken", "SessionState", "AgentEvent", "LlmRequest", "LlmResponse",
    # ports
    "LlmPort", "ToolPort", "SessionStore", "EventSink",
    # functions and adapters, and the trace's digest
    "parse_action", "action_schema", "truncate_history", "is_denied", "abandoned_workers",
    "FunctionTools",
    "CompositeToolPort", "InMemorySessionStore", "JsonFileSessionStore", "LoggingEventSink",
    "JsonlEventSink", "AgentRuntime", "ScriptedLlm", "OpenAICompatLlm", "PROVIDERS",
    "RETRYABLE_STATUSES", "TOOL_NAME", "HEADER_NAME",
    # the trace and replay
    "request_digest", "replay", "ReplayReport", "ReplayLlm", "ReplayTools", "read_trace",
]
__version__ = "0.2.0"
TRACE_FORMAT = 1   # the format of what a trace records (README: "The trace")

log = logging.getLogger("bob")


# ---- 1. Errors ----------------------------------------------------------------------------------
# One root, so `except BobError` catches everything bob raises on purpose. Tool failures, guard
# trips and cancellation are never exceptions to the caller: they are results.

class BobError(Exception):
    """Root of every error bob raises on purpose."""


class ConfigError(BobError, ValueError):
    """A bad setting: the message names the setting and how to fix it."""


class LlmError(BobError):
    """The LLM endpoint failed after retries; carries the HTTP status and a body excerpt."""

    def __init__(self, message: str, status_code: int | None = None, body: str = ""):
        super().__init__(message)
        self.status_code = status_code
        self.body = body


class ActionParseError(BobError):
    """The model's reply is not one valid JSON action."""


class StoreError(BobError):
    """A session could not be loaded or saved (the message names it); a failed save: `result`."""
    result: AgentRunResult | None = None


class AgentError(BobError):
    """The turn could not go on (e.g. the model answered garbage twice in a row)."""


class Cancelled(BobError):
    """Raised by a port that noticed its cancel token; the runtime turns it into a result."""


# ---- 2. Domain types ----------------------------------------------------------------------------

# JSON read back (a session file, a reply) is checked as it is read: a wrong type is a ValueError
# naming the field, never a TypeError later (the store turns it into a StoreError naming the file).

def _want(value, kind, what):
    """`value` if it is a `kind` (dict: a JSON object, list: an array), else ValueError."""
    if not isinstance(value, kind):
        raise ValueError(f"{what} is not a JSON {'object' if kind is dict else 'array'}")
    return value


def _excerpt(text, n=200):
    return text if len(text) <= n else f"{text[:n]}... ({len(text)} chars)"


def _str(value):
    """`value` if it is a str, else None (a server may send anything where text belongs)."""
    return value if isinstance(value, str) else None


def _field(d, key, kinds, default=None):
    """`d[key]` (`default` when absent) if it is one of `kinds`, a type or a tuple of types
    (a bool is no int)."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    value = d.get(key, default)
    if not isinstance(value, kinds) or (type(value) is bool and bool not in kinds):
        got = type(value).__name__ if key in d else "nothing"
        raise ValueError(f"{key!r} must be {' or '.join(k.__name__ for k in kinds)}, got {got}")
    return value


# _field's kinds of a value that may be null (built once: a session's load reads thousands)
_OPTIONAL_STR = (str, types.NoneType)
_OPTIONAL_DICT = (dict, types.NoneType)


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for; `arguments` is a JSON object."""
    id: str
    name: str
    arguments: dict[str, Any]
    error: str | None = None  # why the model's arguments are unusable: not run, the model is told
    extra: dict[str, Any] | None = None  # what the server attached to the call (Gemini's
    #                                      extra_content, its thought signature): sent back with it

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict; `error` only when set."""
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass(frozen=True)
class ToolResult:
    """What a tool call gave back; `content` is text for the model."""
    call_id: str
    name: str
    content: str
    is_error: bool = False
    duration_ms: float = 0.0


def _error(call, text):
    """An error result for `call`."""
    return ToolResult(call.id, call.name, text, True)


@dataclass(frozen=True)
class ToolDescriptor:
    """A tool as the model sees it; `input_schema` is a JSON Schema object."""
    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass(frozen=True)
class Message:
    """One history entry. Role is system, user, assistant or tool; the same in both action modes."""
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    is_error: bool = False
    reasoning: str | None = None  # the model's reasoning_content with its tool calls (DeepSeek
    #                               thinking mode wants it back)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict; `Message.from_dict` reverses it exactly."""
        # role and content always; the others when set (not None, False or no calls). A save
        # of loaded messages does not come here (the file store writes their text again)
        d = {k: v for k, v in vars(self).items()
             if k in ("role", "content") or v not in (None, False, ())}
        if self.tool_calls:
            d["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Message:
        """Build a Message from `to_dict` output; ValueError naming a field that is wrong."""
        role = _field(_want(d, dict, "a message"), "role", str)
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"a message has the unknown role {_excerpt(role)!r}")
        # each call: an object (checked as its first field is read), then its fields
        calls = tuple(ToolCall(_field(_want(c, dict, "a tool call"), "id", str),
                               _field(c, "name", str), _field(c, "arguments", dict),
                               _field(c, "error", _OPTIONAL_STR),
                               _field(c, "extra", _OPTIONAL_DICT))
                      for c in _field(d, "tool_calls", list, []))
        return cls(role, _field(d, "content", str), calls,
                   _field(d, "tool_call_id", _OPTIONAL_STR), _field(d, "name", _OPTIONAL_STR),
                   _field(d, "is_error", bool, False), _field(d, "reasoning", _OPTIONAL_STR))


@dataclass(frozen=True)
class Final:
    """The model's answer; ends the turn."""
    content: str


@dataclass(frozen=True)
class CallTools:
    """One or more tool calls to run as a batch."""
    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class AskUser:
    """The model needs the user; ends the turn with the question as content."""
    question: str


AgentAction = Final | CallTools | AskUser


@dataclass(frozen=True)
class TurnPolicy:
    """The limits of one turn. Every limit is checked; a bad value is a ConfigError."""
    max_steps: int = 12                 # LLM calls per turn
    max_tool_calls: int = 8             # tool calls run per turn
    max_consecutive_errors: int = 3     # error results in a row before the turn stops
    turn_timeout_ms: int = 90_000       # wall-clock budget of the whole turn
    tool_timeout_ms: int = 15_000       # per tool call, never past the turn deadline
    max_history_messages: int = 50      # non-system messages sent to the model
    max_parallel_tools: int = 8         # calls one batch may hold
    max_repeated_batches: int = 2       # identical batches allowed per turn (the next trips)
    max_stagnation_steps: int = 5       # identical assistant texts allowed per turn
    max_tool_output_chars: int = 20_000  # longer outputs are cut to head + tail

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            low = 200 if name == "max_tool_output_chars" else 1
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"TurnPolicy.{name} must be an integer, got {value!r}")
            if value < low:
                raise ConfigError(f"TurnPolicy.{name} must be at least {low}, got {value}")
            if name.endswith("timeout_ms") and value > 86_400_000:  # thread waits overflow
                raise ConfigError(f"TurnPolicy.{name} must be at most 86400000 (a day), "
                                  f"got {value}")


# the kinds of a policy that may be None (AgentRequest's, AgentRuntime's), as _OPTIONAL_STR
_OPTIONAL_POLICY = (TurnPolicy, types.NoneType)


@dataclass(frozen=True)
class Usage:
    """Token counts; add them with `+` (a new Usage: one is never changed, so one zero Usage()
    is every field's default)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.prompt_tokens + other.prompt_tokens,
                     self.completion_tokens + other.completion_tokens)

    @property
    def total_tokens(self) -> int:
        """prompt + completion."""
        return self.prompt_tokens + self.completion_tokens


class FinishReason(str, enum.Enum):
    """Why a turn ended."""
    FINAL = "final"
    ASK_USER = "ask_user"
    GUARD_EXCEEDED = "guard_exceeded"
    CANCELLED = "cancelled"
    NEEDS_APPROVAL = "needs_approval"   # paused on tool calls waiting for a person's decision


class GuardReason(str, enum.Enum):
    """Which limit ended a turn with GUARD_EXCEEDED."""
    MAX_STEPS = "max_steps"
    MAX_TOOL_CALLS = "max_tool_calls"
    MAX_CONSECUTIVE_ERRORS = "max_consecutive_errors"
    TURN_TIMEOUT = "turn_timeout"
    LOOP_DETECTED = "loop_detected"
    STAGNATION = "stagnation"


def _given(obj, **kinds):
    """ConfigError naming the first field of `obj` that is none of its `kinds` (see _field)."""
    try:
        for key, kind in kinds.items():
            _field(vars(obj), key, kind)
    except ValueError as e:
        raise ConfigError(f"{type(obj).__name__}: {e}") from None


@dataclass(frozen=True)
class Approval:
    """A decision on one tool call: `reason` is told the model if declined; `arguments` replace."""
    allow: bool
    reason: str = ""
    arguments: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _given(self, allow=bool, reason=str, arguments=_OPTIONAL_DICT)


@dataclass
class AgentRequest:
    """One user turn; `history` replaces the stored one; `input=None` + `approvals` resumes."""
    input: str | None
    session_id: str = "default"
    system_prompt: str | None = None
    policy: TurnPolicy | None = None
    history: list[Message] | None = None
    approvals: dict[str, Approval] | None = None

    def __post_init__(self) -> None:   # a bad value saved would make the session unloadable
        _given(self, input=_OPTIONAL_STR, session_id=str, policy=_OPTIONAL_POLICY)


@dataclass
class AgentRunResult:
    """The outcome of a turn; `history` is the whole session after it, ready to pass back."""
    content: str
    finish_reason: FinishReason
    guard_reason: GuardReason | None
    usage: Usage
    steps: int
    tool_calls: int
    history: list[Message]
    pending: tuple[ToolCall, ...] = ()  # the calls waiting for a decision (NEEDS_APPROVAL)


def _paused(p, n):
    """A paused turn as AgentRuntime saved it (counts, decisions), checked; else ValueError
    naming the part that is not as bob saved it."""
    # the guard's counts: integers, or dicts of integers; never the policy or the deadline
    counts = _field(p, "guard", dict)
    numbers = [i for v in counts.values() for i in (v.values() if isinstance(v, dict) else [v])]
    if "policy" in counts or "deadline" in counts or not all(type(i) is int for i in numbers):
        raise ValueError("the paused turn's guard counts are not as bob saved them")
    # each decision: what Approval takes (it checks the types itself: a ConfigError)
    for decision in _field(p, "approvals", dict).values():
        try:
            Approval(**decision)
        except TypeError:   # not an object, or a field missing or unknown
            raise ValueError("a decision of the paused turn is not as bob saved it") from None
    # the input the turn answers: one of the messages
    if not 0 <= _field(p, "input_index", int) < n:
        raise ValueError("the paused turn's input_index is past its messages")
    return p


@dataclass
class SessionState:
    """What a SessionStore keeps per session."""
    messages: list[Message] = field(default_factory=list)
    usage: Usage = Usage()
    version: int = 0
    paused: dict[str, Any] | None = None  # a turn waiting for approvals: its counts, decisions

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return {"version": self.version, "usage": dataclasses.asdict(self.usage),
                "paused": self.paused, "messages": [m.to_dict() for m in self.messages]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SessionState:
        """Reverse of `to_dict`; ValueError naming what is wrong."""
        u = _field(_want(d, dict, "the session"), "usage", dict, {})
        messages = [Message.from_dict(m) for m in _field(d, "messages", list)]
        paused = _field(d, "paused", _OPTIONAL_DICT)
        return cls(messages, Usage(_field(u, "prompt_tokens", int, 0),
                                   _field(u, "completion_tokens", int, 0)),
                   _field(d, "version", int, 0),
                   None if paused is None else _paused(paused, len(messages)))


class CancelToken:
    """A thread-safe cancel flag around a threading.Event, with callbacks run on cancel."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks = []   # functions of no argument, run once at cancel

    def cancel(self) -> None:
        """Set the flag and run the callbacks once; safe from any thread, idempotent."""
        with self._lock:   # a second cancel finds no callbacks left
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb()
            except Exception:  # a callback must not stop the others
                log.exception("cancel callback failed")

    @property
    def cancelled(self) -> bool:
        """True once cancel() was called."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until cancelled or timeout; return whether cancelled."""
        return self._event.wait(timeout)

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run `callback` at cancel (now, if already cancelled); returns a function to remove it."""
        with self._lock:
            if not self.cancelled:
                self._callbacks.append(callback)
                return lambda: self._remove(callback)
        callback()
        return lambda: None

    def _remove(self, callback):
        with self._lock, contextlib.suppress(ValueError):   # ValueError: removed already
            self._callbacks.remove(callback)


@dataclass(frozen=True)
class AgentEvent:
    """One observable step of the loop; `data` holds plain JSON values only."""
    kind: str
    session_id: str
    step: int
    data: dict[str, Any]
    ts: float


@dataclass(frozen=True)
class LlmRequest:
    """What the runtime asks of an LlmPort: `messages` in the action mode's wire shape (json mode:
    tool results as user messages), `tools` in both modes (json mode: for the action's schema,
    not as a `tools` field), `response_format` "json" or None, `deadline` monotonic."""
    messages: list[Message]
    tools: list[ToolDescriptor]
    response_format: str | None
    deadline: float | None


@dataclass(frozen=True)
class LlmResponse:
    """What an LlmPort returns. `finish_reason` is None when the endpoint did not say."""
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Usage = Usage()
    finish_reason: str | None = None
    reasoning: str | None = None   # the server's reasoning_content, when it sends one


# ---- 3. Ports -----------------------------------------------------------------------------------
# The scheduler talks only to these. Adapters implement them structurally; nothing inherits.

class LlmPort(Protocol):
    """A chat model: blocks until the reply is complete (text may stream to `on_delta`); on
    `cancel` it should stop and raise Cancelled (the runtime stops waiting anyway); LlmError."""

    def complete(self, req: LlmRequest, cancel: CancelToken,
                 on_delta: Callable[[str], None] | None = None) -> LlmResponse:
        """The model's whole reply to `req`."""


class ToolPort(Protocol):
    """A set of tools: tool failures are is_error results (raise only if the tools are gone);
    a port that can stop a call stops it when `cancel` fires (a Python function runs on)."""

    def list_tools(self) -> list[ToolDescriptor]:
        """The tools the model may call."""

    def call_tool(self, call: ToolCall, timeout_s: float,
                  cancel: CancelToken | None = None) -> ToolResult:
        """Run one call within `timeout_s`; its result, an error result included."""


class SessionStore(Protocol):
    """Keeps sessions between turns. `load` returns None for an unknown id; errors: StoreError."""

    def load(self, session_id: str) -> SessionState | None:
        """The stored session, or None."""

    def save(self, session_id: str, state: SessionState) -> None:
        """Store the session; StoreError if `state.version` is not past the stored one."""


class EventSink(Protocol):
    """Receives every event synchronously, so it must be quick. Exceptions are logged, ignored."""

    def emit(self, event: AgentEvent) -> None:
        """Take one event."""


# ---- 4. Actions and prompts ---------------------------------------------------------------------
# The JSON action contract, its parser, the system prompt, and how history goes on the wire.

ACTION_CONTRACT = """\
Reply with exactly one JSON object and nothing else, in one of these forms:
{"type": "final", "content": "..."} to answer the user;
{"type": "tool_call", "name": "...", "arguments": {...}} to call a tool (see its input schema);
{"type": "ask_user", "question": "..."} to ask the user what you need to know.
Call one tool at a time; you will see its result, then reply again."""

DEFAULT_INSTRUCTIONS = "You are a helpful assistant. Use the tools when they help."

_FENCE = re.compile(r"^```(?:json)?(.*)```$", re.DOTALL | re.IGNORECASE)  # linear: one .*
_THINK = re.compile(r"^\s*<think>.*?</think>", re.DOTALL)  # reasoning models' (Qwen3, R1) preamble
_json = functools.partial(json.loads, strict=False)  # raw newlines and tabs in strings pass
# JSON as the model reads it (an action, a tool's value, a call's arguments): other scripts as
# they are, not as \u escapes
_model_json = functools.partial(json.dumps, ensure_ascii=False)
_DECODER = json.JSONDecoder(strict=False)
_BAD_JSON = (ValueError, RecursionError)  # bad JSON, an int past the digit limit, deep nesting
_MAX_DEPTH = 100  # of a model's JSON: no tool needs more, and a session holding JSON near
#                   Python's recursion limit could not be saved and loaded again


def _json_problem(value):
    """Why JSON from the model is unfit to keep (json could not write or read it back), or None."""
    stack = [(value, 0)]   # not recursive: the value may be as deep as json parses
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list, tuple)):
            if depth >= _MAX_DEPTH:
                return f"nests deeper than {_MAX_DEPTH} levels"
            if isinstance(v, dict) and not all(isinstance(k, str) for k in v):
                return "has a key that is not a string"   # a custom LlmPort's; json sorts keys
            stack.extend(zip(v.values() if isinstance(v, dict) else v, itertools.repeat(depth + 1)))
        elif isinstance(v, int) and v.bit_length() > 14_000:  # ~4,200 digits; the limit: 4,300
            return "holds an integer over 4,000 digits long"
        elif isinstance(v, float) and v - v:   # inf - inf and nan - nan are nan: no JSON has them
            return "holds NaN or Infinity, which JSON does not allow"
        elif not isinstance(v, (str, int, float, types.NoneType)):  # a custom port's bytes, objects
            return f"holds a value of type {type(v).__name__}, which JSON does not have"
    return None


def _required_str(obj, key, kind):
    value = obj.get(key)
    if not isinstance(value, str) or (key == "name" and not value):
        raise ActionParseError(f'a {kind} action needs a string "{key}" field')
    return value


def _read_json(body):
    """The JSON value of `body`; failing that, of `body` with HTML entities for its quotes
    (&#34;, &quot;: small models write them) and a trailing sentence after it, if that sentence
    holds no second object: unambiguous, so read rather than re-prompted."""
    try:
        return _json(body)
    except json.JSONDecodeError:
        text = html.unescape(body)
        with contextlib.suppress(json.JSONDecodeError):
            value, end = _DECODER.raw_decode(text)
            if "{" not in text[end:]:
                return value
        raise   # the body's own error, not the second reading's


def parse_action(text: str, call_id: str = "call_1") -> AgentAction:
    """One JSON action (whitespace, a leading <think> block, a ```json fence tolerated, and
    the sloppiness _read_json reads)."""
    body = _THINK.sub("", text).strip()
    if fenced := _FENCE.match(body):
        body = fenced.group(1).strip()
    if not body:
        raise ActionParseError("the reply was empty")
    try:
        obj = _read_json(body)
    except json.JSONDecodeError as e:  # some messages end in "at" ("string starting at")
        raise ActionParseError(f"the reply is not valid JSON ({e.msg.removesuffix(' at')} at "
                               f"line {e.lineno} column {e.colno})") from None
    except _BAD_JSON:  # past Python's recursion limit or its int-digit limit
        raise ActionParseError("the reply nests too deeply or holds too long an integer") from None
    if problem := _json_problem(obj):
        raise ActionParseError(f"the reply {problem}")
    if not isinstance(obj, dict):
        raise ActionParseError(f"the reply must be a JSON object, not {type(obj).__name__}")
    kind = obj.get("type")
    if kind == "final":
        return Final(_required_str(obj, "content", kind))
    if kind == "ask_user":
        return AskUser(_required_str(obj, "question", kind))
    if kind == "tool_call":
        name = _required_str(obj, "name", kind)
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            raise ActionParseError('"arguments" of a tool_call must be a JSON object')
        return CallTools((ToolCall(call_id, name, args),))
    raise ActionParseError(f'"type" must be "final", "tool_call" or "ask_user", got {kind!r}')


def action_schema(tools: Sequence[ToolDescriptor]) -> dict[str, Any]:
    """The JSON Schema of one action, for servers that constrain decoding to it: final,
    ask_user, and a tool_call per tool, its name as an enum and its input schema."""
    text = {"type": "string"}
    # A tool's schema as a part of this one: one with a "$ref" (pydantic's "#/$defs/X") would
    # point at nothing here, so such a tool's arguments are only asked to be an object (the
    # tool still checks them)
    forms = [("final", {"content": text}), ("ask_user", {"question": text})] + [
        ("tool_call", {"name": {"enum": [t.name]}, "arguments": {"type": "object"}
                       if '"$ref"' in json.dumps(t.input_schema) else t.input_schema})
        for t in tools]
    return {"anyOf": [{"type": "object", "properties": {"type": {"const": kind}, **fields},
                       "required": ["type", *fields], "additionalProperties": False}
                      for kind, fields in forms]}


def build_system_prompt(instructions, tools, mode):
    """Instructions, then (json mode) the action contract and one block per tool: the text of
    the system message (`tools`: ToolDescriptors; `mode`: "json" or "native")."""
    if mode != "json":
        return instructions
    parts = [instructions, "", ACTION_CONTRACT, "", "Tools you can call:" if tools else
             "No tools are available: answer with final or ask_user."]
    for t in tools:
        schema = json.dumps(t.input_schema, separators=(",", ":"), sort_keys=True)
        parts.append(f"- {t.name}: {t.description}\n  input schema: {schema}")
    return "\n".join(parts)


class _Units:
    """Indices of non-system messages in units: an assistant tool call with the results right
    after it, or one other message; a result whose call is not right before it is in none.
    Kept up to date as messages are appended, so a step costs what it sends, not the history."""

    seen = 0   # messages read so far

    def __init__(self):
        self.units = []         # lists of message indices, in order of their first index
        self.system = []        # indices of system messages
        self.open_ids = set()   # ids of the last unit's calls still without a result

    def read(self, messages):
        """Take in the messages appended since the last call."""
        for i in range(self.seen, len(messages)):
            m = messages[i]
            if m.role == "tool":
                if m.tool_call_id in self.open_ids:
                    self.units[-1].append(i)
                    self.open_ids.discard(m.tool_call_id)
            elif m.role != "system":
                self.units.append([i])
                self.open_ids = {c.id for c in m.tool_calls}
            else:
                self.system.append(i)
                self.open_ids = set()
        self.seen = len(messages)
        return self

    def kept(self, limit, keep):
        """Indices of what `truncate_history` sends, in order."""
        units = self.units   # in order of their first index: the unit holding `keep` is found
        at = bisect.bisect_right(units, -1 if keep is None else keep, key=lambda u: u[0]) - 1
        forced = units[at] if at >= 0 and keep in units[at] else []
        room = limit - len(forced)
        system = self.system[::-1][:max(0, room)]   # a given history's count too: dropped
        room -= len(system)                         # last, newest kept
        tail = []
        for u in reversed(units):                 # newest first; the first unit that does not
            if u is not forced:                   # fit ends the walk: only the oldest go
                if len(u) > room:
                    break
                room -= len(u)
                tail += u
        return sorted(system + tail + forced)


def truncate_history(messages: Sequence[Message], limit: int, keep: int | None = None
                     ) -> list[Message]:
    """At most `limit` messages: the newest whole units (see _Units), oldest dropped first, and
    always the unit holding index `keep` (the current question). System messages count too, and
    are dropped last (oldest first), when they alone pass the limit."""
    return [messages[i] for i in _Units().read(messages).kept(limit, keep)]


# An endpoint's words for "the request is too long for the model's context" (OpenAI, vLLM,
# llama.cpp): the adapter names the fix, the scheduler retries the step with half the history.
_CONTEXT_TOO_LONG = re.compile(r"context.(length|window|size)|maximum context|too many tokens|"
                               r"prompt is too long|input is too long|reduce the length", re.I)


def _action_text(m):
    """An assistant message as the JSON action the model would have written."""
    if not m.tool_calls:
        return _model_json({"type": "final", "content": m.content})
    return "\n".join(_model_json({"type": "tool_call", "name": c.name, "arguments": c.arguments})
                     for c in m.tool_calls)


def render_for_wire(m, mode):
    """A history Message as a Message in the action mode's wire shape (see LlmRequest)."""
    if mode != "json":
        return m
    if m.role == "tool":
        status = "failed" if m.is_error else "succeeded"
        return Message("user", f"Tool {m.name} (call {m.tool_call_id}) {status}. "
                               f"Result:\n{m.content}")
    return Message("assistant", _action_text(m)) if m.role == "assistant" else m


# ---- 5. LoopGuard -------------------------------------------------------------------------------
# Every limit of a turn in one place. Each check returns a Trip or None; the scheduler ends
# the turn on a Trip. N = the setting: N LLM calls, N tool calls run, the N-th error in a row
# trips.

@dataclass(frozen=True)
class Trip:
    """A guard that tripped: which limit, and a sentence for the user."""
    reason: GuardReason
    detail: str


class LoopGuard:
    """Counts steps, tool calls, errors, repeated batches and repeated texts in one turn. The
    scheduler's own (not in __all__), like _Turn: `policy` is a TurnPolicy, `deadline` a
    time.monotonic() value, each check's answer a Trip or None, and the calls it is given are
    ToolCalls, the results ToolResults."""

    steps = tool_calls = consecutive_errors = 0   # the counts, from a turn's start
    _repeated = None   # the last batch check_loop saw, if it reached the loop limit

    def __init__(self, policy, deadline):
        self.policy = policy
        self.deadline = deadline
        self._batches = {}   # a batch's signature (check_loop) -> how often it was requested
        self._texts = {}     # an assistant text's sha1 -> how often it was seen

    def out_of_time(self):
        """The turn deadline has passed."""
        if time.monotonic() < self.deadline:
            return None
        return Trip(GuardReason.TURN_TIMEOUT, "the turn took longer than "
                    f"turn_timeout_ms={self.policy.turn_timeout_ms}")

    def before_llm_call(self):
        """Checked before every LLM call: deadline, error streak, step budget."""
        if trip := self.out_of_time():
            return trip
        if self.consecutive_errors >= self.policy.max_consecutive_errors:
            return Trip(GuardReason.MAX_CONSECUTIVE_ERRORS,
                        f"{self.consecutive_errors} tool errors in a row "
                        f"(max_consecutive_errors={self.policy.max_consecutive_errors})")
        if self.steps >= self.policy.max_steps:
            return Trip(GuardReason.MAX_STEPS,
                        f"the model needed more than max_steps={self.policy.max_steps} LLM calls")
        self.steps += 1
        return None

    def check_text(self, text):
        """Stagnation: the same non-final assistant text seen too often (catches A->B->A)."""
        text = text.strip()
        if not text:
            return None
        # the text as a replay sees it (masked), hashed
        key = hashlib.sha1(redact(text).encode("utf-8", "surrogatepass")).hexdigest()
        self._texts[key] = seen = self._texts.get(key, 0) + 1
        if seen > self.policy.max_stagnation_steps:
            return Trip(GuardReason.STAGNATION,
                        f"the model repeated the same reply {seen} times "
                        f"(max_stagnation_steps={self.policy.max_stagnation_steps})")
        return None

    def at_loop_limit(self, calls):
        """This batch, the last check_loop saw, was repeated (requested twice or more) and once
        more trips LOOP_DETECTED. (Not hashed again: asked before every json-mode step.)"""
        return calls is self._repeated

    def check_loop(self, calls):
        """Before a batch runs: the same batch (names, canonical arguments) seen too often."""
        # masked, as a replay sees it; JSON always: the model's calls are checked as they come
        # (parse_action, or _fit in llm_infer), and a resumed batch is not checked again
        sig = "|".join(sorted(c.name + json.dumps(redact(c.arguments), sort_keys=True)
                              for c in calls))
        self._batches[sig] = seen = self._batches.get(sig, 0) + 1
        # (twice at least: with max_repeated_batches=1 every batch would be "at the limit")
        self._repeated = calls if seen >= max(2, self.policy.max_repeated_batches) else None
        if seen > self.policy.max_repeated_batches:
            return Trip(GuardReason.LOOP_DETECTED,
                        f"the same tool calls were requested {seen} times"
                        f"  (max_repeated_batches={self.policy.max_repeated_batches})")
        return None

    def check_budget(self, runnable):
        """Before a batch runs: time left, and room for its `runnable` (not refused) calls?"""
        if trip := self.out_of_time():  # no tool should start with a 0 ms timeout
            return trip
        if self.tool_calls + runnable > self.policy.max_tool_calls:
            return Trip(GuardReason.MAX_TOOL_CALLS, f"{self.tool_calls} tool calls ran and "
                        f"{runnable} more would pass max_tool_calls={self.policy.max_tool_calls}")
        return None

    def record_results(self, results, ran):
        """Count the `ran` calls; each error result (refusals too) extends the error streak,
        any other result ends it."""
        self.tool_calls += ran
        for r in results:
            self.consecutive_errors = self.consecutive_errors + 1 if r.is_error else 0

    # -- a pause and its resume --

    _COUNTS = ("steps", "tool_calls", "consecutive_errors", "_batches", "_texts")

    def counts(self):
        """What a paused turn saves of this guard (session.paused["guard"]): the counts, not
        the policy or the deadline, which the resuming turn brings."""
        return {name: getattr(self, name) for name in self._COUNTS}

    def restore(self, counts):
        """Take up the counts a paused turn saved (counts()) as the resumed turn's own; a
        count not saved stays as it starts."""
        for name in self._COUNTS:
            if name in counts:
                setattr(self, name, counts[name])


# ---- 6. Tools: functions, composite, policy -----------------------------------------------------

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
               tuple: "array", dict: "object"}


def _schema_for(tp):
    """JSON Schema for a type hint: str, int, float, bool, list[X], dict, Optional, Literal."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _JSON_TYPES:
        return {"type": _JSON_TYPES[tp]}
    if origin is Literal:
        return {"type": _JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not types.NoneType]
        return _schema_for(options[0]) if len(options) == 1 else {
            "anyOf": [_schema_for(a) for a in options]}
    if origin in (list, tuple, collections.abc.Sequence):
        return {"type": "array", "items": _schema_for(args[0])} if args else {"type": "array"}
    return {"type": "object"} if origin is dict else {}  # Any or unannotated: accept anything


def _matches(value, schema):
    """A shallow check of a value against a schema made by _schema_for."""
    if "enum" in schema:  # True == 1 in Python, but not in JSON
        return any(value == e and type(value) is type(e) for e in schema["enum"])
    if "anyOf" in schema:
        return any(_matches(value, s) for s in schema["anyOf"])
    kind = schema.get("type")
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    want = {"string": str, "boolean": bool, "array": list, "object": dict, "integer": int,
            "number": (int, float)}.get(kind)
    return not want or isinstance(value, want)


def _expected(schema):
    """What a schema made by _schema_for accepts, in words for an error message."""
    if "enum" in schema:
        return f"one of {json.dumps(schema['enum'])}"
    if "anyOf" in schema:
        return " or ".join(_expected(s) for s in schema["anyOf"])
    return schema.get("type", "any value")


def _ms_since(t0):
    return round((time.perf_counter() - t0) * 1000, 3)


@dataclass(frozen=True)
class _Function:
    fn: Callable                 # the Python function the tool runs
    descriptor: ToolDescriptor   # its input_schema's "properties": name -> schema
    nullable: set                # names (str) of the params that accept None (only read)


def _check_args(f, args):
    """Why `args` do not fit the schema of `f` (a _Function), in words; None when they do."""
    schema = f.descriptor.input_schema
    params = schema["properties"]
    problems = {"unknown arguments": sorted(set(args) - set(params)),
                "missing arguments": [p for p in schema["required"] if p not in args],
                "wrong types": [f"{k} (expected {_expected(params[k])})"
                                for k, v in args.items() if k in params
                                and not (v is None and k in f.nullable)
                                and not _matches(v, params[k])]}
    parts = [f"{what}: {', '.join(names)}" for what, names in problems.items() if names]
    if not parts:
        return None
    return (f"invalid arguments for {f.descriptor.name}: {'; '.join(parts)}. "
            f"Input schema: {json.dumps(schema, sort_keys=True)}")


class FunctionTools:
    """Plain Python functions as tools: schema from type hints, description from the docstring;
    calls run inline (the runtime gives each a worker); a raise is an is_error result."""

    def __init__(self, functions: Iterable[Callable[..., Any]] = ()):
        self._functions = {}   # tool name -> its _Function
        for fn in functions:
            self.add(fn)

    def add(self, fn: Callable[..., Any], name: str | None = None,
            description: str | None = None) -> None:
        """Expose `fn`; ConfigError if the name is taken or a parameter cannot be described."""
        name = name or fn.__name__
        if name in self._functions:
            raise ConfigError(f"FunctionTools: two functions named {name!r}; pass name=...")
        try:
            hints, params = typing.get_type_hints(fn), inspect.signature(fn).parameters
        except (NameError, TypeError, ValueError) as e:
            raise ConfigError(f"FunctionTools: cannot read the signature of {name}: {e}") from e
        props = {}
        required = []
        nullable = set()
        for arg, p in params.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ConfigError(f"FunctionTools: {name}() takes *args/**kwargs; tools need "
                                  "named parameters")
            hint = hints.get(arg, Any)
            props[arg] = _schema_for(hint)
            if types.NoneType in typing.get_args(hint):
                nullable.add(arg)
            if p.default is p.empty:
                required.append(arg)
            # a scalar default (a bool is an int), shown unless the name says it is a secret or
            # JSON has no such value (math.inf, NaN: a strict server refused every request)
            elif isinstance(p.default, (str, int, float)) and not (
                    secret_name(arg) or _json_problem(p.default)):
                props[arg]["default"] = p.default   # _schema_for's dict: fresh each time
        schema = {"type": "object", "properties": props, "required": required,
                  "additionalProperties": False}
        desc = description or (inspect.getdoc(fn) or "").split("\n\n")[0].strip() or name
        self._functions[name] = _Function(fn, ToolDescriptor(name, desc, schema), nullable)

    def list_tools(self) -> list[ToolDescriptor]:
        """The descriptors, in the order the functions were added."""
        return [f.descriptor for f in self._functions.values()]

    def call_tool(self, call: ToolCall, timeout_s: float,
                  cancel: CancelToken | None = None) -> ToolResult:
        """Validate the arguments, call the function, turn its return value into text."""
        t0 = time.perf_counter()
        f = self._functions.get(call.name)
        try:
            if not f:
                raise LookupError(f"unknown tool {call.name!r}")
            problem = _check_args(f, call.arguments)
            if not problem:   # (a problem is never "")
                value = f.fn(**call.arguments)
                text = value if isinstance(value, str) else _model_json(value, default=str)
        except Exception as e:
            problem = f"{type(e).__name__}: {e}"
        # bad arguments, or the function raised: an error result
        return ToolResult(call.id, call.name, problem or text, problem is not None, _ms_since(t0))


def _globs(what, patterns):
    """The patterns (a list, tuple or set of str) as a tuple, else ConfigError (a str would
    be read as one-letter globs)."""
    if isinstance(patterns, (list, tuple, set)) and all(
            isinstance(p, str) for p in patterns):
        return tuple(patterns)
    raise ConfigError(f"{what} must be a list of glob patterns, e.g. [\"shell\"], "
                      f"got {patterns!r}")


def _run_tool(port, call, timeout_s, cancel):
    """port.call_tool, given `cancel` only if its signature names it (the first published form,
    call_tool(call, timeout_s), did not)."""
    # A class's method is asked once (each call's bound method has the same function), any
    # other callable each time (it may not be a valid dict key: a callable object bound with
    # types.MethodType, equal by value, was not, and the call never ran)
    method = getattr(port.call_tool, "__func__", None)
    if (_takes_cancel(method) if inspect.isfunction(method)
            else _takes_cancel.__wrapped__(port.call_tool)):
        return port.call_tool(call, timeout_s, cancel=cancel)
    return port.call_tool(call, timeout_s)


@functools.lru_cache(maxsize=256)   # inspect.signature costs more than a trivial tool call
def _takes_cancel(call_tool):
    return "cancel" in inspect.signature(call_tool).parameters


class CompositeToolPort:
    """Several ToolPorts as one; a tool name offered by two ports is a ConfigError."""

    def __init__(self, ports: Sequence[ToolPort]):
        self._ports = list(ports)
        self.list_tools()  # refuse duplicates now, not in the middle of a turn

    def list_tools(self) -> list[ToolDescriptor]:
        """All tools of all ports, in port order; re-listed each call (ports may change)."""
        owner = {}   # tool name -> the index of its port
        tools = []
        for i, port in enumerate(self._ports):
            for t in port.list_tools():
                if t.name in owner:
                    j = owner[t.name]
                    raise ConfigError(f"tool {t.name!r} is offered by two ports: #{j} "
                                      f"{type(self._ports[j]).__name__} and #{i} "
                                      f"{type(port).__name__}; rename one or leave one out")
                owner[t.name] = i
                tools.append(t)
        self._owner = owner
        return tools

    def call_tool(self, call: ToolCall, timeout_s: float,
                  cancel: CancelToken | None = None) -> ToolResult:
        """Route the call to the port that listed the tool."""
        i = self._owner.get(call.name)
        if i is None:
            return _error(call, f"unknown tool {call.name!r}")
        return _run_tool(self._ports[i], call, timeout_s, cancel)


def is_denied(name: str, patterns: Sequence[str]) -> bool:
    """True if a deny glob (fnmatch, case-sensitive) matches the exposed tool name."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def cut_output(text, limit):
    """Cut text over `limit` chars to head + tail, with a notice of how much was cut (a str)."""
    if len(text) <= limit:
        return text
    # each side keeps half of what leaves room for the notice, so the result stays under the
    # limit; half is at least 50 (its one caller's limit, max_tool_output_chars, is >= 200)
    half = (limit - 100) // 2
    head, tail = text[:half], text[-half:]
    cut = len(text) - 2 * half
    return f"{head}\n[... {cut} of {len(text)} characters cut ...]\n{tail}"


# ---- 7. Session stores --------------------------------------------------------------------------

def _check_newer(session_id, stored, state):
    """A save must be newer than the stored version, else another turn saved in between."""
    if stored is not None and stored >= state.version:
        raise StoreError(f"session {session_id!r} was changed by another turn while this one ran "
                         f"(it is at version {stored}, this turn started from version "
                         f"{state.version - 1}); run the turn again")


class InMemorySessionStore:
    """Sessions in a dict; thread-safe; gone when the process ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions = {}   # session id -> its SessionState

    def load(self, session_id: str) -> SessionState | None:
        """A copy of the stored state, or None."""
        with self._lock:
            s = self._sessions.get(session_id)
            return None if s is None else dataclasses.replace(s, messages=list(s.messages))

    def save(self, session_id: str, state: SessionState) -> None:
        """Store a copy of `state`; StoreError if another turn saved the session meanwhile."""
        with self._lock:
            s = self._sessions.get(session_id)
            _check_newer(session_id, getattr(s, "version", None), state)
            self._sessions[session_id] = dataclasses.replace(state, messages=list(state.messages))


def _head(state):
    """How _session_json's text of `state` begins: all but the messages, up to their "["."""
    return json.dumps(dataclasses.replace(state, messages=[]).to_dict())[:-2]


def _session_json(state, known):
    """`state.to_dict()` as ASCII JSON, messages encoded a thousand at a time: their dicts die
    young, so the GC does not walk a big heap again and again (100,000: 125 ms, not 250-350).
    `known` is (messages, their text) as a load read them, or None: while the state still
    begins with those very messages, that text is written again, not encoded anew (a 20 MB
    session: the save after a cancel took 200-370 ms of CPU here, over the 300 a cancel may
    take)."""
    ms = state.messages
    parts = []
    if known and len(known[0]) <= len(ms) and all(a is b for a, b in zip(known[0], ms)):
        parts.append(known[1])
        ms = ms[len(known[0]):]
    parts += (json.dumps([m.to_dict() for m in ms[i:i + 1000]])[1:-1]   # ASCII: json's default
              for i in range(0, len(ms), 1000))
    return _head(state) + ", ".join(filter(None, parts)) + "]}"


_SESSION_ID = re.compile(r"(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._-]{0,127}")   # fullmatch; no ".."
_HEAD = re.compile(rb'\{\s*"version":\s*(\d+)\s*[,}]')   # how to_dict's JSON begins


_NONBLOCK = getattr(os, "O_NONBLOCK", 0)   # opening a FIFO must not wait for its other end
_SINK_WAIT_S = 5   # how long JsonlEventSink waits for a pipe's reader to take a line


def _read_file(path, size=-1):
    """A regular file's bytes, opened without blocking: a FIFO is an OSError, not a hang."""
    with open(os.open(path, os.O_RDONLY | _NONBLOCK), "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError("it is not a regular file; move it away")
        return f.read(size)


class JsonFileSessionStore:
    """One JSON file per session in `directory`. A save is atomic (temp file, fsync, replace) under
    an OS lock on the directory, so threads and processes saving one session take turns; it waits
    for the lock `lock_timeout_s` at most (another process may hold it for ever): StoreError."""

    def __init__(self, directory: str | os.PathLike[str], lock_timeout_s: float = 5.0):
        self.directory = Path(directory)
        self.lock_timeout_s = lock_timeout_s
        # the session the last load read: its id -> (messages, their JSON text); one only, so a
        # store that loads many sessions keeps no more than one text
        self._known = {}

    def path_for(self, session_id: str) -> Path:
        """The file of a session; StoreError for an id that could escape the directory."""
        if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
            raise StoreError(f"invalid session id {session_id!r}: use 1-128 letters, digits, "
                             "'.', '_' or '-', starting with a letter or digit")
        return self.directory / f"{session_id}.json"

    def load(self, session_id: str) -> SessionState | None:
        """The saved state, None if there is no file; StoreError for an unreadable file."""
        path = self.path_for(session_id)
        try:
            raw = _read_file(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read session file {path}: {e}") from e
        try:  # bad UTF-8 is a ValueError too; deep nesting a RecursionError
            state = SessionState.from_dict(json.loads(raw))
        except _BAD_JSON as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else _excerpt(str(e))
            raise StoreError(f"session file {path} is corrupt ({why}); move it away to start "
                             "that session afresh") from e
        head = _head(state).encode()
        if raw.startswith(head):   # as _session_json wrote it (so it ends in "]}": it parsed)
            self._known = {session_id: (list(state.messages), raw[len(head):-2].decode())}
        return state

    def save(self, session_id: str, state: SessionState) -> None:
        """Write the state; StoreError if another turn saved the session since it was loaded.
        One temp file per session, used under the lock: a killed save leaves at most that one."""
        path = self.path_for(session_id)
        tmp = self.directory / f".{session_id}.json.tmp"
        data = _session_json(state, self._known.pop(session_id, None))
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with self._locked():
                _check_newer(session_id, self._stored_version(session_id), state)
                with contextlib.suppress(FileNotFoundError):  # whatever is there (a planted
                    os.unlink(tmp)     # link, a FIFO), and O_EXCL: never written through
                with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w",
                          encoding="ascii") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
        except OSError as e:
            raise StoreError(f"cannot save session file {path}: {e}") from e

    @contextlib.contextmanager
    def _locked(self):
        """The directory's lock, held while the block runs (a descriptor: released at its close,
        or when the process dies)."""
        import fcntl  # POSIX only; imported here so that `import bob` works anywhere
        lock = os.open(self.directory, os.O_RDONLY)
        since = time.monotonic()
        # any end closes the descriptor: the block's, or ENOLCK (NFS without lockd), a timeout,
        # a Ctrl-C while it waits
        try:
            while True:
                with contextlib.suppress(BlockingIOError):
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                if time.monotonic() - since >= self.lock_timeout_s:
                    raise StoreError(f"session directory {self.directory} is locked by another "
                                     f"process for over {self.lock_timeout_s} s (`fuser -v` "
                                     "names it; or raise lock_timeout_s)")
                time.sleep(0.01)
            yield
        finally:
            os.close(lock)

    def _stored_version(self, session_id):
        """The saved state's version, from the head of its file (else by loading it all)."""
        try:
            head = _HEAD.match(_read_file(self.path_for(session_id), 64))
        except FileNotFoundError:
            return None  # no file yet
        return int(head.group(1)) if head else getattr(self.load(session_id), "version", None)


# ---- 8. Masking, event sinks and the trace ------------------------------------------------------
# Everything bob shows or keeps (events, the trace, what the model sees of the tools) passes one
# secret-name rule and one text mask. Every event is masked once, where it is emitted
# (_Turn._emit); a sink writes what it is given. Replay compares and digests that masked
# form, so a run whose secrets differ replays the same.

# The one secret-name rule, for argument names, JSON keys, env variables and HTTP headers alike
# (bob_mcp uses it too): "token" but not "max_tokens", "auth" but not "author", and "key" only
# as the last part of a longer name ("OPENAI_API_KEY", "x-api-key"), not "key" or "monkey".
_SECRETS = (r"api[_-]?key|[_-]key(?![a-z])|password|passwd|secret|token(?!s)|authoriz|auth(?!or)|"
            r"cookie|credential")
_SECRET_KEY = re.compile(f"(?i){_SECRETS}")


@functools.lru_cache(maxsize=4096)  # keys repeat across calls: 20,000 calls mask in milliseconds
def secret_name(key: Any) -> bool:
    """True when a name (argument, JSON key, env variable, header) says its value is a secret."""
    return isinstance(key, str) and bool(_SECRET_KEY.search(key))


# Secret keys in text (a reply, a tool result): "key":, \"key\": in JSON inside a JSON string, and
# deeper; then the value: a string (to its end, or the text's: a cut reply), a list, a number. No
# part backtracks over the text: each stops at a quote or after 64 chars (one did: seconds), and
# the escape before a key is at most 31 backslashes (JSON five levels deep): 32,000 took seconds.
# Compiled without (?i) on purpose: _mask_text runs it over the lowered text (twice as fast), so
# it is as case-blind as secret_name ("API_KEY", "Password"; tests/test_replay_record.py pins it).
_TEXT_KEY = re.compile(rf"""
    ( \\{{0,31}} ["'] )            # 1: the key's opening quote, after up to 31 backslashes
    ( [^"\n]{{0,64}}?                # 2: the key: up to 64 chars on one line, no quote,
      (?:{_SECRETS})                # holding a secret name,
      [^"\n]{{0,64}}? )              # and up to 64 more
    \1 \s* : \s*                    # closed by the same quote, then the colon
""", re.X)

# The ASCII letters lowered and nothing else, for a text that lower() would make longer (one
# char, "İ", lowered to two): the indices of a key found stay those of the text.
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


@functools.lru_cache(maxsize=16)
def _text_value(quote):
    """The value after a key whose quote was `quote`: a string, a list or a scalar."""
    q = re.escape(quote)   # a string ends at the same quote, escaped as the key's was
    if len(quote) == 1:    # " or ' (a Python repr): up to that quote, skipping escaped chars
        text = rf"{q} [^{q}\\]* (?: \\. [^{q}\\]* )* {q}?"
    else:                  # \" and deeper (JSON inside a JSON string): up to that same escape
        text = rf"{q} (?: (?!{q}) . )* (?:{q})?"
    return re.compile(rf"""
        {text}            # a string, to its closing quote or to the text's end (a cut reply)
      | \[ [^\]]* \]?     # a list, to its first closing bracket
      | [^\s,}}\]\\]+     # a scalar: up to a space, comma, closing brace or bracket, backslash
    """, re.S | re.X)


def _mask_text(text):
    """The text with the value after each secret-looking "key": as "***"."""
    if '"' not in text and "'" not in text:
        return text
    low = text.lower()   # matched case-sensitively ((?i) made it twice as slow); "İ" lowers to 2
    low = low if len(low) == len(text) else text.translate(_ASCII_LOWER)
    if not re.search(_SECRETS, low):   # no secret name anywhere (a third of finditer's time)
        return text
    out = []
    at = 0
    for key in _TEXT_KEY.finditer(low):
        if key.start() >= at and (value := _text_value(key.group(1)).match(text, key.end())):
            out += [text[at:key.end()], f"{key.group(1)}***{key.group(1)}"]
            at = value.end()
    return "".join(out) + text[at:]


def redact(data: Any) -> Any:
    """A copy of JSON-like data with secret-looking keys' values (also in JSON text) as '***'."""
    if isinstance(data, dict):   # a value that cannot hold a secret is kept without a call:
        out = {}                 # an event is masked as it is emitted, and events are many
        for k, v in data.items():
            if secret_name(k):
                v = "***"
            elif isinstance(v, (dict, list, tuple)) or isinstance(v, str) and (
                    '"' in v or "'" in v):
                v = redact(v)
            out[k] = v
        return out
    if isinstance(data, (list, tuple)):   # a tuple (Python-built data) as the list JSON has
        return [redact(v) for v in data]
    return _mask_text(data) if isinstance(data, str) else data


_SCHEMA_VALUES = ("default", "const", "enum", "examples")   # where a schema can quote a value


def _masked_schema(schema, secret=False):
    """A tool's input schema with the values it quotes for a secret-named property (its default,
    examples...) as "***" and its texts masked; still a schema a model can follow."""
    if isinstance(schema, (list, tuple)):
        return [_masked_schema(v, secret) for v in schema]
    if not isinstance(schema, dict):
        return redact(schema)
    return {k: "***" if secret and k in _SCHEMA_VALUES else _masked_schema(v, secret or (
        secret_name(k) and k not in _SCHEMA_VALUES)) for k, v in schema.items()}


def _fit(call):
    """The call, or if its arguments are unfit to keep, the call with none and an `error`.
    What the server attached (`extra`), if unfit to keep, is dropped: saved, it would not load."""
    if not isinstance(call.extra, _OPTIONAL_DICT) or _json_problem(call.extra):  # None: none
        call = dataclasses.replace(call, extra=None)
    if problem := _json_problem(call.arguments):
        return dataclasses.replace(call, arguments={}, error=f"the arguments of {call.name!r} "
                                   f"{problem}; call it again with smaller arguments")
    return call


def _data_json(data):
    """Event data as ASCII JSON (json.dumps' default; lone surrogates too); unwritable data
    becomes a note of why."""
    try:
        return json.dumps(data, default=str)
    except Exception as e:  # also a str() that raises, from default=str
        return json.dumps({"unwritable": f"{type(e).__name__}: {_excerpt(str(e), 100)}"})


class LoggingEventSink:
    """Events as log lines on the `bob.events` logger (or the one given)."""

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO):
        self.logger = logger or logging.getLogger("bob.events")
        self.level = level

    def emit(self, event: AgentEvent) -> None:
        """One line: kind, session, step, data as JSON (not text_delta: see JsonlEventSink)."""
        if self.logger.isEnabledFor(self.level) and event.kind != "text_delta":
            self.logger.log(self.level, "%s session=%s step=%d %s", event.kind, event.session_id,
                            event.step, _data_json(event.data))


class JsonlEventSink:
    """Events appended to a file, one JSON object per line, each written whole as it comes. Into
    a pipe or FIFO too (`--trace >(gzip > t.gz)`): a line longer than the pipe's buffer waits
    for its reader, but a line not taken within _SINK_WAIT_S fails the event (a sink's failure
    is logged, and the turn goes on), and while the reader stays stalled later events fail at
    once: a stalled reader never holds a turn for long. A line cut so (or by Ctrl-C) is lost
    alone: the next event begins a line of its own."""

    _fd = None         # the file's descriptor: opened on the first event, None once closed
    _cut = False       # the last line was written in part
    _stalled = False   # the last wait for the reader ran out, and it has taken nothing since

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._lock = threading.Lock()

    def emit(self, event: AgentEvent) -> None:
        """Append the event as one JSON line."""
        if event.kind == "text_delta":   # pieces cannot be masked (a secret pair spans several);
            return                        # llm_call_completed has the whole reply, masked
        head = json.dumps({"kind": event.kind, "session_id": event.session_id, "step": event.step,
                           "ts": event.ts}, default=str)   # ASCII, as the data
        line = f'{head[:-1]}, "data": {_data_json(event.data)}}}\n'.encode()  # the data as encoded
        with self._lock:
            if self._fd is None:   # opened never blocking: a FIFO nobody reads fails at once
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NONBLOCK
                self._fd = os.open(self.path, flags, 0o600)
            line = memoryview(b"\n" + line if self._cut else line)   # (no copy per write)
            end = time.monotonic() + _SINK_WAIT_S   # the line's time
            while line:   # a file takes it at once; a pipe what its buffer holds, then waits
                with contextlib.suppress(BlockingIOError):   # (a pipe full: nothing taken)
                    line = line[os.write(self._fd, line):]
                    self._cut = bool(line)
                    self._stalled = False
                    continue   # (the rest, if any, at once: the reader may have read meanwhile)
                # the rest when the reader has read (no wait for a reader stalled before, till
                # it takes some: then the line's time). poll(), not select(): it takes no
                # descriptor past 1023
                room = select.poll()
                room.register(self._fd, select.POLLOUT)
                self._stalled = not room.poll(
                    (0 if self._stalled else max(0, end - time.monotonic())) * 1000)
                if self._stalled:
                    raise OSError(f"its reader did not take the line within {_SINK_WAIT_S} s "
                                  "(or stalled before): the line is cut")

    def close(self) -> None:
        """Close the file (a later event reopens it)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


# request_digest's JSON, by one encoder (json.dumps with options builds one a call)
_canonical = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=str).encode


def request_digest(req: LlmRequest, cache: dict | None = None) -> str:
    """sha256 of the canonical JSON of {"messages" (masked), "response_format", "tools"};
    `cache` (a dict) keeps each message's part and each list of tools' by the object (held,
    so its id stays its own): give a cache only to requests whose lists of tools are not
    changed in place, as a turn's are not (a step that offers fewer tools gets a new list)."""
    cache = {} if cache is None else cache
    parts = []
    for obj in (req.tools, *req.messages):   # each encoded once while it lives
        if (known := cache.get(id(obj))) is None:
            data = redact(obj.to_dict()) if isinstance(obj, Message) else [
                dataclasses.asdict(d) for d in obj]   # (tools: masked at Start)
            known = cache[id(obj)] = (obj, _canonical(data))
        parts.append(known[1])
    tools, *parts = parts
    text = (f'{{"messages":[{",".join(parts)}],"response_format":'
            f'{_canonical(req.response_format)},"tools":{tools}}}')
    return hashlib.sha256(text.encode()).hexdigest()


# ---- 9. Workers: threads with deadlines and cancel ----------------------------------------------
# A port may block forever. Each LLM or tool call runs on a daemon pool thread; the loop waits on a
# wake-up queue with the remaining time, so cancel and deadlines hold while the port is stuck.
# (bob's replay ports, which answer from memory and cannot block, run on the loop's thread.)
# A worker given up on keeps running until its port returns: it is counted, and past
# _MAX_ABANDONED live ones new tool calls are refused rather than leaking threads without bound.

_MAX_ABANDONED = 32
# A native reply with more tool calls than this (or than max_parallel_tools, if larger) is a
# malformed reply, not an over-size batch: 20,000 "not run" results would be 20,000 messages in
# the session for ever and 40,000 events, and a cancel would wait for all of them.
_MAX_CALLS_PER_REPLY = 1_000
_IDLE_S = 30.0                 # an idle pool thread exits after this long
# The longest a waiting thread sleeps at a time: the kernel may hand a Ctrl-C to any thread,
# and Python raises it in the main thread only when that thread runs again (else: at the end of
# a long wait, a tool's timeout). bob_mcp's waits on its loop take it too.
_CTRL_C_SLICE_S = 0.05
_lock = threading.Lock()       # guards the two below
_abandoned = 0                 # given-up workers still running (read as it is within bob.py)
_idle = []                     # inboxes (queue.SimpleQueue) of idle pool threads


def abandoned_workers() -> int:
    """How many given-up worker threads are still running (blocked in a port)."""
    return _abandoned


def _serve(inbox):
    """A pool thread: run jobs from its inbox; exit when idle too long. Reuse saves ~100 us a
    call (bench/loop_overhead.py)."""
    while True:
        try:
            job = inbox.get(timeout=_IDLE_S)
        except queue.Empty:
            with _lock:
                if inbox in _idle:        # nobody picked this thread: leave
                    _idle.remove(inbox)
                    return
            job = inbox.get()             # picked just as it timed out: the job is on the way
        job()
        with _lock:
            _idle.append(inbox)


def _submit(job):
    with _lock:
        inbox = _idle.pop() if _idle else None
    if not inbox:   # (a SimpleQueue is never false)
        inbox = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(inbox,), name="bob-worker", daemon=True).start()
    inbox.put(job)


class _NoAnswer(Cancelled):
    """A port that answers inline has no answer (see _Worker); to any other caller, Cancelled."""


def _inline(port):
    """Whether `port` answers on the caller's thread: its own class (not a parent) says
    `_answers_inline = True`, as bob's replay ports do. A subclass that may block (a live
    fallback, a simulated latency) then keeps its worker thread, its cancel and its deadline,
    unless it says so itself; a Mock's made-up attribute never counts."""
    return vars(type(port)).get("_answers_inline") is True


class _Worker:
    """One call of `port` on a pool thread; `done` turns True when it returns or raises.
    A port that answers inline (_inline: bob's replay ports, which answer from memory in
    microseconds and never block) is called on the caller's thread: no hand-off (two a step
    were a third or more of a replay's time, bench/replay_speed.py). Cancel and deadlines are
    checked between steps as ever. With no answer it raises _NoAnswer: never done, it is waited
    on (until the cancel or the deadline) like a port that hangs, and, running nowhere, is never
    counted as abandoned. On a pool thread _NoAnswer is an error like any other (a port that
    wraps a replay port): handed over, and the thread uncounted if it was given up."""

    value = None   # what fn returned
    error = None   # or the exception it raised
    done = _given_up = False

    def __init__(self, fn, wake, port=None):
        self.fn = fn
        self.wake = wake   # (put to by an inline call too: a stale token costs one more look)
        self.inline = _inline(port)
        if self.inline:
            self._run()
        else:
            _submit(self._run)

    def _run(self):
        global _abandoned
        try:
            self.value = self.fn()
        except BaseException as e:  # handed to the waiting thread, never lost
            if self.inline and isinstance(e, _NoAnswer):   # left not done, so waited on; and
                self._given_up = True                       # never counted, see above
                return
            self.error = e
        with _lock:
            self.done = True
            if self._given_up:
                _abandoned -= 1
        self.wake.put(None)

    def give_up(self):
        """Stop caring about the result; the thread is counted until it ends."""
        global _abandoned
        with _lock:
            if not self.done and not self._given_up:
                self._given_up = True
                _abandoned += 1


def _wait_all(workers, deadlines, wake, cancel):
    """Wait until each worker is done or past its deadline, or until cancel; give up the rest.
    Workers and the caller's cancel put a token in `wake`; a stale one costs one more look."""
    try:
        while not cancel.cancelled:
            now = time.monotonic()
            pending = [d for w, d in zip(workers, deadlines) if not w.done and d > now]
            if not pending:
                break
            with contextlib.suppress(queue.Empty):   # (a Ctrl-C: _CTRL_C_SLICE_S)
                wake.get(timeout=min(min(pending) - now, _CTRL_C_SLICE_S))
    finally:
        for w in workers:
            w.give_up()


# ---- 10. The scheduler: State, _Turn, AgentRuntime ----------------------------------------------
# A turn is a walk through six explicit states. Each state's work is one method of _Turn that
# returns the next state; AgentRuntime.run checks every transition against TRANSITIONS and
# emits it. AgentRuntime holds the settings, ports and event sinks, and saves the session; _Turn
# holds what one turn knows, does its work and emits its events, reaching the runtime through
# `self.rt`.

class State(str, enum.Enum):
    """The states of a turn."""
    START = "start"
    BUILD_PROMPT = "build_prompt"
    LLM_INFER = "llm_infer"
    PARSE_ACTION = "parse_action"
    CALL_TOOL = "call_tool"
    DONE = "done"


# Each State -> the States it may go to next (a tuple; DONE: none)
TRANSITIONS = {
    # START goes to CALL_TOOL when it takes up a paused batch
    State.START: (State.BUILD_PROMPT, State.CALL_TOOL, State.DONE),
    State.BUILD_PROMPT: (State.LLM_INFER,),
    State.LLM_INFER: (State.PARSE_ACTION, State.DONE),
    State.PARSE_ACTION: (State.BUILD_PROMPT, State.CALL_TOOL, State.DONE),
    State.CALL_TOOL: (State.BUILD_PROMPT, State.DONE),
    State.DONE: (),
}


def _too_long(e):
    """Truthy when the endpoint refused the request as too long for the model's context."""
    return (isinstance(e, LlmError) and e.status_code == 400
            and _CONTEXT_TOO_LONG.search(e.body))


def _raised(e, state):
    """What a turn that raised `e` in `state` raises: a BobError, or a BaseException that
    is no Exception (Ctrl-C, SystemExit), as it is; anything else is a bug: an AgentError
    naming it."""
    if isinstance(e, BobError) or not isinstance(e, Exception):
        return e
    error = AgentError(f"internal error in {state.value}: {type(e).__name__}: {e}")
    error.__cause__ = e
    return error


_OWN_DATA = ("state", "llm_call_started", "history_truncated")  # events with nothing to mask


@dataclass
class _Turn:
    """One turn: everything it knows, and the work of each state, one method per state in
    the order a turn visits them. Owned by the scheduler's thread. The runtime's settings,
    ports and event sinks are `rt`'s. The outcome (finish, content, guard_reason, error)
    is written by `end` alone. A field that defaults to None holds the type it names, or None
    until it is set (its comment says when)."""
    rt: AgentRuntime
    request: AgentRequest
    policy: TurnPolicy
    caller_cancel: CancelToken              # the caller's token: cancel means CANCELLED
    # this turn's own: also fired at the deadline and when the turn ends
    cancel: CancelToken
    guard: LoopGuard
    session: SessionState = None            # loaded by start, before anything reads it
    tools: list = ()   # ToolDescriptors, masked as the model sees them: the list start makes
    #                    (until then none; only read, never changed in place)
    input_index: int = 0                    # where this turn's user message sits in history
    system: Message = None                  # made by the first build_prompt
    wire: dict = field(default_factory=dict)   # index -> its Message rendered for the wire
    units: _Units = field(default_factory=_Units)  # of session.messages, read as they grow
    wake: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # of None: _wait_all
    prompt: LlmRequest = None               # this step's request (build_prompt, llm_infer)
    reply: LlmResponse = None               # the model's reply to it, fitted (llm_infer)
    action: AgentAction = None              # the last action parsed, or the batch resumed
    parse_failures: int = 0
    usage: Usage = Usage()
    content: str = ""
    finish: FinishReason = None             # written by end (a turn that raises has none)
    guard_reason: GuardReason = None        # the guard that ended the turn, if one did
    error: BaseException = None             # what the turn raises, if it raises
    approvals: dict = field(default_factory=dict)   # call id -> its Approval (decision)
    resumed: bool = False                   # took up a paused batch (its guards already ran)
    pending: tuple = ()                     # ToolCalls left waiting for a decision
    parts: dict = field(default_factory=dict)   # request_digest's cache
    started: bool = False                   # turn_started was emitted: the turn must end too

    # -- the states, in the order a turn visits them; each method returns the next State --

    def start(self):
        """Load the session, add the input (or resume a paused batch), list the tools once."""
        rt = self.rt
        # The session, or the history given in its place
        self.session = rt.store.load(self.request.session_id) or SessionState()
        history = self.request.history
        if history is not None:
            calls = [c.arguments for m in history for c in getattr(m, "tool_calls", ())]
            if bad := _json_problem(calls):   # a non-Message fails as a bug, in start
                raise AgentError(
                    f"AgentRequest.history cannot be sent: its tool calls' JSON {bad}")
            self.session.messages = list(history)
        # The tools, listed once a turn: denied ones left out, the rest masked as the model
        # sees them; a schema that is not JSON fails the turn, after its start is traced
        worker = None
        if rt.tools is not None:
            worker = self._call_port(rt.tools.list_tools, rt.tools)
            if worker.done and worker.error is None:
                self.tools = [d for d in worker.value if not is_denied(d.name, rt.deny_tools)]
        unfit = next((f"tool {d.name!r}: its input schema {p}" for d in self.tools
                      if (p := _json_problem(d.input_schema))), None)
        self.tools = [] if unfit else [   # no secret in a description or a schema
            ToolDescriptor(d.name, redact(d.description), _masked_schema(d.input_schema))
            for d in self.tools]
        # The trace's opening events, then the input (or the paused batch). session_loaded
        # unless the session is as this runtime's last turn left it: a trace begun mid-session
        # (or after a failed save, or another writer) reads alone
        traced = rt._traced.get(self.request.session_id)
        if history is not None or traced != self.session.version:
            self._emit("session_loaded", lambda: {"paused": self.session.paused, "messages": [
                m.to_dict() for m in self.session.messages]})
        self._trace_start()   # first: every turn in the trace begins with it
        self.started = True
        self._resume_or_add_input()
        if unfit:
            raise AgentError(f"{unfit}; deny it")
        if worker and (stop := self._end_if_failed(worker, "listing the tools")):
            return stop
        return State.CALL_TOOL if self.resumed else State.BUILD_PROMPT

    def build_prompt(self):
        """System message + history cut to max_history_messages, in the mode's wire shape."""
        if not self.system:
            self.system = Message("system", build_system_prompt(
                self._instructions(), self.tools, self.rt.action_mode))
        self.prompt = self._prompt(self.policy.max_history_messages)
        return State.LLM_INFER

    def llm_infer(self):
        """Check cancel and the guards, then call the model on a worker until it answers, the
        deadline passes or the turn is cancelled."""
        # Nothing is sent once cancelled or past a limit
        if self.caller_cancel.cancelled:
            return self._end_cancelled()
        if trip := self.guard.before_llm_call():
            return self._end_on_trip(trip)
        # The call
        prompt = self.prompt
        self._emit("llm_call_started", lambda: {"messages": len(prompt.messages),
                                                "digest": request_digest(prompt, self.parts)})
        t0 = time.perf_counter()
        worker = self._complete(prompt)
        # Too long for the model's context: again with half the history, while it shrinks (at
        # most log2(max_history_messages) times)
        while _too_long(worker.error) and not self.cancel.cancelled:
            sent = len(prompt.messages) - 1
            shorter = self._prompt(sent // 2)
            if len(shorter.messages) > sent:
                break
            self.prompt = prompt = shorter
            self._emit("history_truncated", lambda: {"from": sent, "to": len(
                prompt.messages) - 1, "digest": request_digest(prompt, self.parts)})
            worker = self._complete(prompt)
        if stop := self._end_if_failed(worker, "the model"):
            return stop
        # The reply: unfit arguments are replaced once, and the trace records them so too; a
        # custom port's reasoning that is not text is dropped (saved, it would not load)
        duration = _ms_since(t0)
        reply = worker.value
        self.reply = fitted = dataclasses.replace(
            reply, tool_calls=tuple(map(_fit, reply.tool_calls)),
            reasoning=_str(reply.reasoning))
        self.usage += reply.usage
        # llm_call_completed: the reply as fitted above, its ids as the port gave them (bob fixes
        # them in parse_action)
        self._emit("llm_call_completed", lambda: vars(fitted) | {
            "tool_calls": [c.to_dict() for c in fitted.tool_calls],
            "usage": vars(fitted.usage), "duration_ms": duration})
        return State.PARSE_ACTION

    def parse_action(self):
        """Turn the reply into an action; one corrective re-prompt, then AgentError."""
        reply = self.reply
        try:
            action = self._to_action(reply, f"call_{len(self.session.messages)}")
        except ActionParseError as e:
            return self._reprompt(e)
        self.action = action
        self.parse_failures = 0
        self._emit("action_parsed", {
            "type": {Final: "final", AskUser: "ask_user", CallTools: "tool_call"}[type(action)],
            "tools": [c.name for c in getattr(action, "calls", ())]})   # a CallTools' calls
        # An answer or a question ends the turn
        if isinstance(action, Final):
            return self._end_with_answer(FinishReason.FINAL, action.content)
        if isinstance(action, AskUser):
            return self._end_with_answer(FinishReason.ASK_USER, action.question)
        # Tool calls: unless the model is going round in circles (never blocks a final answer)
        if trip := self.guard.check_text(reply.content):
            return self._end_on_trip(trip)
        text = reply.content if self.rt.action_mode == "native" else ""
        self.session.messages.append(Message("assistant", text, action.calls,
                                             reasoning=reply.reasoning))
        return State.CALL_TOOL

    def call_tool(self):
        """Guard the batch, get its decisions, run it, append the results in call order."""
        calls = self.action.calls
        self.session.paused = None   # answered below, or paused afresh
        resumed = self.resumed
        self.resumed = False   # the turn's later batches are guarded again
        # The batch as a whole: cancelled while the model answered, too big, a loop (a resumed
        # batch passed the last two before it paused)
        if self.caller_cancel.cancelled:
            return self._stop_batch_on_cancel()
        if not resumed:
            # The size first: it costs O(1) per call, check_loop's hashing does not. A batch
            # over max_parallel_tools runs not at all; it counts as one error (not one per
            # call) and the loop goes on
            n = self.policy.max_parallel_tools
            if len(calls) > n:
                self._answer_unrun(calls, f"not run: this batch has {len(calls)} calls and at "
                                          f"most max_parallel_tools={n} may run at once; call at "
                                          f"most {n} tools at a time")
                self.guard.consecutive_errors += 1
                return State.BUILD_PROMPT
            if trip := self.guard.check_loop(calls):
                return self._stop_batch_on_guard(trip)
        # Each call: refused, declined, waiting for a decision, or to run (None: the batch's
        # run fills in its result)
        results = [self._refusal_of_call(c) for c in calls]
        decided = self._approved_batch(results)
        if isinstance(decided, State):
            return decided
        # the calls to run: the Nones (a ToolResult, a frozen dataclass, equals no None)
        if trip := self.guard.check_budget(results.count(None)):
            return self._stop_batch_on_guard(trip)
        # Claim a resumed pause before its calls run: another process resuming it too gets a
        # StoreError and runs nothing
        if resumed:
            self.rt.store.save(self.request.session_id, dataclasses.replace(
                self.session, version=self.session.version + 1))
            self.session.version += 1
        # Run the batch, count it, append its results
        ran = self._run_batch(decided, results)
        self.guard.record_results(results, ran)
        self._append_results(results)
        if self.caller_cancel.cancelled:
            return self._end_cancelled()
        return State.BUILD_PROMPT

    # Each state's work, which returns the next state (DONE has none): run() calls
    # WORK[state](turn)
    WORK = {State.START: start, State.BUILD_PROMPT: build_prompt, State.LLM_INFER: llm_infer,
            State.PARSE_ACTION: parse_action, State.CALL_TOOL: call_tool}

    # -- ending the turn: `end` writes the outcome, the others say why --

    def end(self, finish=None, content="", guard_reason=None, error=None):
        """The one place a turn's outcome is written: how it finished, its content and the
        guard that stopped it (every caller names the finish); or, given alone, the error it
        raises (the rest is left as it was: a turn that raises has no finish reason)."""
        if error is None:
            self.finish = finish
            self.content = content
            self.guard_reason = guard_reason
        else:
            self.error = error
        return State.DONE

    def _end_with_answer(self, finish, text):
        """The model answered, or asked the user: its words end the turn and its history."""
        self.session.messages.append(Message("assistant", text))
        return self.end(finish, text)

    def _end_on_trip(self, trip):
        self._emit("guard_tripped", {"reason": trip.reason.value, "detail": trip.detail})
        return self.end(FinishReason.GUARD_EXCEEDED, f"Stopped: {trip.detail}.", trip.reason)

    def _end_cancelled(self):
        return self.end(FinishReason.CANCELLED, "Cancelled.")

    def _end_paused(self, waiting):
        """End the turn NEEDS_APPROVAL with the batch unrun, saving what a resume needs."""
        self.session.paused = {"guard": self.guard.counts(), "input_index": self.input_index,
                               "approvals": {k: dataclasses.asdict(a)
                                             for k, a in self.approvals.items()}}
        self.pending = tuple(waiting)
        names = ", ".join(c.name for c in waiting)
        return self.end(FinishReason.NEEDS_APPROVAL, f"Waiting for approval: {names}.")

    def _end_if_failed(self, worker, what):
        """DONE if the port call was cancelled, timed out or raised; None if it answered."""
        if self.caller_cancel.cancelled:
            return self._end_cancelled()
        # no answer: the deadline passed, or the turn's own token fired (a port gave it up, and
        # may have raised Cancelled, seeing it: _Turn.woken). A failure once the time is up is
        # the turn's timeout too: the adapter's own clock ends a request at the same deadline,
        # and whichever sees it first, the turn ran out of time
        if not worker.done or worker.error is not None and self.guard.out_of_time():
            return self._end_on_trip(self._no_answer(what))
        e = worker.error
        if e is None:
            return None
        if not isinstance(e, BobError):
            e = AgentError(f"{what} failed: {type(e).__name__}: {e}")
        return self.end(error=e)

    def _no_answer(self, what):
        """The turn deadline passed while `what` (a port, the approver) was still at work."""
        return Trip(GuardReason.TURN_TIMEOUT, f"{what} did not answer within "
                    f"turn_timeout_ms={self.policy.turn_timeout_ms}")

    def _reprompt(self, e):
        """A reply that is no action (`e`, its ActionParseError): the model is told so and
        asked again, once; the second in a row ends the turn with an AgentError."""
        self.parse_failures += 1
        seen = redact(self.reply.content)   # as the trace has it: so a replay finds the same error
        json_mode = self.rt.action_mode == "json"
        if json_mode:   # the error of the masked reply instead, if it has one
            try:
                parse_action(seen)
            except ActionParseError as masked:
                e = masked
        self._emit("parse_error", {"error": str(e), "attempt": self.parse_failures})
        if self.parse_failures >= 2:
            return self.end(error=AgentError(
                f"the model replied with an invalid action twice in a row: {e}. "
                f"Last reply: {_excerpt(seen)!r}"))
        how = ACTION_CONTRACT if json_mode else "Answer in text or call a tool."
        text = f"Your last reply was not a valid action: {e}. It began: {_excerpt(seen)!r}."
        self.session.messages.append(Message("user", f"{text} {how}"))
        return State.BUILD_PROMPT

    # -- helpers of the states --

    def _prompt(self, limit):
        """System message + history cut to `limit`, in wire shape; each renders once."""
        messages = self.session.messages
        kept = self.units.read(messages).kept(limit, self.input_index)
        for i in kept:
            if i not in self.wire:
                self.wire[i] = render_for_wire(messages[i], self.rt.action_mode)
        json_mode = self.rt.action_mode == "json"
        # json mode: a call repeated up to the loop limit leaves its tool out of the action's
        # schema for the next step, so a model held to the schema (one that repeats a call
        # after its result, as small ones do) answers, asks or calls another tool instead of
        # tripping LOOP_DETECTED; the system message still lists the tool
        last = getattr(self.action, "calls", ())   # a CallTools' calls
        tools = self.tools
        if json_mode and self.guard.at_loop_limit(last):
            tools = [t for t in tools if t.name not in {c.name for c in last}]
        return LlmRequest([self.system, *map(self.wire.get, kept)],
                          tools, "json" if json_mode else None, self.guard.deadline)

    def woken(self):
        """The turn's own token fired: wake whatever the turn waits for. Unless the caller
        cancelled, the turn's time is up from now: a port fired it, giving up (a replay's,
        where the recorded turn ran out of time)."""
        self.wake.put(None)
        if not self.caller_cancel.cancelled:
            self.guard.deadline = -math.inf

    def _complete(self, prompt):
        return self._call_port(lambda: self.rt.llm.complete(prompt, self.cancel, self._delta),
                               self.rt.llm)

    def _call_port(self, fn, port):
        """Run a port call on a worker; wait until it ends, the turn deadline, or a cancel."""
        # a port that ignores cancel: stop leaking threads (an inline port uses none)
        if _abandoned >= _MAX_ABANDONED and not _inline(port):
            raise AgentError(f"{_MAX_ABANDONED} earlier port calls are still hung (a port "
                             "that ignores cancel and deadlines); restart the program")
        worker = _Worker(fn, self.wake, port)
        _wait_all([worker], [self.guard.deadline], self.wake, self.cancel)
        return worker

    def _to_action(self, reply, call_id):
        if self.rt.action_mode == "json":
            return parse_action(reply.content, call_id)
        # Native: the reply's tool calls, or its text as the answer. More calls than a batch
        # may have is garbage: their results would flood history
        n = len(reply.tool_calls)
        if n > max(_MAX_CALLS_PER_REPLY, self.policy.max_parallel_tools):
            raise ActionParseError(f"the reply has {n} tool calls; call at most "
                                   f"{self.policy.max_parallel_tools} tools at a time")
        if n:  # ids must be unique; some servers omit or repeat them
            calls = []
            seen = set()
            for i, c in enumerate(reply.tool_calls):
                if not c.id or c.id in seen:
                    c = dataclasses.replace(c, id=f"{call_id}_{i}")
                seen.add(c.id)
                calls.append(c)
            return CallTools(tuple(calls))
        if not reply.content.strip():
            raise ActionParseError("the reply was empty: no text and no tool calls")
        return Final(reply.content)

    def _resume_or_add_input(self):
        """Append the input (waiting calls get "not run" first), or for `input=None` take up
        the paused batch with its counts and decisions (`resumed`); call_tool answers the pause."""
        request = self.request
        paused = self.session.paused if request.history is None else None
        # The last message's calls have no results yet: a paused batch, or a turn cut short
        messages = self.session.messages
        waiting = messages[-1].tool_calls if messages else ()
        if request.input is not None:
            self.session.paused = None
            self._answer_unrun(waiting, "not run: the user sent a new message instead of "
                                        "deciding on this call")
            messages.append(Message("user", request.input))
            self.input_index = len(messages) - 1
            return
        # Resuming: the pause's counts and decisions, and the decisions given now
        if not (paused and waiting):
            raise AgentError(f"session {request.session_id!r} has no tool calls waiting "
                             "for approval: give an input to start a turn")
        self.guard.restore(paused["guard"])
        self.input_index = paused["input_index"]
        self.approvals = {k: Approval(**a) for k, a in paused["approvals"].items()}
        given = request.approvals or {}
        for call in waiting:
            if call.id in given:
                decision = given[call.id]
                if not isinstance(decision, Approval):
                    raise ConfigError(f"approvals[{call.id!r}] must be an Approval, "
                                      f"got {decision!r}")
                self._record_decision(call, decision)
        self.action = CallTools(waiting)
        self.resumed = True

    def _instructions(self):
        return self.request.system_prompt or self.rt.system_prompt or DEFAULT_INSTRUCTIONS

    def _delta(self, text):
        """Streamed text from the model (_emit drops it once the turn gave the call up)."""
        self._emit("text_delta", {"text": text})

    # -- a batch of tool calls: approvals, refusals, running --

    def _approved_batch(self, refusals):
        """The batch as it runs: calls matching ask_tools (not refused) need a decision;
        declined ones get an error in `refusals`; without an approver, undecided calls pause
        the turn."""
        calls = list(self.action.calls)
        waiting = []
        for i, call in enumerate(calls):
            if refusals[i] or not is_denied(call.name, self.rt.ask_tools):
                continue
            if call.id not in self.approvals:
                self._emit("approval_requested", {"call_id": call.id, "name": call.name,
                                                  "arguments": call.arguments})
                if self.rt.approver is None:
                    waiting.append(call)
                    continue
                decision = self._ask_approver(call)
                if isinstance(decision, State):
                    return decision
                self._record_decision(call, decision)
            approval = self.approvals[call.id]
            if not approval.allow:
                because = f": {approval.reason}" if approval.reason else ""
                refusals[i] = _error(call, f"the user declined this call{because}")
            elif approval.arguments is not None:
                calls[i] = dataclasses.replace(call, arguments=dict(approval.arguments))
        if waiting:
            return self._end_paused(waiting)
        # Decisions hold for this batch only: a later call reusing an id is asked again
        self.approvals = {}
        if calls != list(self.action.calls):  # the history records the arguments that ran
            self.session.messages[-1] = dataclasses.replace(self.session.messages[-1],
                                                            tool_calls=tuple(calls))
        return calls

    def _ask_approver(self, call):
        """The approver's decision, on a worker (the deadline and cancel hold); an approver
        that raises declines."""
        worker = self._call_port(lambda: self.rt.approver(call), self.rt.approver)
        if self.caller_cancel.cancelled or isinstance(worker.error, Cancelled):
            return self._stop_batch_on_cancel()
        if not worker.done:
            return self._stop_batch_on_guard(self._no_answer("the approver"))
        if (e := worker.error) is not None:   # (an exception may test false: is None, always)
            return Approval(False, f"the approver failed: {type(e).__name__}: {e}")
        if isinstance(worker.value, Approval):
            return worker.value
        return Approval(False, f"the approver returned {type(worker.value).__name__}, "
                               "not an Approval")

    def _record_decision(self, call, approval):
        """Keep a decision on `call` for this batch. Its arguments are checked as the model's
        are (they reach history and the wire): unfit ones decline the call."""
        # a dict or None (Approval checks the type); None has no problem
        if problem := _json_problem(approval.arguments):
            approval = Approval(False, f"the approver's arguments were unfit: it {problem}")
        self.approvals[call.id] = approval
        changed = approval.allow and approval.arguments not in (None, call.arguments)
        self._emit("approval_decided", {"call_id": call.id, "allow": approval.allow,
                                        "arguments_changed": changed,
                                        "reason": approval.reason,
                                        "arguments": approval.arguments})

    def _refusal_of_call(self, call):
        """An error result for one call that must not run, or None."""
        if call.error:
            return _error(call, call.error)
        if is_denied(call.name, self.rt.deny_tools):
            return _error(call, f"tool {call.name!r} is denied by policy (deny_tools)")
        if all(d.name != call.name for d in self.tools):
            names = ", ".join(d.name for d in self.tools) or "none"
            return _error(call, f"unknown tool {call.name!r}; available tools: {names}")
        if _abandoned >= _MAX_ABANDONED and not _inline(self.rt.tools):
            return _error(call, f"executor unavailable: {_MAX_ABANDONED} earlier port calls "
                                "are still hung; restart the program")
        return None

    def _stop_batch_on_guard(self, trip):
        """A guard stopped the batch: each call gets a "not run" result; the turn ends."""
        self._answer_unrun(self.action.calls, f"not run: {trip.detail}")
        return self._end_on_trip(trip)

    def _stop_batch_on_cancel(self):
        """Cancelled with the batch unrun: each call gets an "interrupted" result."""
        self._answer_unrun(self.action.calls,
                           "interrupted: the turn was cancelled before this call started")
        return self._end_cancelled()

    def _answer_unrun(self, calls, text):
        """Calls that never start get `text` as their result, so history stays well-formed."""
        for call in calls:  # the trace still says they were asked for
            self._trace_call(call, False)
        self._append_results([_error(c, text) for c in calls])

    def _run_batch(self, calls, results):
        """Run the calls not refused, all at once, each with its timeout. `results` holds the
        refusals (None for a call to run: call_tool's list) and is filled in place, in call
        order. Returns how many calls ran."""
        running = []
        for i, call in enumerate(calls):
            runs = not results[i]   # not refused (a ToolResult is never false)
            self._trace_call(call, runs)
            if runs:
                # tool_timeout_ms, never past the turn deadline (nor below 0 s)
                timeout = min(self.policy.tool_timeout_ms / 1000,
                              max(0.0, self.guard.deadline - time.monotonic()))
                # rt.tools is not None here: _refusal_of_call lets only listed tools through
                job = functools.partial(_run_tool, self.rt.tools, call, timeout, self.cancel)
                running.append((i, _Worker(job, self.wake, self.rt.tools), timeout))
        t0 = time.monotonic()
        _wait_all([w for _, w, _ in running], [t0 + s for _, _, s in running], self.wake,
                  self.cancel)
        # The results, after one wait for all: no call counts as timed out before a cancel;
        # each call that ran fills its place, so every place holds a result
        for i, worker, timeout in running:
            results[i] = self._result_of(calls[i], worker, timeout)
        return len(running)

    def _result_of(self, call, worker, timeout):
        """The result of one worker: its value, an error, a timeout or an interruption."""
        if not worker.done:
            if self.caller_cancel.cancelled:
                return _error(call,
                              "interrupted: the turn was cancelled before this call ended")
            return _error(call, f"tool {call.name!r} timed out after "
                                f"{round(timeout * 1000)} ms")
        if (e := worker.error) is not None:
            return _error(call, f"executor unavailable: {type(e).__name__}: {e}")
        r = worker.value
        if not isinstance(r, ToolResult):
            got = type(r).__name__
        elif not isinstance(r.content, str):
            got = f"a ToolResult whose content is {type(r.content).__name__}"
        else:   # a result: its text, cut to max_tool_output_chars
            return ToolResult(call.id, call.name,
                              cut_output(r.content, self.policy.max_tool_output_chars),
                              r.is_error, r.duration_ms)
        return _error(call, f"executor unavailable: the tool port returned {got}, not a "
                            "ToolResult with text")

    def _append_results(self, results):
        for r in results:
            self._emit("tool_call_completed", vars(r))   # every field; _emit masks a copy
            self.session.messages.append(Message("tool", r.content, tool_call_id=r.call_id,
                                                 name=r.name, is_error=r.is_error))

    # -- the trace: what the events carry --

    def _emit(self, kind, data):
        """Send one event of this turn to every sink of the runtime; a sink that raises is
        logged and ignored. `data`, or a function that builds it: built only when a sink
        listens (trace data costs copies and hashes). Here, and only here, secrets are masked:
        every event once, as the trace has it."""
        rt = self.rt
        if not rt.sinks:
            return
        data = data() if callable(data) else data
        masked = data if kind in _OWN_DATA else redact(data)
        # A piece streamed on the port's thread, looked at after its masking (a big one takes a
        # while): a turn that ended meanwhile gets nothing after its turn_completed
        if kind == "text_delta" and self.cancel.cancelled:
            return
        if kind == "turn_started":   # masked at Start as the model sees them (_Turn.start)
            masked["tools"] = data["tools"]
        event = AgentEvent(kind, self.request.session_id, self.guard.steps, masked, time.time())
        for sink in rt.sinks:
            try:
                sink.emit(event)
            except Exception:  # the first failure of a sink in full, later ones quietly
                first = id(sink) not in rt._failing
                rt._failing.add(id(sink))
                log.log(logging.WARNING if first else logging.DEBUG,
                        "event sink %r failed on %s; ignored", sink, kind, exc_info=first)

    def _trace_call(self, call, runs):
        self._emit("tool_call_started", {"call_id": call.id, "name": call.name, "runs": runs,
                                         "arguments": call.arguments})

    def _trace_start(self):
        """turn_started: all that decides the run."""
        rt = self.rt
        # the settings as they are (a policy's fields, the glob tuples): _emit's masking copies
        # them, tuples as lists; the tools, masked at Start and not again, are copied here
        self._emit("turn_started", lambda: {
            "format": TRACE_FORMAT, "version": __version__, "input": self.request.input,
            "model": getattr(rt.llm, "describe", lambda: type(rt.llm).__name__)(),
            "action_mode": rt.action_mode, "policy": vars(self.policy),
            "deny_tools": rt.deny_tools, "system_prompt": self._instructions(),
            "tools": [dataclasses.asdict(d) for d in self.tools],
            "ask_tools": rt.ask_tools,
            "approver": rt.approver is not None, "approvals": {
                k: vars(a) if isinstance(a, Approval) else repr(a)
                for k, a in (self.request.approvals or {}).items()}})


class AgentRuntime:
    """Runs agent turns: the FSM over an LlmPort, a ToolPort, a store and event sinks."""

    _probe = None   # health()'s list_tools call, a _Worker (one at a time)

    def __init__(self, llm: LlmPort, tools: ToolPort | None = None, *,
                 store: SessionStore | None = None,
                 events: EventSink | Sequence[EventSink] | None = None,
                 policy: TurnPolicy | None = None, system_prompt: str | None = None,
                 action_mode: Literal["json", "native"] = "json",
                 deny_tools: Sequence[str] = (), ask_tools: Sequence[str] = (),
                 approver: Callable[[ToolCall], Approval] | None = None):
        if action_mode not in ("json", "native"):
            raise ConfigError(f"action_mode must be 'json' or 'native', got {action_mode!r}")
        if not isinstance(policy, _OPTIONAL_POLICY):
            raise ConfigError(f"policy must be a TurnPolicy, got {type(policy).__name__}")
        # The ports and settings every turn reads
        self.llm = llm
        self.tools = tools
        self.action_mode = action_mode
        self.store = store if store is not None else InMemorySessionStore()
        if not isinstance(events, (list, tuple)):
            events = [] if events is None else [events]
        self.sinks = list(events)   # EventSinks, in the order given
        self.policy = policy or TurnPolicy()
        self.system_prompt = system_prompt
        self.deny_tools = _globs("deny_tools", deny_tools)
        self.ask_tools = _globs("ask_tools", ask_tools)
        self.approver = approver
        # What the runtime remembers between turns
        self._failing = set()   # ids (int) of sinks that raised (logged once each)
        self._traced = {}       # session id -> the version (int) its traced turns lead to

    def run(self, request: AgentRequest, cancel: CancelToken | None = None) -> AgentRunResult:
        """Run one turn to its end: a guard or a cancel is a result; LlmError, AgentError
        and StoreError are raised."""
        policy = request.policy or self.policy
        caller = cancel or CancelToken()
        guard = LoopGuard(policy, time.monotonic() + policy.turn_timeout_ms / 1000)
        turn = _Turn(self, request, policy, caller, CancelToken(), guard)
        # the last turn's own token: where replay's sink ends its time (_Recorder). The token,
        # not the turn, which holds the runtime: no cycle, so a runtime let go of is freed at once
        self._cancel = turn.cancel
        # A cancel of the turn wakes whatever it waits for; the caller's cancel is the turn's
        turn.cancel.on_cancel(turn.woken)
        unlink = caller.on_cancel(turn.cancel.cancel)
        state = State.START
        try:
            while state is not State.DONE:
                # The state's work (_Turn.WORK), which returns the next state
                nxt = _Turn.WORK[state](turn)
                if nxt not in TRANSITIONS[state]:
                    raise AgentError(f"bug: illegal transition {state.value} -> {nxt.value}")
                turn._emit("state", {"from": state.value, "to": nxt.value})
                state = nxt
        except BaseException as e:  # a bug, a broken store, Ctrl-C, a sink's SystemExit:
            if not turn.started:    # the session never loaded: saving would overwrite it
                raise
            turn.end(error=_raised(e, state))   # save what the turn did, then raise
        finally:
            unlink()
            turn.cancel.cancel()  # tells any port still running for this turn to stop
        return self._done(turn)

    def health(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """A quick self-check: the tool listing (bounded by timeout_s) and hung workers."""
        report = {"ok": _abandoned < _MAX_ABANDONED, "tools": 0,
                  "action_mode": self.action_mode, "abandoned_workers": _abandoned}
        if self.tools is None:
            return report
        # one at a time: no thread leak if it hangs
        if not self._probe or self._probe.done:
            self._probe = _Worker(self.tools.list_tools, queue.SimpleQueue())
        worker = self._probe
        _wait_all([worker], [time.monotonic() + timeout_s], worker.wake, CancelToken())
        # Read `done` before `error`: the worker sets `error` before `done`, so a done
        # worker's error is final here
        done = worker.done
        e = worker.error
        if done and e is None:
            report["tools"] = len(worker.value)
        else:
            report.update(ok=False, tools_error=f"{type(e).__name__}: {e}" if done
                          else f"list_tools did not answer in {timeout_s} s")
        return report

    def _done(self, t):
        """Save the session, then report; a failed save raises StoreError after the events."""
        t.session.usage += t.usage
        t.session.version += 1
        result = AgentRunResult(t.content, t.finish, t.guard_reason, t.usage, t.guard.steps,
                                t.guard.tool_calls, list(t.session.messages), t.pending)
        # Save: a failure is raised after the events, and holds the result (not stored, but
        # not lost)
        failed = None
        sid = t.request.session_id
        try:
            self.store.save(sid, t.session)
            self._traced[sid] = t.session.version   # not after a lost race
        except Exception as e:   # the next turn says what it loaded (session_loaded)
            self._traced.pop(sid, None)
            t._emit("error", {"error": f"{type(e).__name__}: {e}", "where": "store.save"})
            failed = e if isinstance(e, StoreError) else StoreError(
                f"cannot save session {sid!r}: {type(e).__name__}: {e}")
            failed.result = result
        # Report: the turn's own error first (it is what the caller sees, raised in place of a
        # failed save's), then the end
        if t.error is not None:   # (an exception may test false: is not None, always)
            t._emit("error", {"error": f"{type(t.error).__name__}: {t.error}", "where": "turn"})
            failed = t.error
        t._emit("turn_completed", {  # a turn that raises has no finish reason
            "finish_reason": None if failed is not None else t.finish.value, "usage": vars(t.usage),
            "guard_reason": t.guard_reason.value if t.guard_reason else None,
            "steps": result.steps, "tool_calls": result.tool_calls, "content": t.content})
        if failed is not None:
            raise failed
        return result


# ---- 11. LLM adapters: ScriptedLlm, OpenAICompatLlm ---------------------------------------------

class ScriptedLlm:
    """A test double: replies from a list in order (a str, an LlmResponse, an exception to
    raise, or a callable (req, cancel) -> either), recording every request."""

    def __init__(self, replies: Iterable[Any] = ()):
        self.replies = list(replies)
        self.requests: list[LlmRequest] = []
        self._lock = threading.Lock()

    def complete(self, req: LlmRequest, cancel: CancelToken,
                 on_delta: Callable[[str], None] | None = None) -> LlmResponse:
        """The next scripted reply; LlmError when the script is used up."""
        with self._lock:
            self.requests.append(req)
            if not self.replies:
                raise LlmError(f"ScriptedLlm has no reply left for request #{len(self.requests)}")
            reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        if callable(reply):
            reply = reply(req, cancel)
        return LlmResponse(reply, finish_reason="stop") if isinstance(reply, str) else reply


# OpenAICompatLlm: any OpenAI-compatible /chat/completions endpoint. OpenAI JSON exists only
# here, in _to_wire / _from_wire and the stream reader; transport errors become LlmError in
# _attempt, the one place that talks HTTP.

# Each provider (str) -> (its default base_url, the variable holding its API key or None: a
# local server needs no key)
PROVIDERS = {
    "openai": ("https://api.openai.com/v1", "OPENAI_API_KEY"),
    "ollama": ("http://localhost:11434/v1", None), "vllm": ("http://localhost:8000/v1", None),
    "llamacpp": ("http://localhost:8080/v1", None), "lmstudio": ("http://localhost:1234/v1", None),
    "openrouter": ("https://openrouter.ai/api/v1", "OPENROUTER_API_KEY"),
    "groq": ("https://api.groq.com/openai/v1", "GROQ_API_KEY"),
    "together": ("https://api.together.xyz/v1", "TOGETHER_API_KEY"),
    "deepseek": ("https://api.deepseek.com/v1", "DEEPSEEK_API_KEY"),
    "mistral": ("https://api.mistral.ai/v1", "MISTRAL_API_KEY"),
}
RETRYABLE_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")   # the tool names every provider takes (fullmatch)
_OPTIONAL_FIELDS = ("response_format", "stream_options")  # dropped if a server rejects them
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")   # an HTTP token (RFC 9110); bob_cli too
_SENT_BACK = ("reasoning_content", "extra_content")  # a message's fields its server wants back
_NO_ANSWER = "(no answer: the turn ended here)"  # Mistral takes no user message after a tool


def _text(content):
    """Message content as text: a string, null, or a list of {"type": "text"} parts."""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return "".join(p["text"] for p in content if isinstance(p.get("text"), str))
    if not isinstance(content, _OPTIONAL_STR):
        raise ValueError("the content is neither text nor a list of parts")
    return content or ""


def _usage(u):
    """Token counts; Usage() (unknown) when the server sent none or nonsense."""
    n = [u.get("prompt_tokens") or 0,
         u.get("completion_tokens") or 0] if isinstance(u, dict) else [-1]
    return Usage(*n) if all(type(i) is int and 0 <= i < 1e15 for i in n) else Usage()


def _message_to_wire(m, ids, refused):
    """One message on the wire; `ids` renders tool-call ids (Mistral's: _short_id); what the
    server `refused` of reasoning_content and extra_content is left out (the message keeps it)."""
    d = {"role": m.role, "content": m.content or ""}  # "" not null: some reject
    if m.tool_calls:
        d["tool_calls"] = [{  # a server refusing extra_content takes no other extra either
            **({} if "extra_content" in refused else c.extra or {}), "id": ids(c.id),
            "type": "function", "function": {
                "name": c.name, "arguments": _model_json(c.arguments)}}
            for c in m.tool_calls]
    if m.reasoning is not None and "reasoning_content" not in refused:
        d["reasoning_content"] = m.reasoning
    if m.role == "tool":
        d["tool_call_id"] = ids(m.tool_call_id)
        if m.name:
            d["name"] = m.name
    return d


def _short_id(call_id):
    """A tool-call id as Mistral takes it: 9 letters or digits, the same for the same id."""
    return hashlib.sha256(str(call_id).encode()).hexdigest()[:9]


def _function(c):
    """The `function` of a wire tool call ({} if absent); ValueError if either is no object."""
    fn = _want(c, dict, "a tool call").get("function")
    return {} if fn is None else _want(fn, dict, "its function")


def _call_extra(c):
    """What the server attached to a wire tool call and wants back with it (Gemini's
    extra_content, its thought signature), or {}."""
    return {"extra_content": c["extra_content"]} if "extra_content" in c else {}


def _call_from_wire(call_id, name, arguments, extra):
    """A ToolCall; arguments that are not a JSON object give one with `error` set (not run)."""
    # Why not {}: the model must learn its arguments were lost, not see the tool complain of
    # missing keys. A missing id stays "": the runtime gives it a unique one.
    name = str(name or "")
    args = arguments
    problem = "are not a JSON object"
    if isinstance(args, str):
        try:
            args = _json(args) if args.strip() else {}
        except _BAD_JSON as e:
            problem = f"are not valid JSON ({e})"
        if isinstance(args, str):  # some models double-encode
            with contextlib.suppress(*_BAD_JSON):
                args = _json(args)
    error = None
    if not isinstance(args, dict):
        shown = _excerpt(arguments if isinstance(arguments, str) else repr(arguments))
        error = (f"the arguments of {name!r} {problem}: {shown!r}; call it again with one JSON "
                 "object that fits its schema")
        args = {}
    return ToolCall(str(call_id or ""), name, args, error, extra or None)


def _wire_call(c):
    """One tool call of a completion's message; ValueError when it is malformed."""
    fn = _function(c)
    return _call_from_wire(c.get("id"), fn.get("name"), fn.get("arguments"), _call_extra(c))


class _Stream:
    """A streamed reply being put together: text, tool calls by index, usage, finish_reason."""

    usage = Usage()         # until the server sends some
    finish_reason = None    # a str once the server says
    done = False            # [DONE] was seen

    def __init__(self, on_delta):
        self.on_delta = on_delta
        self.text = []        # str pieces
        self.reasoning = []   # str pieces
        self.calls = []  # [id, name, arguments, extra], in order
        self.slots = {}  # an index (int) -> the call streamed there; an id (str) -> its call: a
        #                  piece may come back to it later

    def add(self, chunk):
        """Fold one chat.completion.chunk in; text deltas go to on_delta. Raises if malformed."""
        groq = chunk.get("x_groq")  # Groq's usage, when stream_options was refused
        usage = chunk.get("usage") or (isinstance(groq, dict) and groq.get("usage"))
        if usage:
            self.usage = _usage(usage)
        for choice in _want(chunk.get("choices") or [], list, "'choices'"):
            delta = _want(_want(choice, dict, "a choice").get("delta") or {}, dict, "a delta")
            if piece := _text(delta.get("content")):
                self.text.append(piece)
                if self.on_delta:
                    self.on_delta(piece)
            if reasoning := _str(delta.get("reasoning_content")):
                self.reasoning.append(reasoning)
            for i, tc in enumerate(_want(delta.get("tool_calls") or [], list, "tool_calls")):
                fn = _function(tc)
                index = tc.get("index", i)
                call_id = _str(tc.get("id"))
                if type(index) is not int:
                    raise ValueError(f"a tool call's index is {index!r}, not an integer")
                slot = self.slots.get(call_id) or self.slots.get(index)
                if not slot or (call_id and slot[0] and call_id != slot[0]):
                    slot = ["", "", "", {}]  # Gemini and Ollama stream parallel calls at one
                    self.calls.append(slot)  # index, each with its own id
                self.slots[index] = slot
                if call_id:   # ids may repeat: keep one
                    self.slots[call_id] = slot
                    slot[0] = call_id
                slot[3].update(_call_extra(tc))
                if (name := fn.get("name")) and name != slot[1]:  # names may repeat: keep one
                    slot[1] += name
                args = fn.get("arguments") or ""   # an object, whole, from some servers
                slot[2] += args if isinstance(args, str) else json.dumps(args)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def response(self, url):
        """The reply; LlmError if the stream ended before it said it was finished."""
        if not (self.done or self.finish_reason):
            raise LlmError(f"the stream from {url} was cut before it finished "
                           f"({sum(map(len, self.text))} chars received)")
        return LlmResponse(
            "".join(self.text), tuple(itertools.starmap(_call_from_wire, self.calls)),
            self.usage, self.finish_reason, "".join(self.reasoning) or None)


def _sse_data(pieces):
    """Yield the data of each Server-Sent Event (its `data:` lines joined), as soon as the blank
    line ending it arrives; an event the body ends in comes too."""
    pending = []  # a line not ended yet: joined once (bench/hostile_llm.py /stream)
    data = []     # the data lines of the event so far
    for piece in pieces:
        pending.append(piece)
        if b"\n" not in piece:
            continue
        *lines, rest = b"".join(pending).split(b"\n")
        pending = [rest]
        for line in lines:
            if line.startswith(b"data:"):
                data.append(line[5:].strip())
            elif not line.strip() and data:
                yield b"\n".join(data).decode("utf-8", "replace")
                data = []
    if data:
        yield b"\n".join(data).decode("utf-8", "replace")


def _retry_after(value):
    """Retry-After in seconds: a number or an HTTP date; None when absent or unreadable."""
    def date(v):
        return email.utils.parsedate_to_datetime(v).timestamp() - time.time()
    for seconds in float, date:   # the first reading that works
        with contextlib.suppress(TypeError, ValueError):
            return max(0.0, seconds(value))
    return None


def _hide_login(url):
    """The URL with its user:password@ (a secret, and the password may hold '@') as ***@."""
    return re.sub(r"//[^/?#]*@", "//***@", url)


def _cause(e):
    """The innermost reason of a transport error, short (requests nests them deeply)."""
    found = re.findall(r"\[Errno -?\d+\] [^'\")]+|Read timed out|Connection refused|"
                       r"Response ended prematurely|Remote end closed connection", str(e))
    return found[-1] if found else type(e).__name__


def _abort(conn):
    """Shut the socket of an in-flight connection: a thread blocked on it wakes up."""
    sock = getattr(conn, "sock", None)
    fd = getattr(conn, "bob_fd", None)
    try:
        if sock and sock.fileno() != -1:
            sock.shutdown(socket.SHUT_RDWR)
        elif fd is not None:  # mid TLS handshake: shut the socket through a duplicate of its fd
            with socket.socket(fileno=os.dup(fd)) as dup:
                dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# Why these hooks: cancel() must wake a thread blocked on a reply, but closing a Session only
# closes idle connections; so each thread's connection is noted, and _abort shuts its socket.
# A cancel that comes before the connection is noted is seen through `cancels` instead.

def _tracked(pool_cls, inflight, cancels):
    """A urllib3 pool class noting in `inflight` the connection each thread uses."""
    def cancelled_here():   # (no token noted for this thread: not cancelled)
        return getattr(cancels.get(threading.get_ident()), "cancelled", False)

    class Connection(pool_cls.ConnectionCls):  # test_cancel_aborts_a_tls_handshake_...
        def _new_conn(self):
            sock = super()._new_conn()
            self.bob_fd = sock.fileno()  # TLS wrapping detaches `sock`; _abort needs this
            if cancelled_here():  # test_a_cancel_before_the_connection_is_taken_still_aborts_it
                sock.shutdown(socket.SHUT_RDWR)
            return sock

    class Pool(pool_cls):
        ConnectionCls = Connection

        def _make_request(self, conn, *args, **kwargs):
            inflight[threading.get_ident()] = conn  # until _attempt ends
            if cancelled_here():  # the cancel came first and found nothing to shut (same test)
                _abort(conn)
            try:
                return super()._make_request(conn, *args, **kwargs)
            finally:
                conn.bob_fd = None  # connected, or failed: _abort must not use the fd
    return Pool


def _tracking_session(inflight, cancels):
    """A requests.Session whose pools are _tracked, and the exceptions of a failed transport."""
    try:
        import requests
        import urllib3
    except ImportError as e:
        raise ConfigError(f"OpenAICompatLlm needs requests ({e}): pip install requests") from e
    class Session(requests.Session):
        def resolve_redirects(self, *args, **kwargs):
            yield from ()  # none followed: requests reads a 3xx body whole, even not following

    session = Session()
    pools = {scheme: _tracked(pool_cls, inflight, cancels)   # urllib3's, for http and https
             for scheme, pool_cls in urllib3.poolmanager.pool_classes_by_scheme.items()}
    for adapter in session.adapters.values():   # requests' own, for http:// and https://
        adapter.poolmanager.pool_classes_by_scheme = pools
    return session, (urllib3.exceptions.HTTPError, OSError)  # requests' RequestException is one


def _check_settings(retry_max, max_response_bytes, tool_choice, timeout_s):
    """ConfigError naming the first of OpenAICompatLlm's settings out of its range; timeout_s
    is a number of seconds > 0 (not None, a str, nan or inf)."""
    for k, v, lo in ("retry_max", retry_max, 0), ("max_response_bytes", max_response_bytes, 1):
        if type(v) is not int or v < lo:
            raise ConfigError(f"{k} must be an integer >= {lo}, got {v!r}")
    if tool_choice not in ("auto", "required", "none"):
        raise ConfigError(f"tool_choice must be auto, required or none, got {tool_choice!r}")
    if type(timeout_s) not in (int, float) or not 0 < timeout_s < 1e9:   # nan compares false
        raise ConfigError(f"timeout_s must be a number of seconds > 0 (and < 1e9), "
                          f"got {timeout_s!r}")


@dataclass(frozen=True)
class _Retry:
    """A failed attempt that may be tried again (after `retry_after` s, if the server said)."""
    error: LlmError
    retry_after: float = None   # None: the server did not say
    counted: bool = True  # False: an optional field was dropped, which costs no retry


def _unquoted(text, messages):
    """An error's `text` with each text of the wire `messages` that names a field bob sends
    back (_SENT_BACK) cut out of it, as sent and as a JSON body quotes it (non-ASCII escaped,
    as Python's json does, or not, as FastAPI's and serde's do): a server quoting the user's
    words ("what does reasoning_content mean?") names no field. Only texts holding a whole
    name and more: a piece of one ("on", "_content") or the name alone, cut everywhere, would
    cut the name itself out of a real refusal."""
    for c in (str(m.get("content")) for m in messages):
        if c not in _SENT_BACK and any(f in c for f in _SENT_BACK):
            for quoted in c, json.dumps(c)[1:-1], _model_json(c)[1:-1]:
                text = text.replace(quoted, "")
    return text


class OpenAICompatLlm:
    """An LlmPort for OpenAI-compatible /chat/completions endpoints; `model` is "provider:model"
    (see PROVIDERS); `base_url` and `api_key_env` override the provider's defaults."""

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None,
                 api_key_env: str | None = None, retry_max: int = 2, stream: bool = False,
                 temperature: float | None = None, seed: int | None = None,
                 max_tokens: int | None = None, json_response_format: bool = True, *,
                 timeout_s: float = 120.0, backoff_base_s: float = 0.5,
                 stream_usage: bool = True, max_response_bytes: int = 16 * 1024 * 1024,
                 tool_choice: str = "auto", headers: dict[str, str] | None = None,
                 extra_body: dict[str, Any] | None = None):
        provider, _, name = model.partition(":")
        if not provider or not name:
            raise ConfigError(f"model {model!r} must be 'provider:model', e.g. "
                              "'openai:gpt-4o-mini' or 'ollama:llama3.2'")
        if provider not in PROVIDERS and not base_url:
            raise ConfigError(f"unknown provider {provider!r} in model {model!r}: known "
                              f"providers are {', '.join(PROVIDERS)}; for another "
                              "OpenAI-compatible server give base_url")
        _check_settings(retry_max, max_response_bytes, tool_choice, timeout_s)
        default_url, default_env = PROVIDERS.get(provider, ("", None))
        self.provider = provider
        self.model = name
        self.base_url = (base_url or default_url).rstrip("/")
        if re.search("[?#]", self.base_url):   # not echoed: it may hold a key
            raise ConfigError("base_url must hold no query or fragment (keys go in api_key_env)")
        self.api_key_env = api_key_env or default_env
        self.retry_max = retry_max
        self.stream, self.stream_usage = stream, stream_usage
        self.temperature, self.seed, self.max_tokens = temperature, seed, max_tokens  # sampling
        self.json_response_format = json_response_format
        self.tool_choice = tool_choice
        self.timeout_s = timeout_s
        self.backoff_base_s = backoff_base_s
        self.max_response_bytes = max_response_bytes
        self._api_key, self._key_source = self._find_key(model, api_key)
        self._set_extras(headers, extra_body)
        self._url = f"{self.base_url}/chat/completions"
        self._shown = _hide_login(self._url)   # as errors show it
        self._rejected = set()   # fields (and forms of response_format) this server refused
        self._inflight = {}      # thread id -> connection it is using
        self._cancels = {}       # thread id -> the CancelToken of its call
        self._session, self._transport_errors = _tracking_session(self._inflight, self._cancels)

    def _find_key(self, model, key):
        """The API key (`key`: the api_key given, if any) and where it came from; ConfigError
        naming the variable if it is bad."""
        env = self.api_key_env
        if key:
            source = "the api_key given"
        elif env:
            key = os.environ.get(env)
            source = f"the environment variable {env}"
            if not key:
                raise ConfigError(f"no API key for {model!r}: set the environment variable "
                                  f"{env} (or name another one with api_key_env, in agent.toml "
                                  "under [llm]; local servers such as ollama:... need none)")
        else:
            return None, ""   # a local server: no key
        if not re.fullmatch(r"[!-~]+", key):  # printable ASCII only: a pasted newline
            raise ConfigError(f"the API key for {model!r} in {source} contains spaces or "
                              "control or non-ASCII characters; set it again")
        return key, source

    def _set_extras(self, headers, extra_body):
        """The request's headers (the user's win over bob's) and extra body fields, checked."""
        headers = headers or {}
        self.extra_body = extra_body or {}
        # what requests can send as it is: a name that is an HTTP token, a value of one line of
        # ASCII without spaces around it (else every call failed as an internal error), and no
        # header that says what the body is or frames it: bob sends JSON and sets those (a
        # Content-Type given replaced bob's, and a server read the JSON as something else)
        if not isinstance(headers, dict) or not all(
                isinstance(k, str) and HEADER_NAME.fullmatch(k) and isinstance(v, str)
                and re.fullmatch(r"([!-~]([ -~]*[!-~])?)?", v)   # printable ASCII, not spaced
                and k.lower() not in ("content-length", "transfer-encoding", "content-type")
                for k, v in headers.items()):
            raise ConfigError("headers must map header names (letters, digits, - and _; not "
                              "Content-Type or Content-Length, which bob sets) to values of one "
                              "line of ASCII, e.g. {'api-key': '...'}")
        try:
            json.dumps(_want(self.extra_body, dict, "extra_body"), allow_nan=False)
        except (TypeError, *_BAD_JSON) as e:
            raise ConfigError(f"extra_body must be a JSON object of body fields ({e})") from None
        self._headers = {"Content-Type": "application/json", **(
            {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}), **headers}
        self._secret_headers = [k for k in headers if secret_name(k)]  # masked, named on a 401
        # Never shown in an error: the key, secret-named headers' and extra_body fields' values,
        # and their long words (a 401 echoes the token of "Bearer <token>" alone)
        values = [self._api_key or "", *(headers[k] for k in self._secret_headers), *(
            v for k, v in self.extra_body.items() if secret_name(k) and isinstance(v, str))]
        words = {w for v in values for w in v.split() if len(w) >= 8}
        self._secrets = sorted(words.union(values) - {""}, key=len, reverse=True)

    def __repr__(self) -> str:
        return f"<OpenAICompatLlm {self.describe()}>"

    def describe(self) -> str:
        """One line for humans, e.g. "openai:gpt-4o-mini at https://api.openai.com/v1"."""
        return f"{self.provider}:{self.model} at {self._shown.removesuffix('/chat/completions')}"

    def close(self) -> None:
        """Close the pooled connections (the adapter still works: it reconnects)."""
        self._session.close()

    def complete(self, req: LlmRequest, cancel: CancelToken,
                 on_delta: Callable[[str], None] | None = None) -> LlmResponse:
        """One chat completion with retries, by timeout_s or the deadline; LlmError, Cancelled."""
        end = min(time.monotonic() + self.timeout_s, req.deadline or math.inf)  # earlier wins
        me = threading.get_ident()
        self._cancels[me] = cancel
        unhook = cancel.on_cancel(lambda: _abort(self._inflight.pop(me, None)))
        try:
            tries = 0
            while not cancel.cancelled:
                outcome = self._attempt(self._to_wire(req), end, cancel, on_delta)
                if isinstance(outcome, LlmResponse):
                    return outcome
                e = outcome.error
                tries += outcome.counted
                delay = outcome.retry_after  # else back off exponentially, with jitter
                if delay is None:
                    delay = self.backoff_base_s * 2 ** (tries - 1) * random.uniform(0.5, 1.0)
                if tries > self.retry_max:
                    why = f"gave up after {tries} tries"
                elif delay >= end - time.monotonic():  # fail now, not sleep into the deadline
                    why = f"no time left to retry: the next try would start in {delay:.2f} s"
                else:
                    cancel.wait(delay)  # a cancel ends the wait at once
                    continue
                raise LlmError(f"{e} ({why})", e.status_code, e.body)
            raise Cancelled("the LLM request was cancelled")
        finally:
            unhook()
            self._cancels.pop(me, None)

    # -- one HTTP exchange --

    def _attempt(self, body, end, cancel, on_delta):
        """Send once, done by `end`. The reply or a _Retry; LlmError when retrying is useless."""
        timeout = end - time.monotonic()
        if timeout <= 0:
            raise LlmError(f"no time left for a request to {self._shown}")
        acc = _Stream(on_delta)
        me = threading.get_ident()  # a socket timeout bounds one read: headers dripped a byte
        watchdog = threading.Timer(timeout, lambda: _abort(self._inflight.get(me)))  # at a time
        watchdog.start()           # are bounded by this (the body by _body's clock)
        try:
            # the response is closed as the block ends, however it ends (Response.__exit__);
            # the body is ASCII JSON (json.dumps' default), which urllib3 sends as its bytes
            with self._session.post(self._url, json.dumps(body, separators=(",", ":")),
                                    headers=self._headers, timeout=timeout,  # each of both
                                    stream=True) as resp:
                if resp.status_code != 200:
                    return self._http_failure(resp, body, end)
                if "text/event-stream" not in resp.headers.get("Content-Type", ""):
                    return self._from_wire(b"".join(self._body(resp, end)))  # "stream" ignored
                self._read_stream(resp, acc, end)
                if not (acc.done or acc.finish_reason or acc.text or acc.calls):
                    return _Retry(LlmError(f"the stream from {self._shown} ended before any "
                                           "data"))  # nothing shown yet: safe to try again
                return acc.response(self._shown)
        except self._transport_errors as e:
            if cancel.cancelled:
                raise Cancelled("the LLM request was cancelled") from None
            if acc.text or acc.calls or acc.done:  # the user saw part of it: do not try again
                return acc.response(self._shown)
            return _Retry(self._transport_error(e, time.monotonic() >= end))
        finally:  # a cancel from now on must not shut a connection another call may be using
            watchdog.cancel()
            self._inflight.pop(me, None)

    def _transport_error(self, e, late):
        """What failed on the wire, in words; `late`: the watchdog shut the socket."""
        import requests  # already loaded by _tracking_session
        if isinstance(e, requests.ConnectTimeout):
            what = "timed out connecting to"
        elif isinstance(e, requests.Timeout) or late or _cause(e) == "Read timed out":
            what = "no answer in time from"   # the last: urllib3's, reading the body
        elif isinstance(e, requests.ConnectionError):
            what = "cannot reach"
        else:
            what = "transport error on"
        hint = (" (is the server running? check base_url)"
                if isinstance(e, requests.ConnectionError) and not late else "")
        return LlmError(f"{what} {self._shown}: {_cause(e)}{hint}")

    def _http_failure(self, resp, body, end):
        """A non-200 answer: a _Retry when the status may pass, else raise LlmError at once."""
        if resp.is_redirect:   # not followed (see _tracking_session)
            raise LlmError(f"{self._shown} redirected (HTTP {resp.status_code}) to "
                           f"{_hide_login(_excerpt(resp.headers['Location']))}; set base_url "
                           "to where it points")
        status = resp.status_code
        text = b"".join(self._body(resp, end)).decode("utf-8", "replace")
        hint = ""
        if status in (401, 403):
            checks = [f"the key in {self._key_source}"] if self._key_source else []
            checks += [f"the header {k!r}" for k in self._secret_headers]
            fix = (f"check {' and '.join(checks)}" if checks
                   else "this server wants a key: set api_key_env")
            hint = f" (the credentials were refused: {fix})"
        elif status == 400 and _CONTEXT_TOO_LONG.search(text):
            hint = (" (the conversation is too long for the model's context window: lower "
                    "max_history_messages, or use a model with a longer context)")
        elif status == 404:
            hint = f" (check base_url and the model name {self.model!r})"
        error = self._error(status, f"answered HTTP {status}{hint}", text)
        refused = [f for f in _OPTIONAL_FIELDS  # a field the user put in extra_body stays
                   if f in body and f in text and f not in self.extra_body]
        # What a message carries back to the server that made it: another server (after
        # /model) may refuse it as an unknown field, unless its words ask for it (DeepSeek
        # names reasoning_content when a message from another server lacks it: "Missing
        # `reasoning_content` field", "The `reasoning_content` in the thinking mode must be
        # passed back"; "\n" in the JSON body is a space): words next to the name, not a
        # quoted text's (a refusal may echo the reasoning it refused), in the error's head (a
        # huge body's words cost seconds of regex), a text the request sent cut out (_unquoted).
        # A field no message carried is no refusal, named (an error quoting the user's text)
        # or left out already (else: retried for ever)
        sent = {k for m in body["messages"] for part in (m, *m.get("tool_calls", ())) for k in part}
        said = _unquoted(text[:65536], body["messages"])
        refused += [f for f in _SENT_BACK if f in said and f in sent
                    and not re.search(rf"(?i)(missing|required)([^\w\\]|\\[nrt])+{f}|{f}"
                                      r"([^\w\\]|\\[nrt])+(\w+([^\w\\]|\\[nrt])+){,6}?"
                                      "(missing|required|must be passed)", said[:4096])]
        if refused and status in (400, 422, 500):  # 422: Mistral; 500: llama-cpp-python
            field_ = refused[0]
            if field_ == "response_format":
                field_ = " ".join(body[field_])   # this form of it
            self._rejected.add(field_)
            log.warning("%s rejected %s; this adapter no longer sends it", self._shown, field_)
            return _Retry(error, 0.0, counted=False)
        if status in RETRYABLE_STATUSES:
            return _Retry(error, _retry_after(resp.headers.get("Retry-After")))
        raise error

    def _error(self, status, what, text):
        """LlmError "<endpoint> <what>: '<what the server sent>'", with the API key masked."""
        text = " ".join(text.split(maxsplit=300)[:300])   # its first 300 words (the split stops)
        for key in self._secrets:   # the longest first: no half-masked forms
            for shown in key, key.replace("/", "\\/"):  # as sent; as JSON escaping "/" echoes it
                text = text.replace(shown, "***")
        excerpt = text[:300]
        return LlmError(f"{self.describe()} {what}: {excerpt!r}", status, excerpt)

    # -- wire format --

    def _to_wire(self, req):
        """The request body; optional fields only when set (and not refused by the server)."""
        mistral = "mistral" in self.describe().lower()  # its API, or its models on vLLM
        messages = []
        for m in req.messages:  # Mistral takes ids of 9 letters, no user right after a tool
            if mistral and m.role == "user" and messages and messages[-1]["role"] == "tool":
                messages.append({"role": "assistant", "content": _NO_ANSWER})
            messages.append(_message_to_wire(m, _short_id if mistral else str, self._rejected))
        body = {"model": self.model, "messages": messages}
        if req.tools and req.response_format != "json":
            for t in req.tools:
                if not TOOL_NAME.fullmatch(t.name):
                    raise ConfigError(f"tool name {t.name!r} cannot be sent to the model: names "
                                      f"must match {TOOL_NAME.pattern} (letters, digits, _ and "
                                      "-, at most 64)")
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}
                for t in req.tools]
            body["tool_choice"] = self.tool_choice  # llama.cpp calls no tool without it
        # json mode's response_format, best first: OpenAI's json_schema (vLLM, Ollama, LM
        # Studio, OpenAI take it), llama.cpp's own json_object with a schema, plain json_object.
        # A server refusing a form (llama-cpp-python: HTTP 500 for json_schema) gets the next
        # from then on, and plain text after the last; a form is known by its keys
        form = None
        if req.response_format == "json" and self.json_response_format:
            schema = action_schema(req.tools)
            forms = [{"type": "json_schema", "json_schema": {"name": "action", "schema": schema}},
                     {"type": "json_object", "schema": schema}, {"type": "json_object"}]
            form = next((f for f in forms if " ".join(f) not in self._rejected), None)
        options = {"temperature": self.temperature, "seed": self.seed,
                   "max_tokens": self.max_tokens, "stream": self.stream or None,
                   "response_format": form,
                   "stream_options": ({"include_usage": True}
                                      if self.stream and self.stream_usage else None)}
        body.update((k, v) for k, v in options.items() if v is not None and k not in self._rejected)
        return body | self.extra_body   # a field the user set in extra_body wins

    def _from_wire(self, raw):
        """A non-streamed completion body -> LlmResponse; LlmError saying what is malformed."""
        try:
            data = _want(_json(raw), dict, "the body")
            choices = data.get("choices")
            if not (isinstance(choices, list) and choices):
                raise ValueError("the body has no 'choices' list with a choice in it")
            choice = _want(choices[0], dict, "the first choice")
            msg = _want(choice.get("message"), dict, "the message")
            calls = tuple(map(_wire_call, _want(msg.get("tool_calls") or [], list, "tool_calls")))
            content = _text(msg.get("content"))
        except _BAD_JSON as e:  # the decoder's own words say where, not what
            what = "the body is not JSON" if isinstance(e, json.JSONDecodeError) else e
            raise self._error(200, f"answered HTTP 200 but {what}",
                              raw.decode("utf-8", "replace")) from None
        return LlmResponse(content, calls, _usage(data.get("usage")),
                           _str(choice.get("finish_reason")), _str(msg.get("reasoning_content")))

    def _body(self, resp, end):
        """The inflated body in pieces as they come; LlmError past max_response_bytes or `end`."""
        total = 0
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise LlmError(f"the answer from {self._shown} was still coming when the time "
                               f"for the call ran out ({total} bytes came)")
            # looked up each time: at the body's end urllib3 gives the connection back to the
            # pool, which closes it when full (16 callers: "[Errno 9] Bad file descriptor")
            if sock := getattr(resp.raw.connection, "sock", None):
                sock.settimeout(left)  # test_a_server_sending_a_byte_every_so_often_...
            piece = resp.raw.read1(65536, decode_content=True)  # what has come, inflated
            total += len(piece)
            if total > self.max_response_bytes:
                raise LlmError(f"the answer from {self._shown} is over max_response_bytes="
                               f"{self.max_response_bytes}; if that is expected, raise it (the "
                               "keyword, or [llm] max_response_bytes in agent.toml)")
            if not piece:
                return
            yield piece

    def _read_stream(self, resp, acc, end):
        """Fold Server-Sent Events into `acc` until [DONE] or the end of the body."""
        for payload in _sse_data(self._body(resp, end)):
            if payload == "[DONE]":  # the end (test_done_ends_the_stream_even_when_...)
                acc.done = True
                with contextlib.suppress(AttributeError, *self._transport_errors):  # keep-alive:
                    resp.raw.connection.sock.settimeout(0.05)  # take the body's end if it is near
                    resp.raw.read1(65536, decode_content=True)
                return
            try:
                chunk = _want(_json(payload), dict, "the event")
                if "error" in chunk:
                    raise ValueError("it reports an error")
                acc.add(chunk)
            except (*_BAD_JSON, TypeError) as e:
                raise self._error(200, f"sent a bad stream event ({e})", payload) from None


# ---- 12. Replay ---------------------------------------------------------------------------------
# A JSONL trace is a complete record of a run; these ports answer from one, replay() compares.

_Event = dict[str, Any]   # one event of a trace, as JSON has it, with its `line`
_Trace = str | os.PathLike | Sequence[_Event]   # a JSONL file, or its events
_TIMED_OUT = "the recorded turn ran out of time waiting for this reply"
_MALFORMED = (LookupError, TypeError, ValueError, AttributeError)  # a field missing or mistyped


class TraceError(BobError):
    """A trace that cannot be read or was cut short; the message names the line."""


def _turn_start(turn):
    """The data of a turn's turn_started, if it has one yet."""
    return next((e["data"] for e in turn if e["kind"] == "turn_started"), None)


def read_trace(trace: _Trace) -> list[_Event]:
    """The events of a JSONL trace file (or a list of them), each with its `line`."""
    if isinstance(trace, (str, os.PathLike)):
        try:   # a FIFO or a device (/dev/zero) is an error, not a hang or all the memory
            raw = _read_file(Path(trace))
            lines = raw.decode("utf-8").splitlines()
        except UnicodeDecodeError as e:
            n = raw.count(b"\n", 0, e.start) + 1
            raise TraceError(f"{trace} line {n} is not UTF-8 text: not a trace") from None
        except OSError as e:
            raise TraceError(f"cannot read the trace {trace}: {e}") from None
        try:   # all lines in one parse, 2.5 times as fast as one at a time
            events = _json("[" + ",\n".join(lines) + "]")
        except _BAD_JSON as e:   # a RecursionError has no line
            n = getattr(e, "lineno", "?")
            raise TraceError(f"{trace} line {n} is not a trace event (cut short?)") from None
    else:
        events = lines = list(trace)   # one list: a line is an event
        trace = "event list"   # how errors name it
    for n, e in enumerate(events, 1):
        if not (isinstance(e, dict) and isinstance(e.get("kind"), str)
                and isinstance(e.get("data"), dict)
                and isinstance(e.get("session_id"), _OPTIONAL_STR)):   # (a key: turns by session)
            raise TraceError(f"{trace} line {n} is not a trace event (cut short?)")
        # a file's line number; a listed event read from a file before keeps that file's
        e["line"] = e.get("line", n) if events is lines else n
    if len(events) != len(lines):   # more events than lines: a line holds two
        raise TraceError(f"{trace} holds more events than lines: not a trace")
    return events


def _recorded_reply(d):
    """A recorded llm_call_completed's data as the LlmResponse: its content, calls and reasoning
    checked as a saved message's are; a message may leave its calls out, a recorded reply never
    does (deleted: replayed without them)."""
    _field(d, "tool_calls", list)
    m = Message.from_dict(d | {"role": "assistant"})
    return LlmResponse(m.content, m.tool_calls, Usage(**d["usage"]),
                       _field(d, "finish_reason", _OPTIONAL_STR), m.reasoning)


class _Replay:
    """The two ports of a replay, answering from one trace read once (ReplayLlm and ReplayTools
    are its two faces; replay() uses one object as both). Never calls a model; a mismatch is an
    error to the runtime, and `divergence` says why."""

    # Answers come from memory and never block: the runtime calls them on its own thread
    # (_inline, _Worker), and runs a batch's calls one after another, in call order. Each class
    # says so itself: a subclass that may block does not inherit it
    _answers_inline = True
    # replay()'s runtime during its turn (where the turn's time is ended: _gave_up, _Recorder); and
    # whether the recorded listing outlived its turn (_read), so that this one does too
    runtime = None
    unlisted = False

    def __init__(self, trace: _Trace, on_interrupt: Callable[[], None] | None = None):
        events = read_trace(trace)
        self.tools = [ToolDescriptor(**d) for d in (_turn_start(events) or {"tools": []})["tools"]]
        self.on_interrupt = on_interrupt
        self.divergence = None   # the first difference, a str
        self.requests = []       # the LlmRequests asked, in order
        # per request: its digest, and what it got: a reply, an LlmError, _TIMED_OUT, or None
        # (no answer: the turn was cancelled while it waited)
        self._script = []
        self._parts = {}   # the parts of request_digest
        self.told = None   # the digest of the next request, if replay()'s sink saw it (_Recorder)
        self._calls = {}   # call id -> the recorded calls with that id, oldest first
        # call id -> the recorded decisions on calls with that id, oldest first (a model may
        # reuse an id in a later batch); _TIMED_OUT: the approver was asked, never answered
        self.decided = {}
        started = {}   # call id -> its tool_call_started
        asked = None   # the line of the request not answered yet
        try:   # a field missing or of a wrong type: a TraceError naming the line, below
            for e in events:
                asked = self._read(e, asked, started)
        except _MALFORMED as x:
            raise TraceError(f"line {e['line']}: this {e['kind']} is not as bob writes it "
                             f"({type(x).__name__}: {x})") from None

    def _read(self, e, asked, started):
        """Take in one event; the line of the request not answered yet, if any."""
        kind, d = e["kind"], e["data"]
        # a request with no reply, yet the turn went on or ended other than cancelled
        cut = kind == "turn_completed" and d["finish_reason"] != "cancelled"
        if asked and (cut and self._script[-1][1] is None
                      or kind in ("llm_call_started", "action_parsed", "parse_error")):
            raise TraceError(f"line {asked}: this llm_call_started has no "
                             "llm_call_completed, yet the turn went on: the trace was edited")
        if kind == "llm_call_started":
            self._script.append([d["digest"], None])
            asked = e["line"]
        elif kind == "llm_call_completed":
            if not asked:   # a reply twice, or one added: the mirror of a reply deleted
                raise TraceError(f"line {e['line']}: this llm_call_completed answers no "
                                 "llm_call_started: the trace was edited")
            self._script[-1][1] = _recorded_reply(d)
            asked = None
        elif asked and kind == "guard_tripped":   # the only guard that trips while waiting
            self._script[-1][1] = _TIMED_OUT
        elif kind == "guard_tripped":   # the one before any LLM call: listing the tools
            self.unlisted |= d["detail"].startswith("listing the tools")
        elif asked and d.get("where") == "turn":   # the model failed: the turn raised
            self._script[-1][1] = LlmError(d["error"].partition(": ")[2])
        # the first turn failed at Start on a tool schema that is not JSON: listed so again
        elif kind == "error" and not self._script and d["error"].endswith("; deny it"):
            self.tools = [ToolDescriptor("unfit", "", {"default": math.nan})]
        elif kind == "approval_requested":   # unanswered, unless a decision comes
            self.decided.setdefault(d["call_id"], []).append(_TIMED_OUT)
        # (a decision on no request: a resume's, given in the AgentRequest, is not asked again)
        elif kind == "approval_decided" and d["call_id"] in self.decided:
            self.decided[d["call_id"]][-1] = Approval(d["allow"], d["reason"], d["arguments"])
        elif kind == "tool_call_started":
            started[d["call_id"]] = d
            if d["runs"] and self.decided.get(d["call_id"], [0])[-1] is _TIMED_OUT:
                raise TraceError(f"line {e['line']}: this call ran, yet the approver asked "
                                 "about it never decided: the trace was edited")
        elif kind == "tool_call_completed" and started[d["call_id"]]["runs"]:
            rec = {**started[d["call_id"]], **d, "cut": "before this call ended" in d["content"]}
            self._calls.setdefault(d["call_id"], []).append(rec)
        return None if kind == "turn_completed" else asked

    # -- the LlmPort --

    @property
    def left_over(self) -> int:
        """Recorded replies that no request asked for."""
        return sum(isinstance(s[1], LlmResponse) for s in self._script[len(self.requests):])

    def complete(self, req: LlmRequest, cancel: CancelToken,
                 on_delta: Callable[[str], None] | None = None) -> LlmResponse:
        """The recorded reply to this request."""
        n = len(self.requests)   # (the runtime asks one request at a time)
        self.requests.append(req)
        digest, answer = self._script[n] if n < len(self._script) else (None, None)
        told, self.told = self.told, None
        if digest is None or (told or request_digest(req, self._parts)) != digest:
            what = "differs from the recorded" if digest else "has no recorded reply"
            self.divergence = self.divergence or f"LLM request {n + 1} {what}"
            raise LlmError(f"replay: {self.divergence}")
        if isinstance(answer, LlmResponse):
            return answer
        if isinstance(answer, LlmError):
            raise answer
        # unanswered: the runtime waits for the recorded cancel, or (timed out) for the turn's
        # token, fired here, and sees no answer
        if answer is None and self.on_interrupt:   # cancelled while the model answered: the
            self.on_interrupt()                     # cancel comes now
        else:   # timed out (or alone, in a user's runtime, with no one to cancel)
            cancel.cancel()
        raise _NoAnswer("the recorded request was never answered")

    # -- the ToolPort --

    def list_tools(self) -> list[ToolDescriptor]:
        """The tools the (first) recorded turn offered. In replay(), a listing that outlived
        the recorded turn ends the turn's time (_Turn.woken) and has no answer: it trips again."""
        if self.unlisted and self.runtime:
            self._gave_up()
        return list(self.tools)

    def call_tool(self, call: ToolCall, timeout_s: float,
                  cancel: CancelToken | None = None) -> ToolResult:
        """The recorded result of this call."""
        rec = (self._calls.get(call.id) or [None]).pop(0)
        args = redact(call.arguments)
        if rec is None or (rec["name"], rec["arguments"]) != (call.name, args):
            what = f"tool call {call.id} {call.name}({json.dumps(args)}) was never recorded"
            if rec is not None:
                what += f"; recorded: {rec['name']}({json.dumps(rec['arguments'])})"
            self.divergence = self.divergence or what
            return _error(call, f"replay: {what}")
        # An interrupted call: the cancel comes now; its batch's other calls run on to their
        # recorded results, as they ended before it (the runtime waits for none)
        if rec["cut"] and self.on_interrupt:
            self.on_interrupt()
        return ToolResult(call.id, call.name, rec["content"], rec["is_error"])

    # -- the approver (replay() asks it; answering inline, as the ports do) --

    def __call__(self, call: ToolCall) -> Approval:
        """The recorded decision on this call (none recorded: declined). A call the recorded
        turn ran out of time asking about has none: the turn's time ends (_gave_up), and the
        turn stops as recorded."""
        decision = (self.decided.get(call.id) or [Approval(False, "replay: no recorded decision")]
                    ).pop(0)
        if decision is _TIMED_OUT:   # (a trip after it, deleted: replay() still waits for none)
            self._gave_up()
        return decision

    def _gave_up(self):
        """In replay() (its runtime here), a port call the recorded turn ran out of time on:
        the turn's time ends now (_Turn.woken) and the call has no answer (the runtime takes
        _NoAnswer for none: its text is not shown)."""
        if self.runtime:
            self.runtime._cancel.cancel()
        raise _NoAnswer("the recorded turn ran out of time here")


class ReplayLlm(_Replay):
    """An LlmPort answering from a trace: a request must have the recorded digest, and gets the
    recorded reply; otherwise LlmError, and `divergence` says why. A request the recording ran
    out of time on fires the turn's cancel token: the turn times out at once. TraceError when a
    request has no reply and the turn went on (the trace was edited)."""

    _answers_inline = True   # see _Replay


class ReplayTools(_Replay):
    """A ToolPort answering each call with its recorded result if name and arguments match (else
    an error; `divergence` says why); a call interrupted in the recording calls `on_interrupt`."""

    _answers_inline = True   # see _Replay


@dataclass
class ReplayReport:
    """What replay() found: `ok`, a line per turn, and the first divergence: turn, step, what,
    the recorded and new values, and for a request the first differing message (`detail`)."""
    ok: bool
    turns: list[str]
    turn: int | None = None
    step: int | None = None
    what: str = ""
    recorded: Any = None
    new: Any = None
    detail: str = ""

    def __str__(self) -> str:
        lines = self.turns if self.ok else [
            *self.turns, f"turn {self.turn}, step {self.step}: {self.what}",
            f"  recorded: {json.dumps(self.recorded, default=str)}",
            f"  new:      {json.dumps(self.new, default=str)}", self.detail]
        return "\n".join(filter(None, lines))   # (no detail, no line)


# -- reading turns back --
# The fields replay compares, per event kind (not timestamps, durations or usage).
_COMPARED = {"turn_started": ("tools",), "state": ("from", "to"), "llm_call_started": ("digest",),
             "action_parsed": ("type", "tools"), "parse_error": ("error",),
             "tool_call_started": ("call_id", "name", "arguments"),
             "tool_call_completed": ("call_id", "name", "content", "is_error"),
             "guard_tripped": ("reason", "detail"), "error": ("where",),
             "turn_completed": ("finish_reason", "guard_reason", "content")}


def _shown(e):
    """An event (a trace's, or an AgentEvent's fields) as replay compares it and a report shows
    it: kind, step, compared fields."""
    shown = {"kind": e["kind"], "step": e["step"]}
    for f in _COMPARED[e["kind"]]:   # (a loop: twice as fast as a comprehension unpacked)
        shown[f] = e["data"].get(f)
    return shown


def _turns(events):
    """The events grouped by turn (session_loaded included); TraceError for a turn cut short."""
    turns = []
    open_turns = {}   # session -> its turn so far
    for e in events:
        sid = e.get("session_id")
        turn = open_turns.setdefault(sid, [])
        if e["kind"] == "turn_started":
            if e["data"].get("format") != TRACE_FORMAT or _turn_start(turn):
                raise TraceError(f"line {e['line']}: not a turn this bob replays (format "
                                 f"{e['data'].get('format')}, or the last turn never ended)")
            turns.append(turn)
        turn.append(e)
        if e["kind"] == "turn_completed":
            open_turns.pop(sid)
    for turn in open_turns.values():
        if _turn_start(turn):
            raise TraceError(f"the turn that starts at line {turn[0]['line']} has no "
                             "turn_completed: the trace is cut short")
    return turns


def _cancel_point(events):
    """The index (among compared events) of the event a recorded cancel came right after; None
    when the turn was not cancelled or a tool was interrupted (ReplayTools cancels then)."""
    texts = " ".join(e["content"] for e in events if e["kind"] == "tool_call_completed")
    if events[-1]["finish_reason"] != "cancelled" or "before this call ended" in texts:
        return None
    states = [i for i, e in enumerate(events) if e["kind"] == "state"]
    if "before this call started" in texts:   # while the model answered: before the batch
        return max(i for i in states if events[i]["to"] == State.CALL_TOOL)   # (a str enum)
    return states[-1] - 1   # the cancel was seen at the last transition, to done


def _expiry_point(events):
    """The index (among compared events) of the state event after which a recorded turn ran out
    of time (the last before its turn_timeout trip: the checks before an LLM call and a batch,
    and the approver, come after it); None if it did not, or ran out while the model answered
    (the replay's port answers that request with the turn's token: _Replay.complete)."""
    point = None
    for i, e in enumerate(events):
        if e["kind"] == "state":
            point = i
        elif e.get("reason") == "turn_timeout" and events[i - 1]["kind"] != "llm_call_started":
            return point
    # (None: the recorded turn's time did not run out between port calls)


# -- replaying a turn --

class _Recorder:
    """The replay's event sink: the recorded events (compared and shown) and the new ones; it
    fires the caller's cancel (its port's on_interrupt) where the recorded cancel came, and the
    turn's own token where the recorded turn ran out of time."""

    def __init__(self, recorded, port):
        self.recorded = recorded
        self.events = []   # the new run's, compared and shown
        self.cancel_at = _cancel_point(recorded)
        self.expire_at = _expiry_point(recorded)
        self.port = port

    def emit(self, event):
        if "digest" in event.data:   # of the request the port gets next: one digest, not two
            self.port.told = event.data["digest"]
        if event.kind in _COMPARED:
            self.events.append(_shown(vars(event)))
            n = len(self.events) - 1
            if n == self.cancel_at:   # the caller's cancel (the port's on_interrupt)
                self.port.on_interrupt()
            if n == self.expire_at:   # the turn's time is up (_Turn.woken)
                self.port.runtime._cancel.cancel()


def _first_difference(recorded, new):
    """(step, what, recorded, new) of the first compared event that differs, or None."""
    for a, b in itertools.zip_longest(recorded, new):
        if a == b:
            continue
        b = json.loads(_data_json(b))   # as a trace would have it (lists, not tuples)
        if a == b:
            continue
        if not (a and b and a["kind"] == b["kind"]):   # (one is None where its run ended)
            what = "a different event" if a and b else "one run ended before the other"
            return (a or b)["step"], what, a, b
        f = next(f for f in a if a[f] != b[f])
        return a["step"], f"{a['kind']} {f}", a[f], b[f]
    return None


class _FailedSave:
    """A store whose save fails, as the recorded one did (the session stays as it was)."""

    def __init__(self, store):
        self.load = store.load

    def save(self, session_id, state):
        raise StoreError("replay: the recorded save failed")


def _replay_turn(events, state, given):
    """Run a recorded turn again from `state` with replay()'s settings: its events (recorded and
    new), its ports and the session after it."""
    start = _turn_start(events)
    sid = events[0]["session_id"]
    failed = False
    # what the recorded turn began from, and whether its save failed
    for e in events:
        d = e["data"]
        if e["kind"] == "session_loaded":
            state = SessionState.from_dict(d)
        failed |= d.get("where") == "store.save"
    store = InMemorySessionStore()
    if state is not None:
        store.save(sid, state)
    # the runtime, as recorded but for the settings given
    caller = CancelToken()
    port = _Replay(events, caller.cancel)
    sink = _Recorder([_shown(e) for e in events if e["kind"] in _COMPARED], port)
    tools = given.get("tools")   # (a port may be falsy: one with no tools and a __len__)
    runtime = AgentRuntime(
        port, port if tools is None else tools,
        store=_FailedSave(store) if failed else store, events=sink,
        policy=given.get("policy") or TurnPolicy(**start["policy"]),
        system_prompt=given.get("system_prompt") or start["system_prompt"],
        action_mode=given.get("action_mode") or start["action_mode"],
        ask_tools=start["ask_tools"],   # and the recorded denials stay:
        deny_tools=(*given.get("deny_tools", ()), *start["deny_tools"]),
        approver=port if start["approver"] else None)   # the recorded decisions
    port.runtime = runtime   # (where the turn's time is ended: _Recorder, _Replay._gave_up)
    # the turn: an error that ends it is an event; a bad recorded approval fails again
    approvals = {k: Approval(**a) if isinstance(a, dict) else a
                 for k, a in start["approvals"].items()}
    with contextlib.suppress(BobError):
        runtime.run(AgentRequest(start["input"], sid, approvals=approvals or None), caller)
    # the turn over, the port lets go of its runtime: no cycle (runtime, port, sink), so all the
    # turn's objects (the trace's events among them) go when the report is made, not at the
    # garbage collector's next full pass (a tenth of a 1,000-step replay's time)
    port.runtime = None
    return sink, port, store.load(sid)


def _request_diff(llm, ref):
    """Where `llm`'s last request first differs from the recorded one: `ref`'s, rebuilt by
    replaying the turn as recorded (the digests it matched prove it). The index and role of the
    first message that differs (the report has the two digests)."""
    k = len(llm.requests) - 1
    if ref.divergence or len(ref.requests) <= k:
        return "  (the recorded request cannot be rebuilt from the trace)"
    pairs = enumerate(itertools.zip_longest(ref.requests[k].messages, llm.requests[k].messages))
    return next((f"  message {i} ({(a or b).role}) differs" for i, (a, b) in pairs if a != b),
                "  the messages are the same: the tools or the response format differ")


def _tools_changed(recorded, new):
    """How two lists of tools that differ differ, by name: "removed: a; added: b; changed: c
    (input_schema)", or that only their order did."""
    old = {d["name"]: d for d in recorded}
    now = {d["name"]: d for d in new}
    return "; ".join([f"removed: {n}" for n in old if n not in now]
                     + [f"added: {n}" for n in now if n not in old]
                     + [f"changed: {n} ({', '.join(k for k in d if d[k] != now[n][k])})"
                        for n, d in old.items() if n in now and d != now[n]]
                     ) or "the same tools, in another order"


def _check_turn(events, states, given):
    """Replay one turn from its session's state in `states` (updated): "same (...)", or the
    step, what, recorded and new values and detail of its first divergence."""
    sid = events[0]["session_id"]
    before = states.get(sid)
    sink, port, states[sid] = _replay_turn(events, before, given)
    found = _first_difference(sink.recorded, sink.events)
    if found is None:
        end = events[-1]["data"]
        return (f"same ({end['steps']} LLM calls, {end['tool_calls']} tool calls, "
                f"{end['finish_reason'] or 'error'})")
    step, what, old, value = found
    if str(value).startswith("replay: "):   # a tool result: what ReplayTools saw
        what = value.removeprefix("replay: ")
    if what == "turn_started tools":   # named, and shown by their names
        names = [[d["name"] for d in tools] for tools in (old, value)]
        return step, f"the tools offered differ: {_tools_changed(old, value)}", *names
    if what != "llm_call_started digest":
        return step, what, old, value
    # a request differs: the first message that did
    return (step, port.divergence or what, old, value,
            _request_diff(port, _replay_turn(events, before, {})[1]))


def replay(trace: _Trace, *,
           tools: ToolPort | None = None, policy: TurnPolicy | None = None,
           system_prompt: str | None = None, action_mode: str | None = None,
           deny_tools: Sequence[str] = ()) -> ReplayReport:
    """Re-run every recorded turn offline until the first divergence: `tools` (less `deny_tools`)
    run for real if given; the overrides replace the recorded settings; TraceError."""
    given = {"policy": policy, "system_prompt": system_prompt, "action_mode": action_mode,
             "tools": tools, "deny_tools": deny_tools}
    states = {}   # session -> its SessionState, as its last replayed turn left it
    lines = []
    turns = _turns(read_trace(trace))
    if not turns:
        raise TraceError(f"{trace if isinstance(trace, (str, os.PathLike)) else 'the trace'}"
                         " has no turn_started: it is not a bob trace, or it is empty")
    for n, events in enumerate(turns, 1):
        try:
            outcome = _check_turn(events, states, given)
        except _MALFORMED as e:
            raise TraceError(f"the turn that starts at line {events[0]['line']} cannot "
                             f"be replayed: {type(e).__name__}: {e}") from None
        if not isinstance(outcome, str):
            return ReplayReport(False, [*lines, f"turn {n}: DIFFERENT"], n, *outcome)
        lines.append(f"turn {n}: {outcome}")
    return ReplayReport(True, lines)
