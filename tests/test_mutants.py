"""Tests that kill mutants: behaviour of bob.py's CancelToken, LoopGuard, scheduler, approvals,
action parser and session stores that no other fast test pinned down. Each was found by
`bench/mutants.py`: a one-line change to bob.py (a flipped comparison, a dropped statement, a
constant off by one) that the rest of the suite did not notice.

Real parts only: AgentRuntime with ScriptedLlm, FunctionTools and small ports and stores written
here (a tool that blocks until cancelled, a store that is slow or whose disk fails), real files on
tmp_path. No sleeps: blocking ports wait on events; where a deadline must pass, the clock runs.
The helpers come from test_core.

Sections: 1. CancelToken  2. Guards  3. Scheduler  4. Approvals  5. Actions  6. Stores and sinks
"""
from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from bob import (ACTION_CONTRACT, ActionParseError, AgentError, AgentRequest, AgentRuntime,
                 Approval, CancelToken, ConfigError, FinishReason, FunctionTools, GuardReason,
                 InMemorySessionStore, JsonFileSessionStore, LlmError, LlmResponse, Message,
                 ScriptedLlm, SessionState, StoreError, ToolCall, ToolDescriptor, ToolResult,
                 TurnPolicy, parse_action, redact)
from conftest import (Counter, ListSink, agent, assert_tripped, assert_well_formed, batch, final,
                      tc)


# ---- 1. CancelToken -----------------------------------------------------------------------------

def test_on_cancel_on_a_cancelled_token_runs_the_callback_at_once():
    token, called = CancelToken(), []
    token.cancel()
    remove = token.on_cancel(lambda: called.append("now"))
    remove()                                   # nothing left to remove, and no error
    assert called == ["now"]


def test_a_removed_callback_is_not_run_at_cancel_and_the_others_are():
    token, called = CancelToken(), []
    remove = token.on_cancel(lambda: called.append("removed"))
    token.on_cancel(lambda: called.append("kept"))
    remove()
    token.cancel()
    remove()                                   # after cancel too: a no-op, not an error
    assert called == ["kept"]


def test_wait_says_whether_the_token_was_cancelled():
    token = CancelToken()
    assert token.wait(0) is False
    token.cancel()
    assert token.wait(0) is True and token.wait() is True


# ---- 2. Guards ----------------------------------------------------------------------------------

def test_refused_oversized_batches_count_toward_max_consecutive_errors():
    c = Counter()
    two = [("a", "echo", {"x": 1}), ("b", "echo", {"x": 2})]
    rt = agent([batch(*two), batch(*two), "never asked"], mode="native", tools=c.tools(),
               max_parallel_tools=1, max_consecutive_errors=2)
    r = rt.run(AgentRequest("go"))
    assert_tripped(r, GuardReason.MAX_CONSECUTIVE_ERRORS, "max_consecutive_errors=2")
    assert (r.steps, c.calls) == (2, [])


def test_a_success_resets_the_error_streak_to_zero():
    c = Counter()
    replies = [tc("fail", n=1), tc("echo", x=1), tc("fail", n=2), tc("fail", n=3), final("no")]
    r = agent(replies, tools=c.tools(), max_consecutive_errors=2).run(AgentRequest("go"))
    assert_tripped(r, GuardReason.MAX_CONSECUTIVE_ERRORS, "2 tool errors in a row")
    assert r.steps == 4


class SlowStore:
    """An in-memory store whose load takes `seconds` by the clock (past a tiny deadline)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.inner = seconds, InMemorySessionStore()

    def load(self, session_id: str) -> SessionState | None:
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:   # only the clock must move on: no thread to wait for
            pass
        return self.inner.load(session_id)

    def save(self, session_id: str, state: SessionState) -> None:
        self.inner.save(session_id, state)


def test_a_turn_past_its_deadline_before_the_first_step_never_asks_the_model():
    llm = ScriptedLlm([final("too late")])
    rt = AgentRuntime(llm, store=SlowStore(0.005), policy=TurnPolicy(turn_timeout_ms=1))
    r = rt.run(AgentRequest("go"))
    assert_tripped(r, GuardReason.TURN_TIMEOUT, "the turn took longer than turn_timeout_ms=1")
    assert (llm.requests, r.steps) == ([], 0)


def test_a_batch_resumed_after_its_deadline_is_answered_not_run():
    store, c = SlowStore(0.005), Counter()
    paused = AgentRuntime(ScriptedLlm([tc("echo", x=1)]), c.tools(), store=store,
                          ask_tools=["echo"]).run(AgentRequest("go"))
    assert paused.finish_reason is FinishReason.NEEDS_APPROVAL
    # No tool port: the resume lists no tools, so no worker can race the 1 ms deadline.
    r = AgentRuntime(ScriptedLlm(), None, store=store, policy=TurnPolicy(turn_timeout_ms=1)).run(
        AgentRequest(None, approvals={paused.pending[0].id: Approval(True)}))
    assert_tripped(r, GuardReason.TURN_TIMEOUT, "the turn took longer than turn_timeout_ms=1")
    assert r.history[-1].content == "not run: the turn took longer than turn_timeout_ms=1"
    assert c.calls == []


# ---- 3. Scheduler -------------------------------------------------------------------------------

def test_an_unknown_action_mode_is_a_config_error_naming_the_two():
    with pytest.raises(ConfigError, match="action_mode must be 'json' or 'native', got 'xml'"):
        AgentRuntime(ScriptedLlm(), action_mode="xml")


def test_a_turn_given_a_cancelled_token_ends_cancelled_without_calling_the_model():
    token, llm = CancelToken(), ScriptedLlm([final("never")])
    token.cancel()
    r = AgentRuntime(llm).run(AgentRequest("go"), token)
    assert (r.finish_reason, r.content, r.steps, llm.requests) == (
        FinishReason.CANCELLED, "Cancelled.", 0, [])


class StoppableTool:
    """A tool port whose one tool blocks until its call is cancelled."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def list_tools(self) -> list[ToolDescriptor]:
        return [ToolDescriptor("block", "Blocks until cancelled.", {"type": "object"})]

    def call_tool(self, call: ToolCall, timeout_s: float,
                  cancel: CancelToken | None = None) -> ToolResult:
        assert cancel is not None
        if cancel.wait(10):
            self.cancelled.set()
        return ToolResult(call.id, call.name, "stopped", True)


def test_a_tool_call_given_up_on_is_cancelled_when_the_turn_ends():
    port = StoppableTool()
    rt = agent([tc("block"), final("gave up")], tools=port, tool_timeout_ms=50)
    r = rt.run(AgentRequest("go"))
    assert r.content == "gave up" and "timed out after 50 ms" in r.history[-2].content
    assert port.cancelled.wait(3), "the abandoned call never saw the turn's cancel"


def too_long() -> LlmError:
    return LlmError("too long", 400, "This model's maximum context length is 8192 tokens.")


def test_a_too_long_prompt_of_one_message_is_not_retried():
    llm = ScriptedLlm([too_long(), final("never")])
    with pytest.raises(LlmError, match="too long"):
        AgentRuntime(llm).run(AgentRequest("go"))
    assert len(llm.requests) == 1


def test_a_too_long_prompt_of_two_messages_is_retried_with_one():
    llm, sink = ScriptedLlm([too_long(), final("short")]), ListSink()
    r = AgentRuntime(llm, events=sink).run(
        AgentRequest("go", history=[Message("user", "old")]))
    truncated = [(d["from"], d["to"]) for d in sink.of("history_truncated")]
    assert r.content == "short" and truncated == [(2, 1)]
    assert [m.content for m in llm.requests[1].messages[1:]] == ["go"]


def test_after_a_valid_action_two_more_invalid_replies_end_the_turn():
    c = Counter()
    rt = agent(["nope", tc("echo", x=1), "nope", "nope", final("never")], tools=c.tools())
    with pytest.raises(AgentError, match="invalid action twice in a row"):
        rt.run(AgentRequest("go"))


def test_the_tool_calling_text_is_kept_in_native_mode_and_not_in_json_mode():
    c = Counter()
    native = agent([batch(("a", "echo", {"x": 1}), text="let me look"), "done"], mode="native",
                   tools=c.tools()).run(AgentRequest("go"))
    json_mode = agent([tc("echo", x=1), final("done")], tools=c.tools()).run(AgentRequest("go"))
    assert native.history[1].content == "let me look" and json_mode.history[1].content == ""


def test_the_corrective_prompt_asks_for_the_modes_kind_of_answer():
    native = agent([LlmResponse(""), "ok"], mode="native").run(AgentRequest("go"))
    json_mode = agent(["nope", final("ok")]).run(AgentRequest("go"))
    assert native.history[1].content.endswith("Answer in text or call a tool.")
    assert json_mode.history[1].content.endswith(ACTION_CONTRACT)
    assert ACTION_CONTRACT not in native.history[1].content


def test_a_failed_turn_emits_its_error_and_then_turn_completed_without_a_finish_reason():
    sink = ListSink()
    with pytest.raises(AgentError):
        agent(["nope", "nope"], events=sink).run(AgentRequest("go"))
    assert sink.kinds()[-2:] == ["error", "turn_completed"]
    assert sink.of("error")[-1]["where"] == "turn"
    assert sink.of("error")[-1]["error"].startswith("AgentError: the model replied with an invalid")
    assert sink.of("turn_completed")[-1]["finish_reason"] is None


class BrokenDisk:
    """A store whose saves fail with a plain OSError (`load_error`: loads fail too)."""

    def __init__(self, load_error: Exception | None = None) -> None:
        self.load_error, self.saved = load_error, []

    def load(self, session_id: str) -> SessionState | None:
        if self.load_error:
            raise self.load_error
        return None

    def save(self, session_id: str, state: SessionState) -> None:
        self.saved.append(state)
        raise OSError("disk full")


def test_a_store_failing_with_any_error_raises_a_store_error_holding_the_answer():
    with pytest.raises(StoreError, match="cannot save session 'default': OSError: disk full") as e:
        AgentRuntime(ScriptedLlm([final("hi")]), store=BrokenDisk()).run(AgentRequest("go"))
    assert e.value.result.content == "hi"


def test_a_session_that_cannot_be_loaded_is_never_saved_over():
    store, sink = BrokenDisk(StoreError("cannot read it")), ListSink()
    with pytest.raises(StoreError, match="cannot read it"):
        AgentRuntime(ScriptedLlm([final("hi")]), store=store, events=sink).run(AgentRequest("go"))
    assert store.saved == [] and sink.kinds() == []


def test_an_internal_error_is_an_agent_error_caused_by_it():
    with pytest.raises(AgentError, match="internal error in start: AttributeError") as e:
        AgentRuntime(ScriptedLlm()).run(AgentRequest("go", history=["not a Message"]))
    assert isinstance(e.value.__cause__, AttributeError)


def test_tool_calls_are_refused_while_too_many_earlier_port_calls_hang(hang):
    release, store, c = hang(), InMemorySessionStore(), Counter()

    def stuck() -> str:
        """Blocks until the test ends."""
        release.wait()
        return "late"

    def reply(req, cancel):
        # Another turn, meanwhile, gives up on 32 calls that never return.
        calls = [(f"h{i}", "stuck", {}) for i in range(32)]
        other = agent([batch(*calls)], mode="native", tools=FunctionTools([stuck]),
                      max_parallel_tools=32, max_tool_calls=32, tool_timeout_ms=1)
        other.run(AgentRequest("hang"))          # ends on max_consecutive_errors
        return tc("echo", x=1)

    with pytest.raises(AgentError, match="restart the program"):   # at the next model call
        AgentRuntime(ScriptedLlm([reply]), c.tools(), store=store).run(AgentRequest("go"))
    result = store.load("default").messages[-1]
    assert c.calls == [] and result.is_error
    assert result.content == ("executor unavailable: 32 earlier port calls are still hung; "
                              "restart the program")


# ---- 4. Approvals: pause and resume -------------------------------------------------------------

def asking(replies, c: Counter, store, **kw) -> AgentRuntime:
    """A runtime whose `echo` calls need a decision."""
    return AgentRuntime(ScriptedLlm(replies), c.tools(), store=store, ask_tools=["echo"], **kw)


def test_pausing_without_an_approver_decides_nothing_and_says_what_waits():
    sink, c = ListSink(), Counter()
    r = asking([tc("echo", x=1)], c, InMemorySessionStore(), events=sink).run(AgentRequest("go"))
    assert (r.finish_reason, r.content) == (FinishReason.NEEDS_APPROVAL,
                                            "Waiting for approval: echo.")
    assert len(sink.of("approval_requested")) == 1 and sink.of("approval_decided") == []


def test_edited_arguments_change_only_the_call_in_history():
    c = Counter()
    r = asking([tc("echo", x=1), final("ok")], c, InMemorySessionStore(),
               approver=lambda call: Approval(True, arguments={"x": 30})).run(AgentRequest("go"))
    assert c.calls == [("echo", {"x": 30, "a": 0, "b": 0})]
    assert [(m.role, m.content) for m in r.history[:2]] == [("user", "go"), ("assistant", "")]
    assert r.history[1].tool_calls[0].arguments == {"x": 30}
    assert_well_formed(r.history)


def test_an_approver_returning_no_approval_declines_the_call():
    c = Counter()
    r = asking([tc("echo", x=1), final("ok")], c, InMemorySessionStore(),
               approver=lambda call: "yes").run(AgentRequest("go"))
    assert c.calls == [] and r.content == "ok"
    assert r.history[2].is_error
    assert r.history[2].content == "the user declined this call: the approver returned str, " \
                                   "not an Approval"


def test_a_resumed_batch_is_not_counted_again_by_the_loop_guard():
    store, c = InMemorySessionStore(), Counter()
    paused = asking([tc("echo", x=1)], c, store, policy=TurnPolicy(max_repeated_batches=1)).run(
        AgentRequest("go"))
    r = asking([final("done")], c, store, policy=TurnPolicy(max_repeated_batches=1)).run(
        AgentRequest(None, approvals={paused.pending[0].id: Approval(True)}))
    assert (r.finish_reason, r.content, len(c.calls)) == (FinishReason.FINAL, "done", 1)


def test_a_resumed_turn_still_sends_its_question_when_history_is_cut():
    store, c = InMemorySessionStore(), Counter()
    old = [Message("user", "old question"), Message("assistant", "old answer")]
    paused = asking([tc("echo", x=1)], c, store).run(AgentRequest("go", history=old))
    llm = ScriptedLlm([final("done")])
    AgentRuntime(llm, c.tools(), store=store, ask_tools=["echo"],
                 policy=TurnPolicy(max_history_messages=3)).run(
        AgentRequest(None, approvals={paused.pending[0].id: Approval(True)}))
    sent = [m.content for m in llm.requests[0].messages[1:]]
    assert sent[0] == "go" and "old question" not in sent and len(sent) == 3


def test_decisions_from_an_earlier_resume_are_kept_until_the_batch_runs():
    store, c = InMemorySessionStore(), Counter()
    two = batch(("a", "echo", {"x": 1}), ("b", "echo", {"x": 2}))
    asking([two], c, store, action_mode="native").run(AgentRequest("go"))
    again = asking([], c, store, action_mode="native").run(
        AgentRequest(None, approvals={"a": Approval(False, "no")}))
    assert [p.id for p in again.pending] == ["b"] and c.calls == []
    r = asking(["done"], c, store, action_mode="native").run(
        AgentRequest(None, approvals={"b": Approval(True)}))
    assert r.content == "done" and c.calls == [("echo", {"x": 2, "a": 0, "b": 0})]
    assert r.history[2].content == "the user declined this call: no"


def test_new_input_ends_the_pause_in_the_stored_session():
    store, c = InMemorySessionStore(), Counter()
    asking([tc("echo", x=1)], c, store).run(AgentRequest("go"))
    assert store.load("default").paused is not None
    asking([final("fine")], c, store).run(AgentRequest("never mind"))
    assert store.load("default").paused is None


# ---- 5. Actions ---------------------------------------------------------------------------------

def nested_call(levels: int) -> str:
    """A tool_call reply whose argument is a list nested `levels` deep (the reply object is
    level 1, its arguments level 2, so the innermost list is level levels + 2)."""
    value: object = 1
    for _ in range(levels):
        value = [value]
    return json.dumps({"type": "tool_call", "name": "t", "arguments": {"a": value}})


def test_a_reply_may_nest_100_levels_and_not_101():
    assert parse_action(nested_call(98)).calls[0].name == "t"
    with pytest.raises(ActionParseError, match="nests deeper than 100 levels"):
        parse_action(nested_call(99))


def test_a_reply_may_hold_a_14000_bit_integer_and_not_a_longer_one():
    reply = {"type": "final", "content": "ok"}
    assert parse_action(json.dumps({**reply, "n": 2**14000 - 1})).content == "ok"
    with pytest.raises(ActionParseError, match="integer over 4,000 digits"):
        parse_action(json.dumps({**reply, "n": 2**14000}))


def test_a_reply_that_is_no_action_is_reported_as_its_masked_text_parses():
    # the error the model and the trace are told is that of the reply as the trace has it
    # (masked), so a replay finds the same one; here masking moves the column it names
    bad = '{"api_key": "sk-0123456789abcdef", oops}'
    errors = []
    for text in (bad, redact(bad)):
        with pytest.raises(ActionParseError) as raised:
            parse_action(text)
        errors.append(str(raised.value))
    assert errors[0] != errors[1]
    sink = ListSink()
    result = agent([bad, final("ok")], events=sink).run(AgentRequest("go"))
    assert result.content == "ok"
    assert sink.of("parse_error") == [{"error": errors[1], "attempt": 1}]
    reprompt = [m.content for m in result.history if m.role == "user"][-1]
    assert f"not a valid action: {errors[1]}." in reprompt


# ---- 6. Stores and sinks ------------------------------------------------------------------------

def test_a_save_conflict_names_the_stored_version_and_the_one_the_turn_started_from():
    store = InMemorySessionStore()
    store.save("s", SessionState([Message("user", "hi")], version=1))
    first, second = store.load("s"), store.load("s")
    first.version += 1
    store.save("s", first)
    second.version += 1
    with pytest.raises(StoreError, match="at version 2, this turn started from version 1"):
        store.save("s", second)


def test_the_first_save_creates_the_store_directory_and_its_parents(tmp_path):
    store = JsonFileSessionStore(tmp_path / "a" / "b")
    for text, answer in (("go", "hi"), ("more", "again")):   # the second finds the directory
        AgentRuntime(ScriptedLlm([final(answer)]), store=store).run(AgentRequest(text, "s"))
    assert [m.content for m in store.load("s").messages] == ["go", "hi", "more", "again"]


def test_an_unreadable_session_file_is_a_store_error_naming_it(tmp_path):
    (tmp_path / "s.json").mkdir()              # reading a directory fails with an OSError
    with pytest.raises(StoreError, match="cannot read session file .*s.json"):
        JsonFileSessionStore(tmp_path).load("s")


def test_a_corrupt_session_file_says_what_json_found_and_deep_nesting_says_so(tmp_path):
    store = JsonFileSessionStore(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(StoreError, match=r"is corrupt \(Expecting property name"):
        store.load("bad")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(StoreError, match=r"is corrupt \(nested too deeply\)"):
        store.load("deep")


class BrokenSink:
    """An event sink that raises on every event."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"BrokenSink({self.name})"

    def emit(self, event: object) -> None:
        raise RuntimeError(f"{self.name} is broken")


def test_each_failing_sink_is_warned_about_once_with_its_traceback_then_quietly(caplog):
    sinks = [BrokenSink("a"), BrokenSink("b")]
    rt = AgentRuntime(ScriptedLlm([final("one"), final("two")]), events=sinks)
    with caplog.at_level(logging.DEBUG, logger="bob"):
        assert rt.run(AgentRequest("go")).content == "one"
        assert rt.run(AgentRequest("again")).content == "two"   # a later turn: still once
    failures = [r for r in caplog.records if "failed on" in r.getMessage()]
    warned = [r for r in failures if r.levelno == logging.WARNING]
    assert [r.getMessage().split()[2] for r in warned] == ["BrokenSink(a)", "BrokenSink(b)"]
    assert all(r.exc_info for r in warned)
    quiet = [r for r in failures if r not in warned]
    assert len(quiet) > 10 and all(r.levelno == logging.DEBUG and not r.exc_info for r in quiet)
