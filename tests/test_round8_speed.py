"""Replay's speed fixes of the eighth round that a user can see: a replayed turn leaves no
reference cycle behind, so its objects (the trace's events, the runtime, the ports) are freed
as soon as replay() returns, not at the garbage collector's next full pass (which landed in
the next replay: 20 of a 1,000-step replay's ~290 ms). Real parts: a recorded JSONL trace."""
from __future__ import annotations

import gc

import bob
from bob import AgentRequest, AgentRuntime, FunctionTools, JsonlEventSink, ScriptedLlm
from conftest import final, tc


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_a_replayed_turn_leaves_no_reference_cycle(tmp_path):
    path = tmp_path / "t.jsonl"
    sink = JsonlEventSink(path)
    AgentRuntime(ScriptedLlm([tc("add", a=i, b=1) for i in range(20)] + [final("done")]),
                 FunctionTools([add]), events=sink,
                 policy=bob.TurnPolicy(max_steps=30, max_tool_calls=30)).run(AgentRequest("go"))
    sink.close()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)   # what the collector finds is kept in gc.garbage
    try:
        assert bob.replay(path).ok
        gc.collect()
        # nothing the replay made waits for the collector (other tests' threads may leave
        # garbage of their own meanwhile: only bob's objects count)
        left = [type(o).__name__ for o in gc.garbage if type(o).__module__ == "bob"]
        assert left == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
