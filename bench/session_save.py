"""Benchmark: saving and loading a 20 MB session, and cancel with such a session.

    python bench/session_save.py

A session of about 20 MB of text (questions, tool calls, tool results, answers) in 2,000,
20,000 or 100,000 messages. Printed for each store (JsonFileSessionStore in a temp directory,
InMemorySessionStore): the save and the load, and the time from cancel() (while the model hangs)
until run() returns, which is mostly the save of the turn. Each figure is the median of a few
runs. The promise: run() returns within 300 ms of cancel().

Sections: 1. Setup  2. Measure and report
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bob  # noqa: E402  (after the path line, so the bench runs from a plain checkout)

SIZE = 20_000_000
SHAPES = (2_000, 20_000, 100_000)
REPEATS = 3


# ---- 1. Setup -----------------------------------------------------------------------------------

def big_session(size: int, n: int) -> bob.SessionState:
    """About `size` bytes of history in `n` messages: questions, tool calls, results, answers."""
    text = "y" * (size // n)
    messages: list[bob.Message] = []
    for i in range(0, n, 4):
        call = bob.ToolCall(f"c{i}", "echo", {"x": i})
        messages += [bob.Message("user", text), bob.Message("assistant", "", (call,)),
                     bob.Message("tool", text, tool_call_id=call.id, name="echo"),
                     bob.Message("assistant", text)]
    return bob.SessionState(messages, bob.Usage(1, 1), 1)


def cancel_ms(store: bob.SessionStore, session_id: str) -> float:
    """ms from cancel() to run() returning, with the model hanging, on a stored session."""
    asked, release = threading.Event(), threading.Event()

    def hanging(req: bob.LlmRequest, cancel: bob.CancelToken) -> str:
        asked.set()
        release.wait(60)
        return json.dumps({"type": "final", "content": "too late"})

    token, done = bob.CancelToken(), threading.Event()
    rt = bob.AgentRuntime(bob.ScriptedLlm([hanging]), store=store)
    turn = threading.Thread(target=lambda: (rt.run(bob.AgentRequest("more", session_id),
                                                   token), done.set()))
    turn.start()
    asked.wait(60)
    t0 = time.perf_counter()
    token.cancel()
    done.wait(60)
    took = (time.perf_counter() - t0) * 1000
    release.set()
    turn.join(60)
    return took


# ---- 2. Measure and report ----------------------------------------------------------------------

def measure(store: bob.SessionStore, state: bob.SessionState) -> tuple[float, float, float]:
    """Median ms of a save, a load and a cancel, over REPEATS runs (one new session each)."""
    saves, loads, cancels = [], [], []
    for i in range(REPEATS):
        t0 = time.perf_counter()
        store.save(f"big{i}", state)
        saves.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        store.load(f"big{i}")
        loads.append((time.perf_counter() - t0) * 1000)
        cancels.append(cancel_ms(store, f"big{i}"))
    return statistics.median(saves), statistics.median(loads), statistics.median(cancels)


def main() -> None:
    print(f"bob session save/load, about {SIZE // 1_000_000} MB of history, median of "
          f"{REPEATS} runs, Python {sys.version.split()[0]}")
    for n in SHAPES:
        state = big_session(SIZE, n)
        with tempfile.TemporaryDirectory() as tmp:
            for name, store in (("file", bob.JsonFileSessionStore(tmp)),
                                ("memory", bob.InMemorySessionStore())):
                save, load, cancel = measure(store, state)
                print(f"  {n:>7} messages, {name:<6}: save {save:6.1f} ms, load {load:6.1f} ms, "
                      f"cancel -> return {cancel:6.1f} ms (target < 300)")


if __name__ == "__main__":
    main()
