"""Round 7, the attack on what landed in bob.py today: JsonlEventSink writing into pipes itself
(os.write, poll, _SINK_WAIT_S), replay's listing that outlived its turn and decisions kept per
call id, the unfit-schema turn replayed offline, the adapter's learnt refusals (words next to the
name), and exceptions told from none by `is None`.

A strict xfail is a break found (its reason: what breaks, what the user sees, where in bob.py);
13 of the 14 found are fixed and plain tests now, beside the promises that held under the
attack. Real parts only: real pipes, FIFOs and
devices, real runtimes and sinks, the fake HTTP server, the CLI as a subprocess.
Sections: 1. The sink into a pipe  2. Replay of hostile traces  3. The adapter's refusals
4. Hostile ports
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import select
import signal
import threading
import time

import pytest
from fake_openai import FakeOpenAI, completion, stream_reply

import bob
from bob import (AgentEvent, AgentRequest, AgentRuntime, Approval, CancelToken,
                 FinishReason, FunctionTools, GuardReason, JsonlEventSink, LlmError, LlmRequest,
                 LlmResponse, Message, ReplayLlm, ScriptedLlm, ToolCall, ToolResult, TraceError,
                 TurnPolicy)
from conftest import final, make_llm, run_cli, tc, write_config

F_SETPIPE_SZ = 1031   # Linux: a pipe's buffer, here one page (4096 bytes)


# ---- 1. The sink into a pipe ---------------------------------------------------------------------

def small_pipe() -> tuple[int, int]:
    """A pipe whose buffer holds one page: (read end, non-blocking; write end)."""
    r, w = os.pipe()
    fcntl.fcntl(r, F_SETPIPE_SZ, 4096)
    os.set_blocking(r, False)
    return r, w


def drain(fd: int) -> bytes:
    """All the pipe holds now."""
    got = b""
    while True:
        try:
            piece = os.read(fd, 65536)
        except BlockingIOError:
            return got
        if not piece:
            return got
        got += piece


def note(text: str, step: int = 0) -> AgentEvent:
    return AgentEvent("note", "s", step, {"text": text}, 0.0)


def alarm_raises():
    """SIGALRM in 50 ms raises KeyboardInterrupt where the main thread is (Ctrl-C's effect)."""
    def handler(signum, frame):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    return old


@pytest.mark.parametrize("how", ["stalled reader", "ctrl-c"])
def test_the_event_after_a_cut_line_arrives_whole_on_its_own_line(monkeypatch, how):
    r, w = small_pipe()
    sink = JsonlEventSink(f"/dev/fd/{w}")
    try:
        if how == "stalled reader":
            monkeypatch.setattr(bob, "_SINK_WAIT_S", 0.05)
            with pytest.raises(OSError, match="its reader did not take the line"):
                sink.emit(note("a" * 20_000))
        else:
            old = alarm_raises()
            try:
                with pytest.raises(KeyboardInterrupt):
                    sink.emit(note("a" * 20_000))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)
        got = drain(r)                       # the reader takes the cut line's head
        sink.emit(note("after", step=1))     # then a small event
        got += drain(r)
    finally:
        sink.close()
        os.close(w)
        os.close(r)
    whole = []
    for line in got.splitlines():
        with contextlib.suppress(ValueError):   # the cut line is not JSON: lost, alone
            whole.append(json.loads(line))
    assert {"kind": "note", "session_id": "s", "step": 1, "ts": 0.0,
            "data": {"text": "after"}} in whole


def stalled_fifo(tmp_path):
    """A FIFO whose reader has filled nothing yet and will never read: (its path, reader fd)."""
    path = tmp_path / "trace.fifo"
    os.mkfifo(path)
    r = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    fcntl.fcntl(r, F_SETPIPE_SZ, 4096)
    return path, r


def test_a_stalled_reader_costs_a_turn_one_wait_not_one_per_event(monkeypatch, tmp_path):
    monkeypatch.setattr(bob, "_SINK_WAIT_S", 0.05)
    path, r = stalled_fifo(tmp_path)
    sink = JsonlEventSink(path)
    rt = AgentRuntime(ScriptedLlm([final("y" * 10_000)]), None, events=sink)
    try:
        t0 = time.monotonic()
        result = rt.run(AgentRequest("hi"))
        took = time.monotonic() - t0
    finally:
        sink.close()
        os.close(r)
    assert result.finish_reason is FinishReason.FINAL
    assert took < 4 * bob._SINK_WAIT_S, f"{took:.2f} s for one step"


def test_a_reader_taking_a_little_at_a_time_holds_an_event_at_most_the_wait(monkeypatch):
    monkeypatch.setattr(bob, "_SINK_WAIT_S", 0.05)
    r, w = small_pipe()
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.03):   # the reader's pace, not a wait for something
            drain_page(r)
    reader = threading.Thread(target=trickle)
    reader.start()
    sink = JsonlEventSink(f"/dev/fd/{w}")
    t0 = time.monotonic()
    try:
        with contextlib.suppress(OSError):   # fails once the wait is over; now: written whole
            sink.emit(note("a" * 60_000))
    finally:
        took = time.monotonic() - t0
        stop.set()
        reader.join(5)
        sink.close()
        os.close(w)
        os.close(r)
    assert took < 4 * bob._SINK_WAIT_S


def drain_page(fd):
    try:
        os.read(fd, 4096)
    except BlockingIOError:
        pass


def test_many_threads_emitting_into_a_slow_pipe_get_every_line_whole_and_in_order():
    """Eight threads, 20 lines of 10 KB each, a pipe of one page read as it comes: no line is
    cut or interleaved with another, none lost, each thread's in its order."""
    r, w = small_pipe()
    sink = JsonlEventSink(f"/dev/fd/{w}")
    got = []
    done = threading.Event()

    def reader():
        poller = select.poll()
        poller.register(r, select.POLLIN)
        while not (done.is_set() and not poller.poll(0)):
            poller.poll(50)
            got.append(drain(r))

    def writer(n):
        for i in range(20):
            sink.emit(AgentEvent("note", f"t{n}", i, {"text": str(n) * 10_000}, 0.0))
    t = threading.Thread(target=reader)
    t.start()
    writers = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for x in writers:
        x.start()
    for x in writers:
        x.join(20)
    done.set()
    t.join(20)
    sink.close()
    os.close(w)
    os.close(r)
    lines = [json.loads(line) for line in b"".join(got).splitlines()]
    assert len(lines) == 160
    for n in range(8):
        mine = [e for e in lines if e["session_id"] == f"t{n}"]
        assert [e["step"] for e in mine] == list(range(20))
        assert all(e["data"]["text"] == str(n) * 10_000 for e in mine)


def test_a_trace_on_dev_full_fails_each_event_and_the_turn_still_answers(caplog):
    sink = JsonlEventSink("/dev/full")
    rt = AgentRuntime(ScriptedLlm([final("ok")]), None, events=sink)
    with caplog.at_level(logging.WARNING, logger="bob"):
        result = rt.run(AgentRequest("hi"))
    sink.close()
    assert result.finish_reason is FinishReason.FINAL and result.content == "ok"
    failed = [rec for rec in caplog.records if "failed on" in rec.getMessage()]
    assert failed and "No space left" in str(failed[0].exc_info[1])


def test_close_from_another_thread_waits_for_the_writer_and_a_later_event_reopens(monkeypatch):
    """close() while a writer waits on a full pipe: the writer fails on its wait (not on a
    closed or reused descriptor), close() returns after it, and the next event reopens."""
    monkeypatch.setattr(bob, "_SINK_WAIT_S", 0.2)
    r, w = small_pipe()
    sink = JsonlEventSink(f"/dev/fd/{w}")
    errors = []

    def writer():
        try:
            sink.emit(note("a" * 20_000))
        except OSError as e:
            errors.append(e)
    t = threading.Thread(target=writer)
    t.start()
    poller = select.poll()
    poller.register(r, select.POLLIN)
    assert poller.poll(5000)   # the writer has begun: the pipe holds its first page
    sink.close()
    t.join(5)
    assert "its reader did not take the line" in str(errors[0])
    drain(r)
    sink.emit(note("again"))   # reopened
    sink.close()
    assert json.loads(drain(r))["data"] == {"text": "again"}
    os.close(w)
    os.close(r)


def test_a_pty_gets_each_line_whole(tmp_path):
    """A terminal as the trace (`--trace /dev/tty`): O_NONBLOCK on its own open, the lines
    whole (raw mode: no newline translation)."""
    import tty
    master, slave = os.openpty()
    tty.setraw(slave)
    sink = JsonlEventSink(os.ttyname(slave))
    got = b""
    try:
        for i in range(3):
            sink.emit(note("b" * 3000, step=i))
            poller = select.poll()
            poller.register(master, select.POLLIN)
            while got.count(b"\n") <= i and poller.poll(2000):
                got += os.read(master, 65536)
    finally:
        sink.close()
        os.close(slave)
        os.close(master)
    assert [json.loads(line)["step"] for line in got.splitlines()] == [0, 1, 2]


# ---- 2. Replay of hostile traces -----------------------------------------------------------------

class JsonSink:
    """Events as a trace file has them (JSON values), in a list."""

    def __init__(self):
        self.events = []

    def emit(self, e):
        self.events.append(json.loads(json.dumps(
            {"kind": e.kind, "session_id": e.session_id, "step": e.step, "ts": e.ts,
             "data": e.data}, default=str)))


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def timed_out_approval_trace() -> list[dict]:
    """A recorded turn whose approver never answered (turn_timeout_ms=100)."""
    sink = JsonSink()
    gate = threading.Event()
    rt = AgentRuntime(ScriptedLlm([tc("add", a=1, b=2), final("3")]), FunctionTools([add]),
                      events=sink, ask_tools=["add"],
                      approver=lambda c: gate.wait(5) and Approval(True),
                      policy=TurnPolicy(turn_timeout_ms=100))
    result = rt.run(AgentRequest("1+2?", "s1"))
    gate.set()
    assert result.guard_reason is GuardReason.TURN_TIMEOUT
    return sink.events


def paused_then_resumed_trace() -> list[dict]:
    """Two recorded turns without an approver: paused on an approval, then resumed."""
    sink = JsonSink()
    rt = AgentRuntime(ScriptedLlm([tc("add", a=1, b=2), final("3")]), FunctionTools([add]),
                      events=sink, ask_tools=["add"])
    paused = rt.run(AgentRequest("1+2?", "s1"))
    rt.run(AgentRequest(None, "s1", approvals={c.id: Approval(True) for c in paused.pending}))
    return sink.events


def trip_deleted(events):
    return [e for e in events if e["kind"] != "guard_tripped"]


def approver_said_present(events):
    """The paused turn's turn_started edited to say an approver was there (one field)."""
    return edit(events[:next(i for i, e in enumerate(events) if e["kind"] == "turn_completed")
                       + 1], "turn_started", approver=True)


@pytest.mark.parametrize("edited", [
    lambda: trip_deleted(timed_out_approval_trace()),
    lambda: approver_said_present(paused_then_resumed_trace())],
    ids=["trip deleted", "approver said present"])
def test_an_undecided_approval_without_its_trip_is_reported_at_once(edited):
    events = edited()
    for e in events:
        if e["kind"] == "turn_started":
            e["data"]["policy"]["turn_timeout_ms"] = 600
    t0 = time.monotonic()
    with contextlib.suppress(TraceError):
        bob.replay(events)
    assert time.monotonic() - t0 < 0.3


def test_a_timed_out_approval_as_recorded_replays_the_same_at_once():
    events = timed_out_approval_trace()
    for e in events:
        if e["kind"] == "turn_started":
            e["data"]["policy"]["turn_timeout_ms"] = 60_000   # the trace's: never waited for
    for e in events:   # the words as the edited deadline says them
        for k in ("detail", "content"):
            if isinstance(e["data"].get(k), str):
                e["data"][k] = e["data"][k].replace("=100", "=60000")
    t0 = time.monotonic()
    report = bob.replay(events)
    assert report.ok, str(report)
    assert time.monotonic() - t0 < 5


def test_a_model_error_ending_in_deny_it_replays_the_same(tmp_path):
    path = tmp_path / "t.jsonl"
    sink = JsonlEventSink(path)
    refused = LlmError("this key may not use that model: ask for access; deny it")
    rt = AgentRuntime(ScriptedLlm([refused]), None, events=sink)
    with pytest.raises(LlmError):
        rt.run(AgentRequest("hi", "s1"))
    sink.close()
    done = run_cli(tmp_path, "replay", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "turn 1: same" in done.stdout


def cancelled_while_the_model_answered() -> list[dict]:
    sink = JsonSink()
    caller = CancelToken()
    gate = threading.Event()

    def answer(req, cancel):
        caller.cancel()
        gate.wait(5)
        return "late"
    result = AgentRuntime(ScriptedLlm([answer]), None, events=sink).run(
        AgentRequest("hi", "s1"), caller)
    gate.set()
    assert result.finish_reason is FinishReason.CANCELLED
    return sink.events


def test_replay_llm_alone_answers_a_request_recorded_as_cancelled_at_once():
    events = cancelled_while_the_model_answered()
    assert bob.replay(events).ok   # replay() itself: at once
    rt = AgentRuntime(ReplayLlm(events), None, policy=TurnPolicy(turn_timeout_ms=600))
    t0 = time.monotonic()
    rt.run(AgentRequest("hi", "s1"))
    assert time.monotonic() - t0 < 0.3


def recorded(replies, tools=None, **kw) -> list[dict]:
    sink = JsonSink()
    rt = AgentRuntime(ScriptedLlm(replies), tools, events=sink, **kw)
    rt.run(AgentRequest("1+2?", "s1"))
    return sink.events


def edit(events, kind, **data):
    for e in events:
        if e["kind"] == kind:
            e["data"].update(data)
    return events


def insert_listing_trip(events):
    """A trip 'listing the tools' added to a turn whose listing answered."""
    at = next(i for i, e in enumerate(events) if e["kind"] == "state")
    trip = {**events[at], "kind": "guard_tripped", "data": {
        "reason": "turn_timeout", "detail": "listing the tools did not answer within "
        "turn_timeout_ms=60000"}}
    return [*events[:at], trip, *events[at:]]


HOSTILE = {
    "a listing trip added": lambda ev: insert_listing_trip(ev),
    "a trip's detail a number": lambda ev: edit(insert_listing_trip(ev), "guard_tripped",
                                                detail=5),
    "an error event without its text": lambda ev: [
        *ev[:-1], {**ev[-1], "kind": "error", "data": {"where": "turn"}}, ev[-1]],
    "a decision on a call never asked": lambda ev: [
        *ev[:-1], {**ev[-1], "kind": "approval_decided", "data": {
            "call_id": "call_9", "allow": True, "reason": "", "arguments": None}}, ev[-1]],
    "two decisions for one request": lambda ev: [
        *ev[:4], {**ev[4], "kind": "approval_requested", "data": {
            "call_id": "call_1", "name": "add", "arguments": {}}},
        {**ev[4], "kind": "approval_decided", "data": {
            "call_id": "call_1", "allow": False, "reason": "x", "arguments": None}},
        {**ev[4], "kind": "approval_decided", "data": {
            "call_id": "call_1", "allow": True, "reason": "", "arguments": {"a": "x"}}},
        *ev[4:]],
}


@pytest.mark.parametrize("attack", HOSTILE.values(), ids=list(HOSTILE))
def test_a_hostile_edit_ends_in_a_trace_error_or_a_report_at_once(attack):
    events = recorded([tc("add", a=1, b=2), final("3")], FunctionTools([add]))
    edit(events, "turn_started", policy={**events[1]["data"]["policy"],
                                         "turn_timeout_ms": 60_000})
    t0 = time.monotonic()
    try:
        report = bob.replay(attack(events))
        assert isinstance(report, bob.ReplayReport)
    except TraceError:
        pass
    assert time.monotonic() - t0 < 5   # never the recorded minute


def test_a_session_id_that_is_a_list_is_a_trace_error_naming_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    events = recorded([final("3")])
    events[0]["session_id"] = ["s1"]
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    done = run_cli(tmp_path, "replay", str(path))
    assert done.returncode == 2 and "line 1" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_two_sessions_interleaved_in_one_trace_replay_each_from_its_own_state():
    sink = JsonSink()
    rts = {s: AgentRuntime(ScriptedLlm([tc("add", a=i, b=1), final(f"{s}{i}")]),
                           FunctionTools([add]), events=sink, store=bob.InMemorySessionStore())
           for i, s in enumerate("ab")}
    rts["a"].run(AgentRequest("first", "a"))
    rts["b"].run(AgentRequest("first", "b"))
    rts["a"].llm.replies += [final("a again")]
    rts["a"].run(AgentRequest("second", "a"))
    report = bob.replay(sink.events)
    assert report.ok, str(report)
    assert len(report.turns) == 3


# ---- 3. The adapter's refusals -------------------------------------------------------------------

THOUGHT = "The user wants 2+3; use add."
ASKED = "what does reasoning_content mean? and 2+3?"
HISTORY = [Message("user", ASKED),
           Message("assistant", "", (ToolCall("call_1", "add", {"a": 2, "b": 3}),),
                   reasoning=THOUGHT),
           Message("tool", "5", tool_call_id="call_1", name="add"),
           Message("user", "and 4+4?")]


def deepseek(body, headers=None):
    """DeepSeek in thinking mode: an assistant message with tool calls must carry its
    reasoning_content back."""
    for m in body["messages"]:
        if m["role"] == "assistant" and m.get("tool_calls") and "reasoning_content" not in m:
            return {"status": 400, "body": {"error": {"message": (
                "Missing `reasoning_content` field in the assistant message at message "
                "index 2.")}}}
    return completion("ok")


def test_an_error_quoting_the_users_text_naming_reasoning_content_is_no_refusal():
    flagged = {"status": 400, "body": {"error": {"message": (
        f"Your request was rejected by the safety system: the prompt '{ASKED}' may contain "
        "unsafe content")}}}
    with FakeOpenAI([flagged, deepseek, deepseek]) as srv:
        llm = make_llm(srv, retry_max=0)
        with pytest.raises(LlmError, match="safety system"):
            llm.complete(LlmRequest(HISTORY, [], None, None), CancelToken())
        assert llm.complete(LlmRequest(HISTORY, [], None, None), CancelToken()).content == "ok"


def test_a_streamed_request_learns_a_pydantic_refusal_beside_a_missing_field_error():
    """Mistral-like 422 with two errors: an extra reasoning_content and a missing field
    elsewhere ('Field required' not next to the name): learnt, retried free, streamed."""
    refusal = {"status": 422, "body": {"object": "error", "message": {"detail": [
        {"type": "missing", "loc": ["body", "messages", 3, "name"], "msg": "Field required",
         "input": {"role": "user"}},
        {"type": "extra_forbidden", "loc": ["body", "messages", 2, "assistant",
                                            "reasoning_content"],
         "msg": "Extra inputs are not permitted", "input": "required"}]}}}
    with FakeOpenAI([refusal, stream_reply(["fi", "ne"])]) as srv:
        llm = make_llm(srv, retry_max=0)
        got = llm.complete(LlmRequest(HISTORY, [], None, None), CancelToken(), lambda t: None)
        sent = ["reasoning_content" in r["body"]["messages"][1] for r in srv.requests]
    assert got.content == "fine"
    assert sent == [True, False]


def test_deepseeks_ask_across_a_line_break_still_asks_for_the_field():
    wants = "The `reasoning_content` in the thinking mode\nmust be passed back to the API."
    with FakeOpenAI([{"status": 400, "body": {"error": {"message": wants}}}, "ok"]) as srv:
        llm = make_llm(srv, retry_max=0)
        with pytest.raises(LlmError, match="HTTP 400"):
            llm.complete(LlmRequest(HISTORY, [], None, None), CancelToken())
        llm.complete(LlmRequest(HISTORY, [], None, None), CancelToken())
        sent = ["reasoning_content" in r["body"]["messages"][1] for r in srv.requests]
    assert sent == [True, True]


# ---- 4. Hostile ports ----------------------------------------------------------------------------

class FalsyLlmError(LlmError):
    def __bool__(self):
        return False


def test_a_falsy_error_once_the_time_is_up_is_the_turns_timeout():
    class GivesUp:
        _answers_inline = True   # its own class says so (README: answers on the loop's thread)

        def complete(self, req, cancel, on_delta=None):
            cancel.cancel()   # the turn's own token: its time is up (_Turn.woken)
            raise FalsyLlmError("gave up: out of time")
    result = AgentRuntime(GivesUp(), None).run(AgentRequest("hi"))
    assert result.guard_reason is GuardReason.TURN_TIMEOUT


def test_falsy_values_from_ports_are_taken_as_they_are():
    """A ToolResult, an Approval and an LlmResponse that test false (their classes define
    __len__ 0) are results, decisions and replies like any other: nothing is tested by truth."""
    class Empty:
        def __len__(self):
            return 0

    class FalsyResult(Empty, ToolResult):
        pass

    class FalsyApproval(Empty, Approval):
        pass

    class FalsyReply(Empty, LlmResponse):
        pass

    class Tools:
        def list_tools(self):
            return FunctionTools([add]).list_tools()

        def call_tool(self, call, timeout_s, cancel=None):
            return FalsyResult(call.id, call.name, "3")
    replies = [FalsyReply(tc("add", a=1, b=2)), FalsyReply(final("three"))]
    rt = AgentRuntime(ScriptedLlm(replies), Tools(), ask_tools=["add"],
                      approver=lambda call: FalsyApproval(True))
    result = rt.run(AgentRequest("1+2?"))
    assert result.finish_reason is FinishReason.FINAL and result.content == "three"
    assert [m.content for m in result.history if m.role == "tool"] == ["3"]
    assert result.usage == bob.Usage() and bob.Usage() == bob.Usage(0, 0)


def test_a_resumed_turn_whose_model_reuses_the_given_ids_replays_the_approvers_decisions():
    """Paused without an approver; resumed by a runtime with one, the given decision allowing
    call_1; the model reuses call_1 in the next batch and the approver declines it. The given
    decision (asked in no request) is not replayed as the approver's answer."""
    sink = JsonSink()
    store = bob.InMemorySessionStore()
    again = LlmResponse("", (ToolCall("call_1", "add", {"a": 5, "b": 5}),))
    llm = ScriptedLlm([LlmResponse("", (ToolCall("call_1", "add", {"a": 1, "b": 2}),)),
                       again, LlmResponse("done")])
    paused = AgentRuntime(llm, FunctionTools([add]), events=sink, store=store,
                          ask_tools=["add"], action_mode="native").run(AgentRequest("1+2?", "s1"))
    asked = []
    rt = AgentRuntime(llm, FunctionTools([add]), events=sink, store=store, ask_tools=["add"],
                      action_mode="native",
                      approver=lambda call: asked.append(call) or Approval(False, "not twice"))
    result = rt.run(AgentRequest(None, "s1", approvals={
        c.id: Approval(True) for c in paused.pending}))
    assert result.content == "done" and len(asked) == 1
    tools = [m.content for m in result.history if m.role == "tool"]
    assert tools[0] == "3" and "not twice" in tools[1]
    report = bob.replay(sink.events)
    assert report.ok, str(report)
    assert len(report.turns) == 2


def test_the_cli_traced_into_its_own_stdout_pipe_writes_each_line_whole(tmp_path, srv):
    """`bob -p ... --trace /dev/stdout | ...`: the sink opens the pipe anew (its own
    non-blocking description, the CLI's stdout stays blocking); a 200 KB answer, over the
    pipe's 64 KB, comes whole in its trace line and then as the answer."""
    answer = "z" * 200_000
    srv.push(final(answer))
    write_config(tmp_path, srv)
    r = run_cli(tmp_path, "-p", "hi", "--trace", "/dev/stdout")
    assert r.returncode == 0, r.stderr
    *trace, printed = r.stdout.splitlines()
    assert printed == answer
    events = [json.loads(line) for line in trace]
    assert events[-1]["kind"] == "turn_completed"
    assert any(answer in e["data"]["content"] for e in events
               if e["kind"] == "llm_call_completed")


class SchemaGoesBad:
    """A tool port whose second listing has a schema that is not JSON (NaN): a server changed
    between two turns."""

    def __init__(self):
        self.listed = 0
        self.tools = FunctionTools([add])

    def list_tools(self):
        self.listed += 1
        if self.listed == 2:
            return [bob.ToolDescriptor("add", "Add.", {"type": "object", "default": float("nan")})]
        return self.tools.list_tools()

    def call_tool(self, call, timeout_s, cancel=None):
        return self.tools.call_tool(call, timeout_s, cancel)


def test_replay_tools_alone_lists_the_first_turns_tools_when_a_later_turn_failed_unfit():
    sink = JsonSink()
    rt = AgentRuntime(ScriptedLlm([tc("add", a=1, b=2), final("3")]), SchemaGoesBad(),
                      events=sink)
    assert rt.run(AgentRequest("1+2?", "s1")).content == "3"
    with pytest.raises(bob.AgentError, match="deny it"):
        rt.run(AgentRequest("again", "s1"))
    assert bob.replay(sink.events).ok   # replay() reads each turn alone: both the same
    again = AgentRuntime(ReplayLlm(sink.events), bob.ReplayTools(sink.events))
    assert again.run(AgentRequest("1+2?", "s1")).content == "3"


def test_a_huge_hostile_error_body_does_not_hold_the_turn_past_its_deadline():
    body = ("reasoning_content" + " " * 1007) * 2048   # 2 MB
    with FakeOpenAI([{"status": 400, "body": body}, "8"]) as srv:
        rt = AgentRuntime(make_llm(srv, retry_max=0), FunctionTools([add]), action_mode="native",
                          policy=TurnPolicy(turn_timeout_ms=500))
        t0 = time.monotonic()
        result = rt.run(AgentRequest("and 4+4?", history=HISTORY[:3]))
        took = time.monotonic() - t0
    # a refusal (no word asks for the field): learnt, and the request sent again without it;
    # before, the regex alone outlived the turn's 0.5 s (TURN_TIMEOUT at 1.7 s)
    assert result.content == "8"
    assert took < 0.5 + 0.4, f"{took:.2f} s"


def test_signals_while_a_long_line_waits_for_its_reader_neither_cut_nor_repeat_it():
    """A signal whose handler returns (the CLI's Ctrl-C handler cancels, it raises nothing)
    every 2 ms while a 300 KB line goes through a one-page pipe: poll and write are interrupted
    (EINTR) and resumed; the line arrives once, whole, and the next one after it."""
    r, w = os.pipe()
    fcntl.fcntl(r, F_SETPIPE_SZ, 4096)
    got = []
    hits = []
    first = threading.Event()

    def reader():
        first.wait(5)   # the pipe full, the writer waiting, when the first signal comes
        with os.fdopen(r, "rb") as f:
            while piece := f.read1(1024):
                got.append(piece)
    t = threading.Thread(target=reader)
    t.start()
    old = signal.signal(signal.SIGALRM, lambda *a: hits.append(1) or first.set())
    signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
    sink = JsonlEventSink(f"/dev/fd/{w}")
    try:
        sink.emit(note("c" * 300_000))
        sink.emit(note("next", step=1))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        sink.close()
        os.close(w)
        t.join(10)
    lines = [json.loads(line) for line in b"".join(got).splitlines()]
    assert [e["data"]["text"] for e in lines] == ["c" * 300_000, "next"]
    assert hits   # the signals came while it wrote
