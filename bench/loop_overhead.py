"""Benchmark: what bob's scheduler itself costs per step, with no I/O at all.

    python bench/loop_overhead.py                 # the table
    python bench/loop_overhead.py --profile 50    # plus a cProfile of the 50-message case

A turn here is STEPS steps: STEPS-1 tool calls to a trivial FunctionTools function, then a final
answer, all from ScriptedLlm, over a history pre-filled with H messages (AgentRequest(history=...),
a realistic mix of questions, answers and tool-call units). Each step adds two messages, so the
history during a turn runs from H to H + 2 * STEPS. Printed: microseconds per step (turn time /
steps), the median of several repeats, with max_history_messages high enough to send everything
("all sent") and at the default cap of 50 ("cap 50"). Those include what a turn costs once (the
history copied, checked and saved), spread over its steps; the last column is the cost of one
more step alone, at the default cap, in CPU time of the loop's thread (so other processes on the
machine hardly move it): (turn of 4 x steps - turn of steps) / (3 x steps), from the minima of
the repeats ("step alone").

Targets: under 200 us per step at 50 messages; with the default cap the cost per step the same at
20, 100 and 1,000 messages of history (issue 20: a step no longer re-walks the whole history).
With everything sent a step still builds a request of all H messages, so that column grows.

Sections: 1. Setup  2. Measure  3. Report
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bob  # noqa: E402  (after the path line, so the bench runs from a plain checkout)

SIZES = (20, 50, 100, 1000)
TARGET_US = 200.0


# ---- 1. Setup -----------------------------------------------------------------------------------

def echo(x: int) -> str:
    """Return x as text."""
    return f"echo {x}"


def prefilled_history(n: int) -> list[bob.Message]:
    """n messages: question, tool-call unit (call + result), answer, repeated."""
    out: list[bob.Message] = []
    i = 0
    while len(out) < n:
        call = bob.ToolCall(f"old_{i}", "echo", {"x": i})
        unit = [bob.Message("user", f"Question {i}: what does echo say for {i}? " * 2),
                bob.Message("assistant", "", (call,)),
                bob.Message("tool", f"echo {i}", tool_call_id=call.id, name="echo"),
                bob.Message("assistant", f"It says echo {i}. " * 3)]
        out += unit[: n - len(out)]
        i += 1
    if out and out[-1].role == "assistant" and out[-1].tool_calls:
        out[-1] = bob.Message("assistant", "cut here")   # never end on a call without result
    return out


def make_turn(history_len: int, steps: int, cap: int | None):
    """A runtime and a request ready to run one turn of `steps` steps."""
    replies = [json.dumps({"type": "tool_call", "name": "echo", "arguments": {"x": i}})
               for i in range(steps - 1)]
    replies.append(json.dumps({"type": "final", "content": "done"}))
    history = prefilled_history(history_len)
    limit = cap if cap is not None else history_len + 2 * steps + 10
    policy = bob.TurnPolicy(max_steps=steps, max_tool_calls=steps, max_history_messages=limit)
    runtime = bob.AgentRuntime(bob.ScriptedLlm(replies), bob.FunctionTools([echo]), policy=policy)
    return runtime, bob.AgentRequest("go", history=history)


# ---- 2. Measure ---------------------------------------------------------------------------------

def us_per_step(history_len: int, steps: int, cap: int | None, repeats: int
                ) -> tuple[float, float]:
    """Median and minimum over `repeats` turns of (turn wall time / steps), in microseconds."""
    samples = []
    for _ in range(repeats):
        runtime, request = make_turn(history_len, steps, cap)
        gc.collect()
        t0 = time.perf_counter()
        result = runtime.run(request)
        elapsed = time.perf_counter() - t0
        assert result.finish_reason is bob.FinishReason.FINAL and result.steps == steps, result
        samples.append(elapsed / steps * 1e6)
    return statistics.median(samples), min(samples)


def turn_cpu_s(history_len: int, steps: int, repeats: int) -> float:
    """The least CPU time of the loop's thread over `repeats` turns, default cap, in seconds."""
    samples = []
    for _ in range(repeats):
        runtime, request = make_turn(history_len, steps, 50)
        gc.collect()
        t0 = time.thread_time()
        runtime.run(request)
        samples.append(time.thread_time() - t0)
    return min(samples)


def marginal_us(history_len: int, steps: int, repeats: int) -> float:
    """The cost of one more step at the default cap, in microseconds (see the docstring)."""
    short = turn_cpu_s(history_len, steps, repeats)
    long = turn_cpu_s(history_len, 4 * steps, repeats)
    return (long - short) / (3 * steps) * 1e6


def profile(history_len: int, steps: int, cap: int | None, top: int = 18) -> str:
    """cProfile of a few turns; the functions with the most cumulative time."""
    prof = cProfile.Profile()
    for _ in range(20):
        runtime, request = make_turn(history_len, steps, cap)
        prof.enable()
        runtime.run(request)
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


# ---- 3. Report ----------------------------------------------------------------------------------

def main() -> None:
    """Print the table (and a profile when asked)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="steps per turn (default 10)")
    ap.add_argument("--repeats", type=int, default=15, help="turns per figure (default 15)")
    ap.add_argument("--profile", type=int, metavar="H", help="also profile the H-message case")
    args = ap.parse_args()
    us_per_step(20, args.steps, None, 5)  # warm up imports and caches
    print(f"bob loop overhead: {args.steps} steps per turn, median of {args.repeats} turns, "
          f"Python {sys.version.split()[0]}")
    print("us per step, median (min); the min shows the cost without noise from other processes")
    print(f"{'history':>8} {'all sent':>18} {'cap 50':>18} {'step alone':>11}")
    figures, alone = {}, {}
    for h in SIZES:
        (med, low), (cmed, clow) = (us_per_step(h, args.steps, None, args.repeats),
                                    us_per_step(h, args.steps, 50, args.repeats))
        figures[h], alone[h] = med, marginal_us(h, args.steps, args.repeats)
        print(f"{h:>8} {med:>10.1f} ({low:5.1f}) {cmed:>10.1f} ({clow:5.1f}) {alone[h]:>11.1f}")
    at50 = figures[50]
    print(f"at 50 messages: {at50:.1f} us/step (target < {TARGET_US:.0f}): "
          f"{'OK' if at50 < TARGET_US else 'OVER'}")
    ratio = alone[1000] / alone[20]
    print(f"one step alone at 1,000 vs 20 messages of history: {ratio:.2f}x "
          f"(target: flat, about 1.0x): {'OK' if ratio < 1.2 else 'GROWS'}")
    if args.profile:
        print(profile(args.profile, args.steps, None))


if __name__ == "__main__":
    main()
