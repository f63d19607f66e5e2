"""Tests of actions, sessions and sinks under hostile input: sloppy and huge JSON from the model,
big sessions and cancel, concurrent turns on one session (threads and real processes), corrupt
session files, saves killed with SIGKILL, events a sink cannot encode as they are.

Real threads, real processes and real files; no mocks, no sleeps to synchronise.

Sections: 1. Helpers  2. Sloppy and huge JSON  3. Corrupt session files  4. Event sinks
          5. Concurrent turns  6. Killed saves  7. Big sessions and cancel
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import bob
from bob import (ActionParseError, AgentRequest, AgentRuntime, Final, FinishReason, FunctionTools,
                 JsonFileSessionStore, JsonlEventSink, LlmResponse, LoggingEventSink, ScriptedLlm,
                 StoreError, ToolCall, parse_action)
from conftest import ListSink, assert_well_formed, final


# ---- 1. Helpers ---------------------------------------------------------------------------------

def nested(depth: int, leaf=1):
    """`leaf` inside `depth` lists (built without recursion)."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def deep_text(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


HUGE_INT = "9" * 5000   # past Python's int-string limit (4,300 digits)


def echo(x: object = None) -> str:
    """Say what you got."""
    return "got it"


def run_logged(tmp_path, replies, mode="json", tools=(echo,)):
    """A turn on session "s" with a file store, a JSONL sink, a logging sink (into a strict
    UTF-8 file) and a list sink: the result, the list sink, and the events the JSONL sink wrote
    (the log must hold one line per event too)."""
    sink, jsonl = ListSink(), JsonlEventSink(tmp_path / "events.jsonl")
    logger = logging.getLogger(f"test.events.{tmp_path.name}")
    logger.propagate, logger.level = False, logging.INFO
    with open(tmp_path / "log.txt", "w", encoding="utf-8") as log:
        logger.addHandler(logging.StreamHandler(log))
        rt = AgentRuntime(ScriptedLlm(replies), FunctionTools(list(tools)), action_mode=mode,
                          store=JsonFileSessionStore(tmp_path), events=[
                              sink, jsonl, LoggingEventSink(logger)])
        result = rt.run(AgentRequest("go", session_id="s"))
        jsonl.close()
    lines = (tmp_path / "events.jsonl").read_text(encoding="ascii").splitlines()
    assert len((tmp_path / "log.txt").read_text("utf-8").splitlines()) == len(sink.events)
    return result, sink, [json.loads(line) for line in lines]


# ---- 2. Sloppy and huge JSON --------------------------------------------------------------------

def test_raw_newlines_and_tabs_inside_json_strings_are_accepted():
    action = parse_action('{"type": "final", "content": "line one\nline two\tand a tab"}')
    assert action == Final("line one\nline two\tand a tab")


@pytest.mark.parametrize("reply", ['{"type": "final", "content": "never closed',
                                   '{"type": "final", "content": "bad \\q escape"}',
                                   '{"type": "final", "content": "\\ud83d\\u12"}',
                                   '{"type": "final"', '{"type": "final", }', "nope", "{} {}",
                                   '["final"]', '{"type": 1}', '{"type": "tool_call"}',
                                   '{"type": "final", "content": ' + HUGE_INT + '}'])
def test_every_parse_error_reads_once(reply):
    with pytest.raises(ActionParseError) as err:
        parse_action(reply)
    message = str(err.value)
    assert not re.search(r"\b(\w+) \1\b", message), message     # e.g. "starting at at line"
    assert "Traceback" not in message and "set_int_max_str_digits" not in message


@pytest.mark.parametrize("reply", [
    '{"type": "tool_call", "name": "echo", "arguments": {"x": ' + deep_text(1000) + '}}',
    '{"type": "tool_call", "name": "echo", "arguments": {"x": ' + HUGE_INT + '}}',
    '{"type": "final", "content": "ok", "extra": ' + deep_text(1000) + '}',
    '{"type": "final", "content": ' + HUGE_INT + '}',
], ids=["deep arguments", "huge integer", "deep final", "huge final"])
def test_deep_or_huge_json_actions_are_a_malformed_reply(tmp_path, reply):
    r, sink, written = run_logged(tmp_path, [reply, final("fine")])
    assert (r.finish_reason, r.content) == (FinishReason.FINAL, "fine")
    [error] = sink.of("parse_error")
    assert error["attempt"] == 1 and "Traceback" not in error["error"]
    assert JsonFileSessionStore(tmp_path).load("s").messages == r.history
    assert [e["kind"] for e in written] == [e.kind for e in sink.events]


def test_a_deep_json_text_as_a_final_answer_is_just_text(tmp_path):
    r, sink, written = run_logged(tmp_path, [json.dumps({"type": "final",
                                                         "content": deep_text(5000)})])
    assert r.content == deep_text(5000)
    assert JsonFileSessionStore(tmp_path).load("s").messages[-1].content == deep_text(5000)
    assert len(written) == len(sink.events)


@pytest.mark.parametrize("arguments", [{"x": nested(1000)}, {"x": 10 ** 5000},
                                       {"x": nested(50, {"y": nested(950)})}],
                         ids=["deep", "huge integer", "deep dicts"])
def test_native_deep_or_huge_arguments_are_refused_not_an_internal_error(tmp_path, arguments):
    reply = LlmResponse("", (ToolCall("c1", "echo", arguments),))
    r, sink, written = run_logged(tmp_path, [reply, "done"], mode="native")
    assert (r.finish_reason, r.content) == (FinishReason.FINAL, "done")
    result = r.history[2]
    assert result.is_error and re.search("nests deeper than 100|integer over", result.content)
    assert_well_formed(r.history)
    assert JsonFileSessionStore(tmp_path).load("s").messages == r.history
    assert [e["kind"] for e in written] == [e.kind for e in sink.events]


def deep_result() -> list:
    """A tool result nested 1,000 levels deep."""
    return nested(1000)


def huge_result() -> int:
    """A tool result with 5,000 digits."""
    return 10 ** 5000


def deep_dict() -> dict:
    """A result nested 900 levels deep (json can encode it)."""
    return {"a": nested(900)}


@pytest.mark.parametrize("tool", [deep_result, huge_result, deep_dict])
def test_deep_or_huge_tool_results_are_text_or_the_tools_error(tmp_path, tool):
    call = json.dumps({"type": "tool_call", "name": tool.__name__, "arguments": {}})
    r, sink, written = run_logged(tmp_path, [call, final("seen")], tools=[tool])
    assert (r.finish_reason, r.content) == (FinishReason.FINAL, "seen")
    assert JsonFileSessionStore(tmp_path).load("s").messages == r.history
    assert [e["kind"] for e in written] == [e.kind for e in sink.events]
    assert sys.getrecursionlimit() == 1000


# ---- 3. Corrupt session files -------------------------------------------------------------------

MESSAGE = {"role": "user", "content": "hi"}
CALL = {"id": "c1", "name": "echo", "arguments": {}}
GOOD = {"version": 1, "usage": {"prompt_tokens": 1, "completion_tokens": 2}, "paused": None,
        "messages": [MESSAGE]}
CORRUPT = {
    "array": "[]", "string": '"hi"', "null": "null", "number": "7", "truncated": '{"messages": [',
    "messages as an object": {"messages": {}}, "no messages": '{"version": 1}',
    "usage as a string": {"usage": "n/a"}, "usage counts as strings": {"usage": {
        "prompt_tokens": "5"}},
    "version as a string": {"version": "3"}, "version as a bool": {"version": True},
    "message as a string": {"messages": ["hi"]}, "role a number": {"messages": [{
        "role": 5, "content": "x"}]}, "unknown role": {"messages": [{"role": "wizard",
                                                                     "content": "x"}]},
    "content a number": {"messages": [{"role": "user", "content": 5}]},
    "no content": {"messages": [{"role": "user"}]},
    "tool_calls a string": {"messages": [{**MESSAGE, "tool_calls": "echo"}]},
    "tool call a number": {"messages": [{**MESSAGE, "tool_calls": [1]}]},
    "tool call id a number": {"messages": [{**MESSAGE, "tool_calls": [{**CALL, "id": 1}]}]},
    "arguments a list": {"messages": [{**MESSAGE, "tool_calls": [{**CALL, "arguments": []}]}]},
    "no arguments": {"messages": [{**MESSAGE, "tool_calls": [{"id": "c", "name": "echo"}]}]},
    "tool_call_id a number": {"messages": [{**MESSAGE, "tool_call_id": 5}]},
    "is_error a string": {"messages": [{**MESSAGE, "is_error": "yes"}]},
    "paused a number": {"paused": 5}, "paused empty": {"paused": {}},
    "paused guard clobbers the policy": {"paused": {"guard": {"policy": 1}, "input_index": 0,
                                                    "approvals": {}}},
    "paused index out of range": {"paused": {"guard": {}, "input_index": 9, "approvals": {}}},
    "paused approval a string": {"paused": {"guard": {}, "input_index": 0,
                                            "approvals": {"c1": "yes"}}},
    "2,000-level nesting": '{"messages": [' + deep_text(2000) + "]}",
    "2,000-level arguments": '{"messages": [{"role": "assistant", "content": "", "tool_calls": '
                             '[{"id": "c", "name": "echo", "arguments": {"x": '
                             + deep_text(2000) + "}}]}]}",
}


@pytest.mark.parametrize("junk", CORRUPT.values(), ids=CORRUPT.keys())
def test_every_corrupt_session_file_is_a_store_error_and_is_never_overwritten(tmp_path, junk):
    path = tmp_path / "s.json"
    path.write_text(junk if isinstance(junk, str) else json.dumps({**GOOD, **junk}))
    before = path.read_bytes()
    with pytest.raises(StoreError) as err:
        JsonFileSessionStore(tmp_path).load("s")
    assert str(path) in str(err.value) and "move it away" in str(err.value)
    assert not re.search("(Type|Key|Attribute|Index|Recursion)Error", str(err.value)), err.value
    llm = ScriptedLlm([final("never")] * 2)
    rt = AgentRuntime(llm, store=JsonFileSessionStore(tmp_path))
    for request in (AgentRequest("hello", session_id="s"), AgentRequest(None, session_id="s",
                                                                        approvals={})):
        with pytest.raises(StoreError, match="s.json is corrupt"):
            rt.run(request)
    assert path.read_bytes() == before and llm.requests == []
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]


def test_a_good_session_file_loads():
    assert bob.SessionState.from_dict(GOOD) == bob.SessionState([bob.Message("user", "hi")],
                                                                 bob.Usage(1, 2), 1)



LAYOUTS = {"indented (an older bob)": json.dumps({"version": 3, "messages": [MESSAGE]}, indent=1),
           "messages first (by hand)": json.dumps({"messages": [MESSAGE], "version": 3})}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_session_file_in_another_layout_takes_the_next_turn(tmp_path, layout):
    (tmp_path / "s.json").write_text(LAYOUTS[layout])
    stale = bob.SessionState([bob.Message("user", "stale")], version=3)  # not newer: refused
    with pytest.raises(StoreError, match="changed by another turn"):
        JsonFileSessionStore(tmp_path).save("s", stale)
    rt = AgentRuntime(ScriptedLlm([final("next")]), store=JsonFileSessionStore(tmp_path))
    rt.run(AgentRequest("again", session_id="s"))
    stored = JsonFileSessionStore(tmp_path).load("s")
    assert stored.version == 4 and [m.content for m in stored.messages] == ["hi", "again", "next"]

# ---- 4. Event sinks -----------------------------------------------------------------------------

def cyclic() -> dict:
    d: dict = {}
    d["self"] = d
    return d


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


@pytest.mark.parametrize("data", [{"text": "cut \ud83d"}, {"deep": nested(5000)},
                                  {"deep": {"dicts": nested(900, {"x": nested(900)})}},
                                  {"n": 10 ** 5000}, cyclic(), {"odd": Unprintable()}],
                         ids=["surrogate", "deep", "deep dicts", "huge integer", "cycle",
                              "unprintable"])
def test_sinks_write_every_event_and_print_no_traceback(tmp_path, capsys, data):
    logger = logging.getLogger(f"test.sinks.{tmp_path.name}")
    logger.propagate, logger.level = False, logging.INFO
    with open(tmp_path / "log.txt", "w", encoding="utf-8") as stream:   # strict UTF-8
        logger.addHandler(logging.StreamHandler(stream))
        jsonl, logged = JsonlEventSink(tmp_path / "e.jsonl"), LoggingEventSink(logger)
        for step in range(2):
            event = bob.AgentEvent("tool_call_completed", "s", step, data, 1.5)
            jsonl.emit(event)
            logged.emit(event)
        jsonl.close()
    written = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text("ascii").splitlines()]
    assert [(e["kind"], e["session_id"], e["step"], e["ts"]) for e in written] == [
        ("tool_call_completed", "s", 0, 1.5), ("tool_call_completed", "s", 1, 1.5)]
    if "text" in data:
        assert written[0]["data"] == data
    log_lines = (tmp_path / "log.txt").read_text("utf-8").splitlines()
    assert [line.split()[:3] for line in log_lines] == [
        ["tool_call_completed", "session=s", "step=0"], ["tool_call_completed", "session=s",
                                                         "step=1"]]
    assert "Traceback" not in capsys.readouterr().err


# ---- 5. Concurrent turns ------------------------------------------------------------------------

def take_turns(rt: AgentRuntime, worker: int, turns: int, outcomes: list) -> None:
    """Run `turns` turns on session "shared"; note each input that returned, or the error."""
    for i in range(turns):
        text = f"w{worker} turn {i}"
        try:
            rt.run(AgentRequest(text, session_id="shared"))
            outcomes.append(("ok", text))
        except StoreError as e:
            outcomes.append(("failed", str(e)))


def check_outcomes(outcomes: list, history: list[bob.Message], expected: int) -> None:
    """Every turn that returned is in the history, once; every other one says why it failed."""
    assert len(outcomes) == expected
    returned = sorted(text for kind, text in outcomes if kind == "ok")
    failures = [text for kind, text in outcomes if kind == "failed"]
    assert sorted(m.content for m in history if m.role == "user") == returned
    for message in failures:
        assert "session 'shared' was changed by another turn" in message, message
        assert "run the turn again" in message
    assert_well_formed(history)
    assert len(returned) >= 1


def stores(tmp_path):
    memory = bob.InMemorySessionStore()
    return {"memory": lambda: memory, "file": lambda: JsonFileSessionStore(tmp_path)}


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_concurrent_turns_on_one_session_lose_no_turn(tmp_path, kind):
    make = stores(tmp_path)[kind]
    outcomes: list = []
    threads = [threading.Thread(target=take_turns, args=(
        AgentRuntime(ScriptedLlm([final("ok")] * 40), store=make()), k, 40, outcomes))
        for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    check_outcomes(outcomes, make().load("shared").messages, 160)


WORKER = """
import json, sys
sys.path.insert(0, {root!r})
import bob
from test_hostile_stores import take_turns
outcomes = []
rt = bob.AgentRuntime(bob.ScriptedLlm([json.dumps({{"type": "final", "content": "ok"}})] * 40),
                      store=bob.JsonFileSessionStore(sys.argv[1]))
sys.stdin.readline()       # all workers start together
take_turns(rt, int(sys.argv[2]), 40, outcomes)
print(json.dumps(outcomes))
"""


def test_concurrent_turns_from_processes_lose_no_turn(tmp_path):
    script = tmp_path / "worker.py"
    tests_dir = str(Path(__file__).resolve().parent)
    script.write_text(WORKER.format(root=str(Path(tests_dir).parent)))
    workers = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "s"), str(k)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                cwd=tests_dir, env={**os.environ, "PYTHONPATH": tests_dir})
               for k in range(2)]
    outcomes: list = []
    for w in workers:
        w.stdin.write("go\n")
        w.stdin.flush()
    for w in workers:
        out, _ = w.communicate(timeout=120)
        assert w.returncode == 0
        outcomes += [tuple(o) for o in json.loads(out)]
    check_outcomes(outcomes, JsonFileSessionStore(tmp_path / "s").load("shared").messages, 80)
    assert sorted(p.name for p in (tmp_path / "s").iterdir() if p.suffix != ".lock") == [
        "shared.json"]


# ---- 6. Killed saves ----------------------------------------------------------------------------

def save_forever(directory: str, started) -> None:
    """A child process: save a 300 KB session again and again until it is killed (a save takes
    about 10 ms: the random moments below, up to 30 ms, fall anywhere in one)."""
    store = JsonFileSessionStore(directory)
    state = bob.SessionState([bob.Message("user", "x" * 1000)] * 300)
    while True:
        state.version = (store.load("s") or state).version + 1
        store.save("s", state)
        started.set()


def test_saves_killed_at_random_moments_leave_at_most_one_temp_file(tmp_path):
    ctx = multiprocessing.get_context("fork")        # starts in milliseconds
    rng = random.Random(15)
    for _ in range(60):
        started = ctx.Event()
        child = ctx.Process(target=save_forever, args=(str(tmp_path), started), daemon=True)
        child.start()
        assert started.wait(30), "the child never saved"
        time.sleep(rng.uniform(0, 0.03))              # a random moment, not a synchronisation
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    assert len(list(tmp_path.glob(".s.*tmp"))) <= 1, sorted(os.listdir(tmp_path))
    store = JsonFileSessionStore(tmp_path)
    state = store.load("s")
    state.version += 1
    store.save("s", state)                            # the next save cleans up
    assert sorted(os.listdir(tmp_path)) == ["s.json"]


# ---- 7. Big sessions and cancel -----------------------------------------------------------------

@pytest.fixture(scope="module")
def histories() -> dict:
    """big_session's messages by (size, n), built once for both stores (Message is frozen;
    100,000 of them take 0.4 s to build), dropped with the module."""
    return {}


def big_session(size: int, n: int, histories: dict) -> bob.SessionState:
    """About `size` bytes of history in `n` messages: questions, tool calls and results."""
    if (size, n) not in histories:
        text = "y" * (size // n)
        messages: list[bob.Message] = []
        for i in range(0, n, 4):
            call = ToolCall(f"c{i}", "echo", {"x": i})
            messages += [bob.Message("user", text), bob.Message("assistant", "", (call,)),
                         bob.Message("tool", text, tool_call_id=call.id, name="echo"),
                         bob.Message("assistant", text)]
        histories[size, n] = tuple(messages)
    return bob.SessionState(list(histories[size, n]), bob.Usage(1, 1), 1)


@pytest.mark.parametrize("n", [2_000, 20_000, 100_000])
@pytest.mark.parametrize("kind", ["memory", "file"])
def test_cancel_returns_soon_with_a_20_mb_session(tmp_path, hang, histories, kind, n):
    store = stores(tmp_path)[kind]()
    store.save("big", big_session(20_000_000, n, histories))
    release, asked = hang(), threading.Event()

    def hanging(req, cancel):
        asked.set()
        release.wait(60)
        return final("too late")

    cancel, returned = bob.CancelToken(), []
    rt = AgentRuntime(ScriptedLlm([hanging]), FunctionTools([echo]), store=store)
    turn = threading.Thread(target=lambda: returned.append((rt.run(AgentRequest(
        "one more", session_id="big"), cancel), time.thread_time())))
    turn.start()
    assert asked.wait(60)
    clock = time.pthread_getcpuclockid(turn.ident)   # the turn thread's CPU time
    gc.collect()   # what earlier tests left is not this turn's work: collections during the
    gc.freeze()    # save must not scan it (the suite's leftovers took it past 300 ms)
    wall, cpu = time.perf_counter(), time.clock_gettime(clock)
    try:
        cancel.cancel()
        turn.join(60)
    finally:
        gc.unfreeze()
    wall = (time.perf_counter() - wall) * 1000
    [(result, cpu_after)] = returned
    cpu = (cpu_after - cpu) * 1000   # CPU: what bob does, not what other processes take
    assert result.finish_reason is FinishReason.CANCELLED
    assert cpu < 300, f"run() took {cpu:.0f} ms of CPU after cancel() ({wall:.0f} ms wall)"
    assert wall < 1000, f"run() returned {wall:.0f} ms after cancel() ({cpu:.0f} ms of CPU)"
    assert len(store.load("big").messages) == n + 1


# ---- 8. A hostile neighbour in the session directory --------------------------------------------

def run_in_thread(rt: AgentRuntime, session_id: str) -> tuple[threading.Thread, list]:
    """run() on a daemon thread (a hang must not hang the suite); the outcome lands in the list."""
    outcome: list = []

    def work() -> None:
        try:
            outcome.append(rt.run(AgentRequest("hi", session_id)))
        except Exception as e:
            outcome.append(e)
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread, outcome


def test_a_fifo_in_place_of_a_session_file_is_a_store_error_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / "x.json")   # nobody will ever write to it: opening it to read blocks
    thread, outcome = run_in_thread(
        AgentRuntime(ScriptedLlm([final("ok")]), store=JsonFileSessionStore(tmp_path)), "x")
    thread.join(10)
    assert outcome, "run() hung on the FIFO"
    assert isinstance(outcome[0], StoreError), outcome
    assert "x.json" in str(outcome[0]) and "not a regular file" in str(outcome[0])


LOCKER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()   # hold the lock until the test says so (or dies)
"""


def test_a_directory_locked_by_another_process_fails_the_save_in_bounded_time(tmp_path):
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline() == "locked\n"
        store = JsonFileSessionStore(tmp_path, lock_timeout_s=0.3)
        fds = len(os.listdir("/proc/self/fd"))
        thread, outcome = run_in_thread(AgentRuntime(ScriptedLlm([final("ok")]), store=store), "s")
        thread.join(10)
        assert len(os.listdir("/proc/self/fd")) == fds   # the lock's descriptor is closed
        assert outcome, "run() waited for the lock for ever"
        e = outcome[0]
        assert isinstance(e, StoreError) and "locked by another process" in str(e), outcome
        assert e.result is not None and e.result.content == "ok"   # the answer is not lost
    finally:
        locker.kill()
        locker.wait(10)
    assert JsonFileSessionStore(tmp_path).lock_timeout_s == 5.0


def test_a_save_after_a_load_writes_what_the_state_holds_not_what_was_read(tmp_path):
    """The file store writes a loaded session's text again only while the state still begins
    with those very messages: a loaded message replaced (an approval's new arguments), or
    messages dropped, is encoded anew."""
    store = JsonFileSessionStore(tmp_path)
    store.save("s", bob.SessionState([bob.Message("user", "a"), bob.Message("assistant", "b")],
                                     bob.Usage(1, 1), 1))
    grown = store.load("s")                          # the usual turn: the loaded text, one more
    grown.messages.append(bob.Message("user", "c"))
    grown.version += 1
    store.save("s", grown)
    assert [m.content for m in store.load("s").messages] == ["a", "b", "c"]
    changed = store.load("s")                        # a loaded message replaced
    changed.messages[1] = dataclasses.replace(changed.messages[1], content="B")
    changed.version += 1
    store.save("s", changed)
    assert [m.content for m in store.load("s").messages] == ["a", "B", "c"]
    cut = store.load("s")                            # fewer messages than were loaded
    cut.messages = cut.messages[:1]
    cut.version += 1
    store.save("s", cut)
    assert [m.content for m in store.load("s").messages] == ["a"]
    other = store.load("s")                          # another session's save in between
    store.save("t", bob.SessionState([bob.Message("user", "x")], bob.Usage(), 1))
    other.version += 1
    store.save("s", other)
    assert [m.content for m in store.load("s").messages] == ["a"]
