"""bob_replay: re-run a recorded bob trace offline and report the first divergence.

    import bob
    report = bob.replay("run.jsonl")                       # the recorded replies answer
    report = bob.replay("run.jsonl", system_prompt=new)    # would a new prompt change the run?
    print(report)          # "turn 1: same (4 LLM calls, 3 tool calls, final)" per turn
    assert report.ok, str(report)

`bob.replay` imports this file on first use. Each recorded turn runs through a real
bob.AgentRuntime whose model is a bob.ReplayLlm and (unless tools are given) whose tools are a
bob.ReplayTools, both fed from the trace; the events it emits are compared with the recorded
ones, field by field (`_COMPARED`), and the first difference is reported.

Sections: 1. The report  2. Reading turns back  3. Replaying a turn  4. replay()

Needs bob.py beside it and the standard library only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import itertools
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import bob
from bob import (AgentEvent, AgentRequest, AgentRuntime, Approval, BobError, CancelToken,
                 FinishReason, InMemorySessionStore, Message, ReplayLlm, ReplayTools, SessionState,
                 SessionStore, State, ToolCall, ToolPort, TurnPolicy, read_trace,
                 request_digest)

__all__ = ["ReplayReport", "replay"]


# ---- 1. The report ------------------------------------------------------------------------------

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
        values = [f"  {k:<10}{json.dumps(v, default=str)}" for k, v in
                  (("recorded:", self.recorded), ("new:", self.new))] if not self.ok else []
        where = [] if self.ok else [f"turn {self.turn}, step {self.step}: {self.what}"]
        return "\n".join(self.turns + where + values + ([self.detail] if self.detail else []))


# ---- 2. Reading turns back ---------------------------------------------------------------------
# The fields replay compares, per event kind (not timestamps, durations or usage).
_COMPARED = {"turn_started": (), "state": ("from", "to"), "llm_call_started": ("digest",),
             "action_parsed": ("type", "tools"), "parse_error": ("error",),
             "tool_call_started": ("call_id", "name", "arguments"),
             "tool_call_completed": ("call_id", "name", "content", "is_error"),
             "guard_tripped": ("reason", "detail"), "error": ("where",),
             "turn_completed": ("finish_reason", "guard_reason", "content")}


def _compared(e: dict[str, Any]) -> bool:
    """Compared events: a failing store.save is about the machine, not the run."""
    return e["kind"] in _COMPARED and e["data"].get("where") != "store.save"


def _turns(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The events grouped by turn (what a turn emits before turn_started, such as
    session_loaded, included); TraceError for a turn cut short."""
    turns: list[list[dict[str, Any]]] = []
    open_turns: dict[Any, list[dict[str, Any]]] = {}   # session -> its turn so far
    for e in events:
        turn = open_turns.setdefault(e.get("session_id"), [])
        if e["kind"] == "turn_started":
            if e["data"].get("format") != bob.TRACE_FORMAT or _start(turn):
                raise bob.TraceError(f"line {e['line']}: not a turn this bob replays (format "
                                     f"{e['data'].get('format')}, or the last turn never ended)")
            turns.append(turn)
        turn.append(e)
        if e["kind"] == "turn_completed":
            open_turns.pop(e.get("session_id"))
    for turn in open_turns.values():
        if _start(turn):
            raise bob.TraceError(f"the turn that starts at line {turn[0]['line']} has no "
                                 "turn_completed: the trace is cut short")
    return turns


def _start(turn: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The data of a turn's turn_started, if it has one yet."""
    return next((e["data"] for e in turn if e["kind"] == "turn_started"), None)


def _cancel_point(events: list[dict[str, Any]]) -> int | None:
    """The index (among compared events) of the event a recorded cancel came right after; None
    when the turn was not cancelled or a tool was interrupted (ReplayTools cancels then)."""
    texts = [e["data"]["content"] for e in events if e["kind"] == "tool_call_completed"]
    if (events[-1]["data"].get("finish_reason") != FinishReason.CANCELLED.value
            or any("before this call ended" in c for c in texts)):
        return None
    states = [i for i, e in enumerate(events) if e["kind"] == "state"]
    if any("before this call started" in c for c in texts):   # while the model answered
        return max(i for i in states if events[i]["data"]["to"] == State.CALL_TOOL.value)
    return states[-1] - 1   # the cancel was seen at the last transition, to done


# ---- 3. Replaying a turn ------------------------------------------------------------------------

class _Recorder:
    """The replay's event sink: keeps compared events as JSON has them; cancels at `cancel_at`."""

    def __init__(self, cancel: CancelToken, cancel_at: int | None):
        self.events: list[dict[str, Any]] = []
        self.cancel, self.cancel_at = cancel, cancel_at

    def emit(self, event: AgentEvent) -> None:
        e = json.loads(json.dumps(vars(event), default=str))
        if _compared(e):
            self.events.append(e)
            if len(self.events) - 1 == self.cancel_at:
                self.cancel.cancel()


def _shown(e: dict[str, Any] | None) -> dict[str, Any] | None:
    return e and {"kind": e["kind"], **{f: e["data"].get(f) for f in _COMPARED[e["kind"]]}}


def _first_difference(recorded: list[dict[str, Any]], new: list[dict[str, Any]]
                      ) -> tuple[int, str, Any, Any] | None:
    """(step, what, recorded, new) of the first compared event that differs, or None."""
    for a, b in itertools.zip_longest(recorded, new):
        if a is None or b is None or a["kind"] != b["kind"]:
            what = ("the new run did more" if a is None else "the new run ended before this"
                    if b is None else "a different event")
            return (a or b)["step"], what, _shown(a), _shown(b)
        for f in _COMPARED[a["kind"]]:
            if a["data"].get(f) != b["data"].get(f):
                return a["step"], f"{a['kind']} {f}", a["data"].get(f), b["data"].get(f)
    return None


class _FailedSave:
    """A store whose save fails, as the recorded one did (the session stays as it was)."""

    def __init__(self, store: SessionStore):
        self.load = store.load

    def save(self, session_id: str, state: SessionState) -> None:
        raise bob.StoreError("replay: the recorded save failed")


def _approver(events: list[dict[str, Any]]) -> Callable[[ToolCall], Approval]:
    """An approver that gives the decisions recorded in a turn, by call id."""
    decided = {d["call_id"]: Approval(d["allow"], d.get("reason", ""), d.get("arguments"))
               for d in (e["data"] for e in events if e["kind"] == "approval_decided")}
    return lambda call: decided.get(call.id, Approval(False, "replay: no recorded decision"))


def _replay_turn(events: list[dict[str, Any]], store: SessionStore, tools: ToolPort | None,
                 deny_tools: Sequence[str], overrides: dict[str, Any]
                 ) -> tuple[list[dict[str, Any]], ReplayLlm]:
    """Run one recorded turn again; returns the compared events it emitted and its ReplayLlm."""
    start, sid = _start(events) or {}, events[0]["session_id"]
    for e in events:
        if e["kind"] == "session_loaded":   # a version past the replayed one, so the save takes
            version = getattr(store.load(sid), "version", -1) + 1
            store.save(sid, SessionState([Message.from_dict(m) for m in e["data"]["messages"]],
                                         paused=e["data"].get("paused"), version=version))
    if any(e["kind"] == "error" and e["data"].get("where") == "store.save" for e in events):
        store = _FailedSave(store)   # the recorded save failed: the turn raised, so must this one
    caller, llm = CancelToken(), ReplayLlm(events)
    sink = _Recorder(caller, _cancel_point([e for e in events if _compared(e)]))
    settings = {"policy": TurnPolicy(**start["policy"]), "system_prompt": start["system_prompt"],
                "action_mode": start["action_mode"]}
    settings.update((k, v) for k, v in overrides.items() if v is not None)
    deny = (*deny_tools, *start.get("deny_tools", ()))   # what the recording denied stays denied
    runtime = AgentRuntime(llm, tools if tools is not None else ReplayTools(events, caller.cancel),
                           store=store, events=sink, deny_tools=deny, **settings,
                           ask_tools=start.get("ask_tools", ()),
                           approver=_approver(events) if start.get("approver") else None)
    given = {k: Approval(**a) for k, a in start.get("approvals", {}).items()}
    with contextlib.suppress(BobError):  # an error that ends the turn is an event
        runtime.run(AgentRequest(start["input"], sid, approvals=given or None), caller)
    return sink.events, llm


def _request_diff(events: list[dict[str, Any]], before: SessionState | None,
                  llm: ReplayLlm) -> str:
    """The first message of the last request `llm` got that differs from the recorded one
    (index, role, unified diff); the recorded request is rebuilt by replaying the turn as
    recorded, and its digest proves it is the one the trace holds."""
    store, k = InMemorySessionStore(), len(llm.requests) - 1
    if before is not None:
        store.save(events[0]["session_id"], before)
    ref = _replay_turn(events, store, None, (), {})[1].requests
    digests = [e["data"]["digest"] for e in events if e["kind"] == "llm_call_started"]
    if len(ref) <= k or k >= len(digests) or request_digest(ref[k]) != digests[k]:
        return "  (the recorded request cannot be rebuilt from the trace)"
    for i, (a, b) in enumerate(itertools.zip_longest(ref[k].messages, llm.requests[k].messages)):
        if a != b:
            texts = [(m.content if m else "").splitlines() for m in (a, b)]
            diff = difflib.unified_diff(*texts, "recorded", "new", lineterm="", n=1)
            return f"  message {i} ({(a or b).role}) differs:\n    " + "\n    ".join(diff)
    return "  the messages are the same: the tools or the response format differ"


def _check_turn(events: list[dict[str, Any]], store: SessionStore, tools: ToolPort | None,
                deny_tools: Sequence[str], overrides: dict[str, Any]) -> str | ReplayReport:
    """Replay one turn: "same (...)" or the report of its first divergence."""
    before = store.load(events[0]["session_id"])
    new, llm = _replay_turn(events, store, tools, deny_tools, overrides)
    found = _first_difference([e for e in events if _compared(e)], new)
    if found is None:
        end = events[-1]["data"]
        return (f"same ({end['steps']} LLM calls, {end['tool_calls']} tool calls, "
                f"{end['finish_reason'] or 'error'})")
    step, what, old, value = found
    if isinstance(value, str) and value.startswith("replay: "):   # what ReplayTools saw
        what = value.removeprefix("replay: ")
    detail = ""
    if what == "llm_call_started digest":
        what, detail = llm.divergence or what, _request_diff(events, before, llm)
    return ReplayReport(False, [], None, step, what, old, value, detail)


# ---- 4. replay() --------------------------------------------------------------------------------

def replay(trace: str | os.PathLike[str] | Sequence[dict[str, Any]], *,
           tools: ToolPort | None = None, policy: TurnPolicy | None = None,
           system_prompt: str | None = None, action_mode: str | None = None,
           deny_tools: Sequence[str] = ()) -> ReplayReport:
    """Re-run every recorded turn, answered from the trace (`tools`, if given, run for real,
    minus `deny_tools` and the recorded ones), until the first divergence; the overrides
    replace the recorded settings. TraceError for a trace that cannot be read or is cut short."""
    overrides = {"policy": policy, "system_prompt": system_prompt, "action_mode": action_mode}
    store, lines, turns = InMemorySessionStore(), [], _turns(read_trace(trace))
    if not turns:
        raise bob.TraceError(f"{trace if isinstance(trace, (str, os.PathLike)) else 'the trace'}"
                             " has no turn_started: it is not a bob trace, or it is empty")
    for n, events in enumerate(turns, 1):
        try:
            outcome = _check_turn(events, store, tools, deny_tools, overrides)
        except (TypeError, KeyError, ValueError, AttributeError, IndexError) as e:
            raise bob.TraceError(f"the turn that starts at line {events[0].get('line')} cannot "
                                 f"be replayed: {type(e).__name__}: {e}") from None
        if isinstance(outcome, ReplayReport):
            return dataclasses.replace(outcome, turns=[*lines, f"turn {n}: DIFFERENT"], turn=n)
        lines.append(f"turn {n}: {outcome}")
    return ReplayReport(True, lines)
