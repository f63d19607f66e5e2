"""Benchmark: does a small local model finish `get_sum` tasks through bob, native and json mode?

    /work/venv/bin/python bench/small_model.py [--url http://127.0.0.1:8090/v1]
        [--model smollm2-agent] [--json-url URL] [--json-model NAME] [--modes native,json]
        [--one 20] [--two 10] [--timeout 300]

20 one-step tasks ("What is A plus B? Use the get_sum tool.") and 10 two-step ones ("What is
A plus B plus C? ..."; two calls, the second on the first's result), each run as one bob turn
at temperature 0 (seed 0) against any OpenAI-compatible URL. A task succeeds when the final
answer holds the right number. Prints per mode: successes (one-step, two-step), the kinds of
failure (wrong answer, a guard, bob's AgentError on two bad replies, an LlmError), and seconds
per task. With no server up at the URL it says so and exits 0.

The rig (../shared/rig: `./setup.sh` once, then `./start-llm.sh`) serves SmolLM2-135M-Instruct
behind llama-cpp-python: port 8090 is the router (model smollm2-agent: tool results go to the
raw template), 8089 the chatml-function-calling alias, 8091 the raw one.

Sections: 1. Tasks  2. Running a mode  3. Main
"""
from __future__ import annotations

import argparse
import collections
import random
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bob  # noqa: E402


# ---- 1. Tasks -----------------------------------------------------------------------------------

def get_sum(a: float, b: float) -> str:
    """Add two numbers and return their sum."""
    total = a + b
    return f"The sum of {a:g} and {b:g} is {total:g}."


def tasks(one: int, two: int) -> list[tuple[str, int]]:
    """(prompt, expected sum): `one` one-step tasks, then `two` two-step ones; fixed seed."""
    rng = random.Random(24)
    out = []
    for _ in range(one):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        out.append((f"What is {a} plus {b}? Use the get_sum tool.", a + b))
    for _ in range(two):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 99)
        out.append((f"What is {a} plus {b} plus {c}? Use the get_sum tool to add {a} and {b}, "
                    f"then use it again to add {c} to that sum.", a + b + c))
    return out


# ---- 2. Running a mode --------------------------------------------------------------------------

def run_task(llm: bob.OpenAICompatLlm, mode: str, prompt: str, want: int,
             timeout_s: float) -> str:
    """"ok" or the kind of failure."""
    policy = bob.TurnPolicy(turn_timeout_ms=int(timeout_s * 1000), max_steps=6)
    rt = bob.AgentRuntime(llm, bob.FunctionTools([get_sum]), action_mode=mode, policy=policy)
    try:
        result = rt.run(bob.AgentRequest(prompt))
    except bob.AgentError:
        return "AgentError (two bad replies)"
    except bob.LlmError as e:
        return f"LlmError {e.status_code}"
    if result.finish_reason is not bob.FinishReason.FINAL:
        guard = result.guard_reason.value if result.guard_reason else ""
        return f"{result.finish_reason.value} {guard}"
    return "ok" if str(want) in result.content.replace(",", "") else "wrong answer"


def run_mode(mode: str, url: str, model: str, work: list[tuple[str, int]], one: int,
             timeout_s: float) -> None:
    llm = bob.OpenAICompatLlm(f"bench:{model}", base_url=url, temperature=0.0, seed=0,
                              retry_max=1, timeout_s=timeout_s)
    kinds: collections.Counter[str] = collections.Counter()
    wins, seconds = [0, 0], []
    for i, (prompt, want) in enumerate(work):
        t0 = time.perf_counter()
        outcome = run_task(llm, mode, prompt, want, timeout_s)
        seconds.append(time.perf_counter() - t0)
        kinds[outcome] += 1
        wins[i >= one] += outcome == "ok"
        print(f"  {mode} #{i + 1:2}: {outcome:34} {seconds[-1]:6.1f} s", flush=True)
    print(f"bob {mode} mode at {url} ({model}): {sum(wins)}/{len(work)} "
          f"(one-step {wins[0]}/{one}, two-step {wins[1]}/{len(work) - one}); "
          f"{sum(seconds) / len(seconds):.1f} s per task")
    print("  outcomes: " + ", ".join(f"{k}: {n}" for k, n in kinds.most_common()), flush=True)
    llm.close()


# ---- 3. Main ------------------------------------------------------------------------------------

def is_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/models", timeout=3):
            return True
    except OSError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8090/v1")
    p.add_argument("--model", default="smollm2-agent")
    p.add_argument("--json-url", help="json mode's URL (default: --url)")
    p.add_argument("--json-model", help="json mode's model (default: --model)")
    p.add_argument("--modes", default="native,json")
    p.add_argument("--one", type=int, default=20)
    p.add_argument("--two", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per task")
    args = p.parse_args()
    work = tasks(args.one, args.two)
    for mode in args.modes.split(","):
        url = (args.json_url if mode == "json" else None) or args.url
        model = (args.json_model if mode == "json" else None) or args.model
        if not is_up(url):
            print(f"no OpenAI-compatible server at {url}: skipping {mode} mode (start one, "
                  "e.g. ../shared/rig/start-llm.sh, or pass --url)")
            continue
        run_mode(mode, url, model, work, args.one, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
