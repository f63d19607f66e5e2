"""Benchmark: the scheduler's time for a native reply with tens of thousands of tool calls.

    python bench/big_reply.py

A ScriptedLlm answers with one reply of N tool calls (distinct ids), then with a final answer.
N = 1,000 is the most a reply may hold (bob._MAX_CALLS_PER_REPLY): an over-size batch, each call
gets a "not run" result. N = 20,000 and 40,000 are malformed replies (one corrective re-prompt;
before, they were over-size batches too: 20,000 results in the session). Printed: the whole turn
(no I/O, no event sinks), and the time from a cancel fired as the big reply arrives until run()
returns (an event sink fires it), each the median of a few runs. All in milliseconds (the
quadratic call-id check took 4.6 s and 19 s; the 20,000 results took 150-250 ms to cancel).

Then issue 21's two texts, in json mode: "```json" and 25,000 / 100,000 spaces with no closing
fence (the fence pattern was quadratic: 4-8 s, 45 s), and a final answer holding 32,000
backslashes with an event sink listening (the masking pattern was quadratic: 6-10 s). Printed:
the whole turn, and cancel -> return for a cancel fired 20 ms into the turn (from a timer
thread; "ended first" when the turn was over by then).

Sections: 1. Setup  2. Measure and report
"""
from __future__ import annotations

import gc
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bob  # noqa: E402  (after the path line, so the bench runs from a plain checkout)

SIZES = (1_000, 20_000, 40_000)
REPEATS = 5


# ---- 1. Setup -----------------------------------------------------------------------------------

def echo(x: int = 0) -> str:
    """Echo x."""
    return f"echo {x}"


def big_reply(n: int) -> bob.LlmResponse:
    """A native reply with n tool calls."""
    return bob.LlmResponse("", tuple(bob.ToolCall(f"id{i}", "echo", {"x": i}) for i in range(n)))


class CancelOnReply:
    """An event sink that cancels the turn as the model's reply arrives, and stamps the time."""

    def __init__(self, token: bob.CancelToken) -> None:
        self.token, self.t = token, 0.0

    def emit(self, event: bob.AgentEvent) -> None:
        if event.kind == "llm_call_completed":
            self.t = time.perf_counter()
            self.token.cancel()


# ---- 2. Measure and report ----------------------------------------------------------------------

def turn_ms(n: int) -> float:
    """One turn: the big reply refused, then a final answer."""
    rt = bob.AgentRuntime(bob.ScriptedLlm([big_reply(n), '{"type": "final", "content": "ok"}']),
                          bob.FunctionTools([echo]), action_mode="native")
    request = bob.AgentRequest("go")
    gc.collect()
    t0 = time.perf_counter()
    result = rt.run(request)
    assert result.finish_reason is bob.FinishReason.FINAL, result
    return (time.perf_counter() - t0) * 1000


def cancel_ms(n: int) -> float:
    """From a cancel fired as the big reply arrives until run() returns."""
    token = bob.CancelToken()
    sink = CancelOnReply(token)
    rt = bob.AgentRuntime(bob.ScriptedLlm([big_reply(n)]), bob.FunctionTools([echo]),
                          action_mode="native", events=sink)
    gc.collect()
    result = rt.run(bob.AgentRequest("go"), cancel=token)
    assert result.finish_reason is bob.FinishReason.CANCELLED, result
    return (time.perf_counter() - sink.t) * 1000


class Listen:
    """A sink that only listens (so events are built and masked)."""

    def emit(self, event: bob.AgentEvent) -> None:
        pass


HOSTILE = {"```json + 25,000 spaces, no closing fence": "```json" + " " * 25_000 + "x",
           "```json + 100,000 spaces, no closing fence": "```json" + " " * 100_000 + "x",
           "final of 32,000 backslashes, a sink listening":
               '{"type": "final", "content": "' + "\\" * 32_000 + 'x"}'}


def hostile_ms(text: str) -> tuple[float, str]:
    """The turn's time, and cancel -> return for a cancel fired 20 ms into it."""
    final = '{"type": "final", "content": "ok"}'
    rt = bob.AgentRuntime(bob.ScriptedLlm([text, final, final]), events=Listen())
    t0 = time.perf_counter()
    rt.run(bob.AgentRequest("go"))
    turn = (time.perf_counter() - t0) * 1000
    token = bob.CancelToken()   # measured from when the cancel was due: a regex holding the
    timer = threading.Timer(0.02, token.cancel)   # GIL delays the timer thread itself
    rt = bob.AgentRuntime(bob.ScriptedLlm([text, final, final]), events=Listen())
    t1 = time.perf_counter()
    timer.start()
    r = rt.run(bob.AgentRequest("go"), cancel=token)
    late = (time.perf_counter() - t1 - 0.02) * 1000
    timer.cancel()
    return turn, f"{late:.1f} ms, {r.finish_reason.value}" if late > 0 else "ended first"


def main() -> None:
    """Print one line per reply size, then one per hostile text."""
    print(f"bob big replies: median of {REPEATS} runs, Python {sys.version.split()[0]}")
    for n in SIZES:
        turn = statistics.median(turn_ms(n) for _ in range(REPEATS))
        cancel = statistics.median(cancel_ms(n) for _ in range(REPEATS))
        print(f"{n:>7} calls: turn {turn:7.1f} ms, cancel -> return {cancel:6.1f} ms "
              f"(target < 100)")
    for what, text in HOSTILE.items():
        turn, cancel = hostile_ms(text)
        print(f"{what}: turn {turn:7.1f} ms, cancel at 20 ms -> return {cancel} (target < 100)")


if __name__ == "__main__":
    main()
