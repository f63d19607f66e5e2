"""How fast bob_cli starts: median wall times of `--help` and of reaching the REPL prompt.

    python bench/startup.py            # 10 runs of each; prints a table and the targets
    python bench/startup.py --runs 20

Measured, each as the median of N fresh processes:
    import requests      python -c "import requests"            (the baseline)
    import bob           the import itself, timed inside a fresh process
    import bob_mcp       the same (bob included, no mcp SDK); its own share is the difference
    --help               python bob_cli.py --help
    prompt               spawn -> "bob> " on a pseudo terminal, no MCP server configured
    prompt + MCP         the same with one MCP server (tests/mcp_server.py) configured
    MCP tools ready      spawn -> /tools lists the MCP server's tools (startup in background)
Targets: --help under 1.5x the bare `import requests`; the prompt with MCP under 0.5 s;
`import bob_mcp` under 50 ms.
No network: the config points base_url at 127.0.0.1 and no turn is run.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import pty
import select
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLI = REPO / "bob_cli.py"
CONFIG = """[runtime]
default_model = "openai:bench"
[llm]
base_url = "http://127.0.0.1:9/v1"
api_key_env = "BOB_BENCH_KEY"
"""
MCP = f"""[[mcp.servers]]
id = "bench"
command = "{sys.executable}"
args = ["{REPO / 'tests' / 'mcp_server.py'}"]
"""


def env(home: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "TERM": "dumb",
            "LANG": "C.UTF-8", "BOB_BENCH_KEY": "sk-bench"}


def time_command(argv: list[str], cwd: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=cwd, env=env(cwd), stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def time_import(module: str) -> float:
    """Seconds a fresh process spends in `import module` (interpreter start-up left out)."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(str(REPO)),
                         capture_output=True, text=True, check=True).stdout
    return float(out)


def read_until(fd: int, text: bytes, deadline: float, seen: bytes = b"") -> bytes:
    """Read until `text` shows up; return what came after it."""
    while text not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise RuntimeError(f"{text!r} not seen; got {seen[-300:]!r}")
        seen += os.read(fd, 65536)
    return seen.split(text, 1)[1]


def time_prompt(cwd: str, until_tools: bool = False) -> float:
    """Spawn the REPL on a pty; seconds until the prompt (or until /tools lists MCP tools)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(CLI)], cwd=cwd, env=env(cwd), stdin=slave,
                            stdout=slave, stderr=slave, start_new_session=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))  # noqa
    os.close(slave)
    try:
        read_until(master, b"bob> ", time.monotonic() + 30)
        if until_tools:
            os.write(master, b"/tools\r")
            rest = read_until(master, b"bench__echo", time.monotonic() + 30)
            elapsed = time.perf_counter() - t0
            read_until(master, b"bob> ", time.monotonic() + 30, rest)  # a Ctrl-D typed ahead
        else:                                                          # of the prompt is lost
            elapsed = time.perf_counter() - t0
        os.write(master, b"\x04")                   # Ctrl-D: exit, closing MCP servers
        proc.wait(15)
        return elapsed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def median_of(runs: int, fn, *args) -> float:
    fn(*args)                                       # warm-up: page cache, .pyc files
    return statistics.median(fn(*args) for _ in range(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    n = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as plain, tempfile.TemporaryDirectory() as with_mcp:
        Path(plain, "agent.toml").write_text(CONFIG)
        Path(with_mcp, "agent.toml").write_text(CONFIG + MCP)
        rows = {
            "import requests": median_of(n, time_command,
                                         [sys.executable, "-c", "import requests"], plain),
            "import bob": median_of(n, time_import, "bob"),
            "import bob_mcp": median_of(n, time_import, "bob_mcp"),
            "--help": median_of(n, time_command, [sys.executable, str(CLI), "--help"], plain),
            "prompt": median_of(n, time_prompt, plain),
            "prompt + MCP": median_of(n, time_prompt, with_mcp),
            "MCP tools ready": median_of(max(3, n // 2), time_prompt, with_mcp, True),
        }
    print(f"bob_cli start-up, median of {n} runs (python {sys.version.split()[0]}, "
          f"{os.cpu_count()} cpus)")
    for name, seconds in rows.items():
        print(f"  {name:<18} {seconds * 1000:8.1f} ms")
    ratio = rows["--help"] / rows["import requests"]
    print(f"target --help < 1.5x import requests: {ratio:.2f}x "
          f"{'ok' if ratio < 1.5 else 'MISSED'}")
    print(f"target import bob_mcp < 50 ms: {rows['import bob_mcp'] * 1000:.0f} ms "
          f"{'ok' if rows['import bob_mcp'] < 0.05 else 'MISSED'}")
    print(f"target prompt with MCP < 500 ms: {rows['prompt + MCP'] * 1000:.0f} ms "
          f"{'ok' if rows['prompt + MCP'] < 0.5 else 'MISSED'}")


if __name__ == "__main__":
    main()
