"""Tests of `bob_cli.py replay` as a real subprocess: a trace recorded by the CLI against the fake
OpenAI server and a real MCP server (the hand-written stdio one: it starts in milliseconds),
replayed after the server is gone, with and without --live-tools; a divergence exits 1 with the
report, a cut trace exits 2 naming the line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Together
from fake_openai import FakeOpenAI, tool_calls_reply

REPO = Path(__file__).resolve().parent.parent
CLI = REPO / "bob_cli.py"
MCP_SERVER = REPO / "tests" / "mcp_raw_server.py"
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "BOB_TEST_KEY": "sk-test-key"}


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CLI), *args], cwd=tmp_path, env=ENV, timeout=60,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)


def write_config(tmp_path: Path, url: str, who: str) -> None:
    """Native mode; one MCP server whose env tool answers WHO."""
    (tmp_path / "agent.toml").write_text(
        f'[runtime]\ndefault_model = "openai:test"\naction_mode = "native"\n'
        f'[llm]\nbase_url = "{url}"\napi_key_env = "BOB_TEST_KEY"\nretry_max = 0\n'
        f'[[mcp.servers]]\nid = "t"\ncommand = "{sys.executable}"\n'
        f'args = ["{MCP_SERVER}"]\nenv = {{ WHO = "{who}" }}\n')


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Path:
    """A one-shot turn of the CLI that calls the MCP server's env tool once, recorded once per
    module (a CLI run with an MCP server takes seconds); each test gets its own copy."""
    where = tmp_path_factory.mktemp("recording")
    with FakeOpenAI([tool_calls_reply([("t__env", {"name": "WHO"})]), "it is ann"]) as srv:
        write_config(where, srv.url, "ann")
        run = cli(where, "-p", "who?", "--trace", "t.jsonl")
        assert run.returncode == 0 and run.stdout == "it is ann\n", run.stderr
    return where


@pytest.fixture
def recorded(tmp_path, recording) -> Path:
    """This test's copy of the recorded trace and its config (the server is gone)."""
    for name in ("agent.toml", "t.jsonl"):
        (tmp_path / name).write_bytes((recording / name).read_bytes())
    return tmp_path / "t.jsonl"


@pytest.fixture(scope="module")
def live_runs(tmp_path_factory, recording):
    """The three tests' `replay --live-tools` runs (each starts the MCP server, and the CLI
    imports the MCP SDK: a second of CPU), each in its own copy, started together when the
    first test asks; each test collects its own: live_runs.result("same")."""
    dirs = {key: tmp_path_factory.mktemp(key) for key in ("same", "changed", "renamed")}
    for where in dirs.values():
        for name in ("agent.toml", "t.jsonl"):
            (where / name).write_bytes((recording / name).read_bytes())
    write_config(dirs["changed"], "http://127.0.0.1:9/v1", "bob")   # the tool now says bob
    config = dirs["renamed"] / "agent.toml"
    config.write_text(config.read_text().replace('id = "t"', 'id = "u"'))
    live = [sys.executable, str(CLI), "replay", "t.jsonl", "--live-tools"]
    with Together({"same": [*live, "--config", "agent.toml"], "changed": live, "renamed": live},
                  env=ENV, cwd=dirs) as started:
        yield started


def test_a_cli_trace_replays_without_the_server(tmp_path, recorded, live_runs):
    run = cli(tmp_path, "replay", "t.jsonl")
    assert (run.returncode, run.stdout) == (0, "turn 1: same (2 LLM calls, 1 tool calls, final)\n")
    live = live_runs.result("same")
    assert (live.returncode, live.stdout) == (0, run.stdout), live.stderr


def test_a_changed_live_tool_exits_1_with_the_report(live_runs):
    run = live_runs.result("changed")
    assert run.returncode == 1, run.stderr
    assert run.stdout.splitlines() == [
        "turn 1: DIFFERENT", "turn 1, step 1: tool_call_completed content",
        '  recorded: "ann"', '  new:      "bob"']


def test_an_edited_trace_exits_1_with_the_report(tmp_path, recorded):
    lines = recorded.read_text().splitlines()
    i = next(n for n, line in enumerate(lines) if '"tool_call_completed"' in line)
    event = json.loads(lines[i])
    event["data"]["content"] = "bea"
    lines[i] = json.dumps(event)
    recorded.write_text("\n".join(lines) + "\n")
    run = cli(tmp_path, "replay", "t.jsonl")
    assert run.returncode == 1, run.stderr
    out = run.stdout.splitlines()
    assert out[:2] == ["turn 1: DIFFERENT",
                       "turn 1, step 2: LLM request 2 differs from the recorded"]
    assert out[2].startswith("  recorded: ") and out[3].startswith("  new:      ")
    assert out[4] == "  (the recorded request cannot be rebuilt from the trace)"


def test_a_cut_trace_exits_2_naming_the_line(tmp_path, recorded):
    lines = recorded.read_text().splitlines()
    recorded.write_text("\n".join(lines[:4]) + "\n" + lines[4][:30] + "\n")
    run = cli(tmp_path, "replay", "t.jsonl")
    assert run.returncode == 2 and "t.jsonl line 5 is not a trace event" in run.stderr
    recorded.write_text("\n".join(lines[:4]) + "\n")
    run = cli(tmp_path, "replay", "t.jsonl")
    assert run.returncode == 2 and "starts at line 1 has no turn_completed" in run.stderr
    assert run.stdout == ""


def test_live_tools_renamed_are_named_in_the_report(live_runs):
    # issue 20: which tools were added, removed or changed, not two digests
    run = live_runs.result("renamed")
    assert run.returncode == 1, run.stderr
    report = run.stdout.splitlines()[1]
    assert report.startswith("turn 1, step 0: the tools offered differ: removed: t__")
    assert "t__env" in report and "added: u__" in report and "u__env" in report
