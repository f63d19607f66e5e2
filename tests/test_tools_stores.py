"""Tests of bob's tools and stores: FunctionTools schemas and validation, CompositeToolPort,
deny patterns, tool failures as data, output cutting, session stores and history round-trips.

Real threads and real files (pytest's tmp_path); no mocks, no sleeps.

Sections: 1. Helpers  2. FunctionTools  3. Composite and deny  4. Tool failures as data
          5. Output cutting  6. Round-trips  7. Session stores  8. Sessions across turns
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Literal, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bob
from conftest import ListSink, final, tc
from bob import (AgentRequest, AgentRuntime, CompositeToolPort, ConfigError, FinishReason,
                 FunctionTools, InMemorySessionStore, JsonFileSessionStore, LlmResponse, Message,
                 ScriptedLlm, SessionState, StoreError, ToolCall, ToolDescriptor, ToolResult,
                 TurnPolicy, Usage)


# ---- 1. Helpers ---------------------------------------------------------------------------------

def tool_messages(result: bob.AgentRunResult) -> list[Message]:
    return [m for m in result.history if m.role == "tool"]


def call(tools, name: str, **arguments) -> ToolResult:
    return tools.call_tool(ToolCall("c1", name, arguments), 5.0)


# ---- 2. FunctionTools ---------------------------------------------------------------------------

def everything(s: str, i: int, f: float, b: bool, names: list[str], opts: dict,
               maybe: Optional[int] = None, mode: Literal["a", "b"] = "a", n: int = 3) -> dict:
    """Take one of every supported kind
    of parameter.

    This second paragraph is not part of the description.
    """
    return {"s": s, "i": i, "f": f, "b": b, "names": names, "opts": opts, "maybe": maybe,
            "mode": mode, "n": n}


def test_function_tools_schema_from_hints():
    [d] = FunctionTools([everything]).list_tools()
    assert d.name == "everything"
    assert d.description.startswith("Take one of every supported kind")
    assert "second paragraph" not in d.description
    props = d.input_schema["properties"]
    assert props["s"] == {"type": "string"}
    assert props["i"] == {"type": "integer"}
    assert props["f"] == {"type": "number"}
    assert props["b"] == {"type": "boolean"}
    assert props["names"] == {"type": "array", "items": {"type": "string"}}
    assert props["opts"] == {"type": "object"}
    assert props["maybe"]["type"] == "integer"
    assert props["mode"] == {"type": "string", "enum": ["a", "b"], "default": "a"}
    assert props["n"] == {"type": "integer", "default": 3}
    assert d.input_schema["required"] == ["s", "i", "f", "b", "names", "opts"]
    assert d.input_schema["type"] == "object"
    json.dumps(d.input_schema)   # plain JSON


def test_function_tools_call_with_valid_arguments():
    tools = FunctionTools([everything])
    r = call(tools, "everything", s="x", i=1, f=2, b=True, names=["a"], opts={}, maybe=None)
    assert not r.is_error and r.call_id == "c1"
    assert json.loads(r.content)["f"] == 2 and json.loads(r.content)["n"] == 3


@pytest.mark.parametrize("args, says", [
    ({"i": 1, "f": 1.0, "b": True, "names": [], "opts": {}}, "missing arguments: s"),
    ({"s": "x", "i": 1, "f": 1.0, "b": True, "names": [], "opts": {}, "zz": 1},
     "unknown arguments: zz"),
    ({"s": "x", "i": "1", "f": 1.0, "b": True, "names": [], "opts": {}}, "i (expected integer)"),
    ({"s": "x", "i": True, "f": 1.0, "b": True, "names": [], "opts": {}}, "i (expected integer)"),
    ({"s": "x", "i": 1, "f": "1", "b": True, "names": [], "opts": {}}, "f (expected number)"),
    ({"s": "x", "i": 1, "f": 1.0, "b": 1, "names": [], "opts": {}}, "b (expected boolean)"),
    ({"s": "x", "i": 1, "f": 1.0, "b": True, "names": "a", "opts": {}}, "names (expected array)"),
    ({"s": "x", "i": 1, "f": 1.0, "b": True, "names": [], "opts": []}, "opts (expected object)"),
    ({"s": "x", "i": 1, "f": 1.0, "b": True, "names": [], "opts": {}, "mode": "c"}, "mode"),
    ({"s": None, "i": 1, "f": 1.0, "b": True, "names": [], "opts": {}}, "s (expected string)"),
])
def test_function_tools_argument_errors_name_the_argument(args, says):
    r = FunctionTools([everything]).call_tool(ToolCall("c1", "everything", args), 5.0)
    assert r.is_error and says in r.content, r.content
    assert "invalid arguments for everything" in r.content


def test_union_argument_error_says_what_is_expected():
    def pick(x: int | str) -> str:
        """Pick."""
        return str(x)

    r = FunctionTools([pick]).call_tool(ToolCall("c1", "pick", {"x": [1]}), 5.0)
    assert r.is_error and "x (expected" in r.content
    assert "expected None" not in r.content and "integer" in r.content.split("Input schema")[0]


def test_function_tools_returns_text_as_is_and_other_values_as_json():
    def text() -> str:
        """Text."""
        return "plain"

    def data() -> list:
        """Data."""
        return [1, {"é": None}]

    tools = FunctionTools([text, data])
    assert call(tools, "text").content == "plain"
    assert json.loads(call(tools, "data").content) == [1, {"é": None}]


def test_function_tools_refuse_duplicates_and_star_args():
    def f(x: int) -> int:
        """F."""
        return x

    def g(*args: int) -> int:
        """G."""
        return 0

    tools = FunctionTools([f])
    with pytest.raises(ConfigError, match="'f'"):
        tools.add(f)
    tools.add(f, name="f2", description="F again.")
    assert [(d.name, d.description) for d in tools.list_tools()] == [("f", "F."),
                                                                    ("f2", "F again.")]
    with pytest.raises(ConfigError, match=r"\*args"):
        FunctionTools([g])


# ---- 3. Composite and deny ----------------------------------------------------------------------

def make_tool(name: str, answer: str):
    def fn() -> str:
        """A tool."""
        return answer
    fn.__name__ = name
    return fn


class RemotePort:
    """A ToolPort that is not a FunctionTools (structural, no inheritance)."""

    def list_tools(self) -> list[ToolDescriptor]:
        return [ToolDescriptor("remote", "Remote.", {"type": "object", "properties": {}})]

    def call_tool(self, call: ToolCall, timeout_s: float, cancel=None) -> ToolResult:
        return ToolResult(call.id, call.name, f"remote ran with timeout {timeout_s}")


def test_composite_refuses_duplicate_names_naming_both_sources():
    with pytest.raises(ConfigError) as err:
        CompositeToolPort([FunctionTools([make_tool("x", "1")]), RemotePort(),
                           FunctionTools([make_tool("remote", "2")])])
    msg = str(err.value)
    assert "'remote'" in msg and "RemotePort" in msg and "FunctionTools" in msg
    assert "#1" in msg and "#2" in msg


def test_composite_routes_calls_to_their_port():
    port = CompositeToolPort([FunctionTools([make_tool("local", "local ran")]), RemotePort()])
    assert [d.name for d in port.list_tools()] == ["local", "remote"]
    assert call(port, "local").content == "local ran"
    assert call(port, "remote").content == "remote ran with timeout 5.0"
    missing = call(port, "nope")
    assert missing.is_error and "unknown tool 'nope'" in missing.content


def test_denied_tools_are_hidden_and_refused():
    ran = []

    def write(text: str) -> str:
        """Write a file."""
        ran.append(text)
        return "written"

    def read() -> str:
        """Read a file."""
        return "contents"

    tools = FunctionTools()
    tools.add(write, name="fs__write_file")
    tools.add(read, name="fs__read_file")
    sink = ListSink()
    rt = AgentRuntime(ScriptedLlm([tc("fs__write_file", text="x"), final("ok")]), tools,
                      events=sink, deny_tools=["fs__write_*"])
    r = rt.run(AgentRequest("write it"))
    system = rt.llm.requests[0].messages[0].content
    assert "fs__read_file" in system and "fs__write_file" not in system
    assert [t["name"] for t in sink.of("turn_started")[0]["tools"]] == ["fs__read_file"]
    [refused] = tool_messages(r)
    assert refused.is_error and "denied" in refused.content and ran == []
    assert r.finish_reason is FinishReason.FINAL


def test_denied_tools_are_left_out_of_native_tools_field():
    tools = FunctionTools()
    tools.add(make_tool("w", "w"), name="fs__write_file")
    tools.add(make_tool("r", "r"), name="fs__read_file")
    rt = AgentRuntime(ScriptedLlm(["hi"]), tools, action_mode="native",
                      deny_tools=["fs__write_*"])
    rt.run(AgentRequest("go"))
    assert [t.name for t in rt.llm.requests[0].tools] == ["fs__read_file"]


# ---- 4. Tool failures as data -------------------------------------------------------------------

def run_one_call(tools, reply: str, **policy) -> bob.AgentRunResult:
    rt = AgentRuntime(ScriptedLlm([reply, final("recovered")]), tools,
                      policy=TurnPolicy(**policy))
    r = rt.run(AgentRequest("go"))
    assert (r.finish_reason, r.content) == (FinishReason.FINAL, "recovered")
    return r


def test_unknown_tool_is_an_error_result_listing_the_tools():
    [m] = tool_messages(run_one_call(FunctionTools([make_tool("real", "x")]), tc("imaginary")))
    assert m.is_error and "unknown tool 'imaginary'" in m.content and "real" in m.content


def test_a_raising_tool_gives_its_exception_text():
    def explode() -> str:
        """Explodes."""
        raise ValueError("disk on fire at sector 7")

    [m] = tool_messages(run_one_call(FunctionTools([explode]), tc("explode")))
    assert m.is_error and "ValueError: disk on fire at sector 7" in m.content


def test_a_tool_port_that_raises_is_executor_unavailable():
    class GonePort:
        def list_tools(self):
            return [ToolDescriptor("x", "X.", {"type": "object", "properties": {}})]

        def call_tool(self, call, timeout_s, cancel=None):
            raise ConnectionError("server process exited")

    [m] = tool_messages(run_one_call(GonePort(), tc("x")))
    assert m.is_error
    assert m.content.startswith("executor unavailable: ") and "server process exited" in m.content


def test_a_tool_timeout_is_an_error_result_and_the_loop_goes_on(hang):
    release = hang()

    def slow() -> str:
        """Hangs until released."""
        release.wait(10)
        return "too late"

    t0 = time.monotonic()
    [m] = tool_messages(run_one_call(FunctionTools([slow]), tc("slow"), tool_timeout_ms=100))
    assert m.is_error and "timed out after 100 ms" in m.content
    assert time.monotonic() - t0 < 0.5


def test_the_tool_port_gets_the_timeout_in_seconds():
    [m] = tool_messages(run_one_call(RemotePort(), tc("remote"), tool_timeout_ms=1500))
    assert m.content == "remote ran with timeout 1.5"


# ---- 5. Output cutting --------------------------------------------------------------------------

def test_long_tool_output_is_cut_to_head_and_tail():
    def big() -> str:
        """A big output."""
        return "H" * 400 + "M" * 5000 + "T" * 400

    [m] = tool_messages(run_one_call(FunctionTools([big]), tc("big"),
                                     max_tool_output_chars=500))
    assert len(m.content) <= 500 and not m.is_error
    assert m.content.startswith("H" * 150) and m.content.endswith("T" * 150)
    kept = m.content.count("H") + m.content.count("M") + m.content.count("T")
    assert f"{5800 - kept} of 5800 characters cut" in m.content


def test_output_at_the_limit_is_not_cut():
    text = "x" * 300
    assert bob.cut_output(text, 300) == text


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 6000), st.integers(200, 2500))
def test_cut_output_fits_the_limit_and_reports_the_cut(length, limit):
    text = "".join(chr(0x4e00 + i % 5000) for i in range(length))   # no two nearby alike
    out = bob.cut_output(text, limit)
    assert len(out) <= limit
    if length <= limit:
        assert out == text
    else:
        head, rest = out.split("\n[... ", 1)
        notice, tail = rest.split(" ...]\n", 1)
        assert text.startswith(head) and text.endswith(tail)
        assert len(head) + len(tail) >= limit - 101 and abs(len(head) - len(tail)) <= 1
        assert notice == f"{length - len(head) - len(tail)} of {length} characters cut"


# ---- 6. Round-trips -----------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(), lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)
tool_calls = st.builds(ToolCall, st.text(min_size=1, max_size=8), st.text(min_size=1, max_size=8),
                       st.dictionaries(st.text(max_size=5), json_values, max_size=3))
messages = st.one_of(
    st.builds(Message, st.sampled_from(["system", "user", "assistant"]), st.text()),
    st.builds(Message, st.just("assistant"), st.text(),
              st.lists(tool_calls, min_size=1, max_size=3).map(tuple)),
    st.builds(Message, st.just("tool"), st.text(), st.just(()), st.text(min_size=1),
              st.text(min_size=1), st.booleans()))


@settings(max_examples=50, deadline=None)
@given(st.lists(messages, max_size=5), st.integers(0, 10**6), st.integers(0, 10**6),
       st.integers(0, 1000))
def test_session_state_round_trips_through_json(msgs, prompt, completion, version):
    state = SessionState(msgs, Usage(prompt, completion), version)
    back = SessionState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert back == state
    for m in msgs:
        assert Message.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_message_round_trip_keeps_every_field():
    calls = (ToolCall("c1", "add", {"a": 1, "nested": {"b": [1, 2]}}),)
    for m in [Message("assistant", "", calls),
              Message("tool", "boom", tool_call_id="c1", name="add", is_error=True),
              Message("tool", "3", tool_call_id="c1", name="add")]:
        assert Message.from_dict(json.loads(json.dumps(m.to_dict()))) == m


# ---- 7. Session stores --------------------------------------------------------------------------

def state_of(text: str, n: int = 0) -> SessionState:
    return SessionState([Message("user", text)], Usage(n, n), n)


def test_json_store_saves_and_loads(tmp_path):
    store = JsonFileSessionStore(tmp_path / "sessions")      # created on first save
    assert store.load("s1") is None
    store.save("s1", state_of("hello", 3))
    assert store.load("s1") == state_of("hello", 3)
    assert store.path_for("s1") == tmp_path / "sessions" / "s1.json"


def test_json_store_under_concurrent_writers(tmp_path):
    stores = [JsonFileSessionStore(tmp_path), JsonFileSessionStore(tmp_path)]  # two "processes"
    written: set[str] = set()
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(k: int) -> None:
        try:
            for i in range(8):
                for sid in ("shared", f"own{k}"):
                    text = f"{sid}:{k}:{i}"
                    try:
                        stores[k % 2].save(sid, state_of(text, i))
                        written.add(text)
                    except StoreError as e:   # one writer of a version wins, the others learn
                        assert sid == "shared" and "changed by another turn" in str(e)
        except BaseException as e:  # a failed save must fail the test, not just warn
            errors.append(e)

    def reader() -> None:
        try:
            while not stop.is_set():
                for p in tmp_path.glob("*.json"):
                    json.loads(p.read_text(encoding="utf-8"))   # every file always parses
                stores[0].load("shared")
        except BaseException as e:
            errors.append(e)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    writers = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join(10)
    stop.set()
    for t in readers:
        t.join(10)
    assert errors == []
    assert stores[1].load("shared").messages[0].content in written
    for k in range(4):
        assert stores[0].load(f"own{k}") == state_of(f"own{k}:{k}:7", 7)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["shared.json"] + [f"own{k}.json" for k in range(4)])   # no temp file left


def test_json_store_corrupt_file_is_a_store_error_naming_the_path(tmp_path):
    store = JsonFileSessionStore(tmp_path)
    for i, junk in enumerate(['{"messages": [', "[]", "{}", '{"messages": [{"role": "user"}]}']):
        path = tmp_path / f"bad{i}.json"
        path.write_text(junk)
        with pytest.raises(StoreError) as err:
            store.load(f"bad{i}")
        assert str(path) in str(err.value)


def test_a_corrupt_session_fails_the_turn_instead_of_starting_empty(tmp_path):
    (tmp_path / "s.json").write_text("not json")
    rt = AgentRuntime(ScriptedLlm([final("hi")]), store=JsonFileSessionStore(tmp_path))
    with pytest.raises(StoreError, match="s.json"):
        rt.run(AgentRequest("hello", session_id="s"))
    assert rt.llm.requests == [] and (tmp_path / "s.json").read_text() == "not json"


@pytest.mark.parametrize("session_id", ["../x", "a/b", "", ".hidden", "..", "a\\b", "x" * 129,
                                        "/etc/passwd"])
def test_json_store_rejects_bad_session_ids(tmp_path, session_id):
    store = JsonFileSessionStore(tmp_path)
    with pytest.raises(StoreError, match="invalid session id"):
        store.save(session_id, state_of("x"))
    with pytest.raises(StoreError, match="invalid session id"):
        store.load(session_id)
    assert list(tmp_path.iterdir()) == []


def test_json_store_rejects_a_session_id_with_a_trailing_newline(tmp_path):
    with pytest.raises(StoreError, match="invalid session id"):
        JsonFileSessionStore(tmp_path).save("abc\n", state_of("x"))


def test_a_failing_save_raises_with_the_answer_and_emits_an_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("I am a file")
    broken = JsonFileSessionStore(not_a_dir)
    with pytest.raises(StoreError, match="cannot save session file"):
        broken.save("s", state_of("x"))

    class SaveFails:   # loads fine (a new session), then the save hits the broken directory
        def load(self, session_id):
            return None

        def save(self, session_id, state):
            broken.save(session_id, state)

    sink = ListSink()
    rt = AgentRuntime(ScriptedLlm([final("the answer")]), store=SaveFails(), events=sink)
    with pytest.raises(StoreError, match="cannot save session file") as raised:
        rt.run(AgentRequest("q", session_id="s"))   # a turn not stored did not return...
    r = raised.value.result                           # ...but its answer is not lost
    assert (r.finish_reason, r.content) == (FinishReason.FINAL, "the answer")
    [err] = sink.of("error")
    assert err["where"] == "store.save" and "StoreError" in err["error"]
    assert str(not_a_dir) in err["error"]
    assert sink.events[-1].kind == "turn_completed"


def test_in_memory_store_is_thread_safe_and_copies():
    store = InMemorySessionStore()
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(200):
                with contextlib.suppress(StoreError):   # one writer of a version wins
                    store.save("shared", state_of(f"{k}:{i}", i))
                store.save(f"own{k}", state_of(f"{k}:{i}", i))
                got = store.load("shared")
                assert got is not None and len(got.messages) == 1
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == []
    assert all(store.load(f"own{k}") == state_of(f"{k}:199", 199) for k in range(6))
    got = store.load("own0")
    got.messages.append(Message("user", "mutated"))           # a copy: the store is unchanged
    assert store.load("own0") == state_of("0:199", 199)


# ---- 8. Sessions across turns -------------------------------------------------------------------

def test_a_session_continues_across_runs_and_runtimes(tmp_path):
    first = AgentRuntime(ScriptedLlm([final("Hi Ada")]), store=JsonFileSessionStore(tmp_path))
    first.run(AgentRequest("My name is Ada", session_id="ada"))
    llm = ScriptedLlm([final("Your name is Ada")])
    second = AgentRuntime(llm, store=JsonFileSessionStore(tmp_path))
    r = second.run(AgentRequest("What is my name?", session_id="ada"))
    sent = [m.content for m in llm.requests[0].messages[1:]]
    assert sent == ["My name is Ada", final("Hi Ada"), "What is my name?"]
    assert [m.content for m in r.history] == ["My name is Ada", "Hi Ada", "What is my name?",
                                              "Your name is Ada"]


def test_request_history_replaces_the_stored_history():
    llm = ScriptedLlm([final("one"), final("two")])
    rt = AgentRuntime(llm)
    rt.run(AgentRequest("stored question", session_id="h"))
    mine = [Message("user", "my question"), Message("assistant", "my answer")]
    r = rt.run(AgentRequest("next", session_id="h", history=mine))
    sent = [m.content for m in llm.requests[1].messages]
    assert "stored question" not in sent and "my question" in sent
    assert r.history[:2] == mine and len(r.history) == 4
    assert rt.store.load("h").messages == r.history
    assert mine == [Message("user", "my question"), Message("assistant", "my answer")]


def test_native_mode_history_carries_tool_messages():
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    llm = ScriptedLlm([LlmResponse("", (ToolCall("t1", "add", {"a": 2, "b": 3}),)), "5"])
    r = AgentRuntime(llm, FunctionTools([add]), action_mode="native").run(AgentRequest("2+3"))
    wire = llm.requests[1].messages
    assert [m.role for m in wire] == ["system", "user", "assistant", "tool"]
    assert wire[-1] == Message("tool", "5", tool_call_id="t1", name="add")
    assert llm.requests[1].response_format is None and [t.name for t in llm.requests[1].tools] \
        == ["add"]
    assert r.content == "5"


def test_a_literal_of_ints_refuses_a_bool():
    def pick(n: Literal[1, 2]) -> int:
        """Pick."""
        return n

    r = FunctionTools([pick]).call_tool(ToolCall("c", "pick", {"n": True}), 1.0)
    assert r.is_error and "n (expected one of [1, 2])" in r.content


def test_a_function_whose_hints_cannot_be_read_is_a_config_error():
    def broken(x: "NoSuchType") -> str:  # noqa: F821
        """Broken."""
        return x

    with pytest.raises(ConfigError, match="cannot read the signature of broken"):
        FunctionTools([broken])


def test_json_store_keeps_any_text_and_calls_bad_utf8_corrupt(tmp_path):
    store = JsonFileSessionStore(tmp_path)
    odd = "half an emoji: \ud83d, and ünïcödé"     # a lone surrogate, e.g. from a cut stream
    store.save("s", bob.SessionState([bob.Message("assistant", odd)]))
    assert store.load("s").messages[0].content == odd
    (tmp_path / "bad.json").write_bytes(b'{"messages": ["\xff\xfe"]}')
    with pytest.raises(bob.StoreError, match="bad.json is corrupt"):
        store.load("bad")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "s.json"]  # no temp file


def test_a_return_value_json_cannot_encode_is_the_tools_error():
    def loop() -> dict:
        """Returns a dict that contains itself."""
        d: dict = {}
        d["d"] = d
        return d

    r = FunctionTools([loop]).call_tool(ToolCall("c", "loop", {}), 1.0)
    assert r.is_error and r.content == "ValueError: Circular reference detected"


def test_timeouts_past_a_day_are_config_errors():
    with pytest.raises(ConfigError, match="turn_timeout_ms must be at most 86400000"):
        bob.TurnPolicy(turn_timeout_ms=10**12)
