"""Mutation test of bob.py's core: would the fast tests notice if this line were wrong?

    nice -n 19 /work/venv/bin/python bench/mutants.py -j3           # every target, ~10 min
    nice -n 19 /work/venv/bin/python bench/mutants.py LoopGuard     # names containing this
    /work/venv/bin/python bench/mutants.py --list                   # the mutants, not run
    .../python bench/mutants.py _remove --tests=tests/test_mutants.py  # only these tests
    MUTANTS_LOG=/tmp/m.log ...                                      # keep pytest's output

A small stdlib mutator (mutmut 3 wants a package layout and copies the project; this needs
neither). It parses bob.py, makes one change at a time inside the TARGETS below, compiles the
changed tree (line numbers kept) and runs the fast library tests (TEST_FILES) against it in a
forked child that already imported pytest, hypothesis and requests: `pytest -x -q -p
no:cacheprovider`. One traced run of the unmutated module first records which tests run which
lines; a mutant runs only the tests that run its statement (`-jN`: N children at a time).
A mutant is killed when a test fails, survives when they all pass, times out past TIMEOUT_S;
a mutant of a line no test runs survives without a run (marked "uncovered").

Operators: a comparison flipped (== to !=, < to >=, in to not in, is to is not ...), and/or
swapped, an if/while/ternary condition negated, a `not` dropped, a statement replaced by
`pass`, a returned value dropped (`return None`), an int constant +1 and -1, True/False
swapped. `assert`s, docstrings and `log.` calls are left alone.

Prints: the unmutated run's time and the number of mutants; each survivor or timeout as it is
found; then `mutants: N  killed: K  survived: S  timeouts: T  run time: M min` and the
survivors, one a line: `bob.py:<line> <function>: <before>  ->  <after>`.
A bench script that prints figures: not a test, not in CI.
"""
from __future__ import annotations

import ast
import json
import os
import signal
import sys
import threading
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "bob.py"
TEST_FILES = ["tests/test_mutants.py", "tests/test_core.py", "tests/test_approval.py",
              "tests/test_scheduler_hostile.py", "tests/test_tools_stores.py",
              "tests/test_sink_surrogates.py", "tests/test_hostile_stores.py",
              "tests/test_hostile_llm.py"]
# Tests left out (none now): a test that fails in a forked child under load, though it passes
# in a normal run, goes here by its node id until it is fixed.
FLAKY: list[str] = []
# Qualified names mutated: a class name means all of its methods.
TARGETS = ["CancelToken", "_json_problem", "parse_action", "_required_str", "LoopGuard",
           "_check_newer", "InMemorySessionStore", "JsonFileSessionStore", "_wait_all", "_call",
           "AgentRuntime", "_Turn", "_raised", "_error", "_too_long"]
SKIP = ["AgentRuntime.health"]   # not part of a turn
TIMEOUT_S = 200.0   # a mutant whose tests run longer than this hangs (the unmutated run: ~20 s,
                    # but its traced run took over 90 s on a loaded 2-core machine and so wrote
                    # no coverage: the whole run stopped)

_FLIP = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt,
         ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
         ast.In: ast.NotIn, ast.NotIn: ast.In}


# ---- 1. Finding the mutation sites --------------------------------------------------------------

def _targets(tree: ast.Module, only: str) -> list[tuple[str, ast.AST]]:
    """(qualified name, function node) of every targeted function, in file order."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in TARGETS:
            found += [(f"{node.name}.{f.name}", f) for f in node.body
                      if isinstance(f, ast.FunctionDef)]
        elif isinstance(node, ast.FunctionDef) and node.name in TARGETS:
            found.append((node.name, node))
    return [(name, f) for name, f in found if only in name and name not in SKIP]


def _skipped(stmt: ast.stmt) -> bool:
    """Statements never mutated: asserts, docstrings, log calls."""
    if isinstance(stmt, ast.Assert):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return True
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "log")


def _sites(fn: ast.AST) -> list[tuple[ast.AST, str, int]]:
    """(node, operator, variant) for every mutation in `fn`, in a fixed walk order."""
    skipped = {id(n) for s in ast.walk(fn) if isinstance(s, ast.stmt) and _skipped(s)
               for n in ast.walk(s)}
    sites: list[tuple[ast.AST, str, int]] = []
    for node in ast.walk(fn):
        if id(node) in skipped or node is fn:
            continue
        if isinstance(node, ast.Return):
            if node.value is not None and not (isinstance(node.value, ast.Constant)
                                               and node.value.value is None):
                sites.append((node, "return_none", 0))
        elif isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.Pass)):
            sites.append((node, "pass", 0))
        if isinstance(node, ast.Compare):
            sites += [(node, "flip", i) for i, op in enumerate(node.ops) if type(op) in _FLIP]
        elif isinstance(node, ast.BoolOp):
            sites.append((node, "andor", 0))
        elif isinstance(node, (ast.If, ast.While, ast.IfExp)) and not (
                isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)):
            sites.append((node, "negate", 0))  # `if not x`: dropping the not is the same
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            sites.append((node, "drop_not", 0))
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            sites.append((node, "bool", 0))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            sites += [(node, "int", 1), (node, "int", -1)]
    return sites


# ---- 2. Applying one mutation -------------------------------------------------------------------

def _replace(fn: ast.AST, old: ast.AST, new: ast.AST) -> None:
    """Put `new` where `old` is, in its parent inside `fn`."""
    for parent in ast.walk(fn):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list) and any(v is old for v in value):
                value[[id(v) for v in value].index(id(old))] = new
                return


def _apply(fn: ast.AST, node: ast.AST, op: str, variant: int) -> ast.AST:
    """Make the change; returns the node now in place (for printing it)."""
    if op == "pass":
        new: ast.AST = ast.copy_location(ast.Pass(), node)
        _replace(fn, node, new)
        return new
    if op == "drop_not":
        _replace(fn, node, node.operand)
        return node.operand
    if op == "return_none":
        node.value = ast.Constant(None)
    elif op == "flip":
        node.ops[variant] = _FLIP[type(node.ops[variant])]()
    elif op == "andor":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif op == "negate":
        node.test = ast.UnaryOp(ast.Not(), node.test)
    elif op == "bool":
        node.value = not node.value
    elif op == "int":
        node.value += variant
    return node


def _mutants(only: str) -> list[tuple[str, int, int, tuple[int, int]]]:
    """(function, site index, line, statement lines) of every mutation of the TARGETS."""
    found = []
    for name, fn in _targets(ast.parse(SOURCE.read_text()), only):
        stmts = [s for s in ast.walk(fn) if isinstance(s, ast.stmt) and s is not fn]
        for k, (node, _, _) in enumerate(_sites(fn)):
            # the innermost statement holding the node: its lines tell whether any test ran it
            holder = min((s for s in stmts if any(n is node for n in ast.walk(s))),
                         key=lambda s: s.end_lineno - s.lineno, default=node)
            found.append((name, k, node.lineno, (holder.lineno, holder.end_lineno)))
    return found


def _mutate(name: str, k: int) -> tuple[ast.Module, str, str]:
    """A fresh tree with mutation k of function `name` applied, and the code before/after."""
    tree = ast.parse(SOURCE.read_text())
    fn = dict(_targets(tree, ""))[name]
    node, op, variant = _sites(fn)[k]
    before = _show(node)
    after = _show(_apply(fn, node, op, variant))
    ast.fix_missing_locations(tree)
    return tree, before, after


def _show(node: ast.AST) -> str:
    text = ast.unparse(node).splitlines() or [""]
    one = text[0] + (" ..." if len(text) > 1 else "")
    return one if len(one) <= 70 else one[:67] + "..."


# ---- 3. Running the tests against a mutant ------------------------------------------------------

def _load(tree: ast.Module | None) -> None:
    """Install bob (mutated if `tree`) as sys.modules['bob'] before the tests import it."""
    code = compile(tree or ast.parse(SOURCE.read_text()), str(SOURCE), "exec")
    mod = types.ModuleType("bob")
    mod.__file__ = str(SOURCE)
    sys.modules["bob"] = mod
    exec(code, mod.__dict__)


def _child(tree: ast.Module | None, tests: list[str], trace: str | None) -> None:
    """In a forked child: load the module, run pytest quietly, exit with its status."""
    import pytest
    signal.alarm(int(TIMEOUT_S))
    log = os.environ.get("MUTANTS_LOG", os.devnull)  # a file to see what pytest said
    devnull = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        _load(tree)
        tracer = _Tracer() if trace else None
        stop = [] if trace else ["-x"]  # tracing slows threads: a race may fail, run all
        rc = pytest.main([*tests, *stop, "-q", "-p", "no:cacheprovider",
                          *(f"--deselect={t}" for t in FLAKY)],
                         plugins=[tracer] if tracer else [])
        if tracer:
            Path(trace).write_text(json.dumps({k: sorted(v) for k, v in tracer.lines.items()}))
    except BaseException:
        rc = 3
    os._exit(int(rc))


class _Tracer:
    """A pytest plugin: the lines of bob.py each test runs (in any thread, while it runs)."""

    def __init__(self) -> None:
        self.lines: dict[str, set[int]] = {}
        self.now: set[int] = set()
        src = str(SOURCE)

        def local(frame, event, arg):
            if event == "line":
                self.now.add(frame.f_lineno)
            return local

        def glob(frame, event, arg):
            return local if frame.f_code.co_filename == src else None

        sys.settrace(glob)
        threading.settrace(glob)

    def pytest_runtest_logstart(self, nodeid: str, location: object) -> None:
        self.now = self.lines.setdefault(nodeid, set())


def _start(tree: ast.Module | None, tests: list[str], trace: str | None = None) -> int:
    """Fork a child running `tests` against `tree` (None: the unmutated module); its pid.
    With `trace`, the child writes the lines of bob.py each test ran to that file, as JSON."""
    pid = os.fork()
    if pid == 0:
        _child(tree, tests, trace)
    return pid


def _outcome(status: int) -> str:
    """'killed', 'survived' or 'timeout', from a child's wait status."""
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM:
        return "timeout"
    return "survived" if os.waitstatus_to_exitcode(status) == 0 else "killed"


def _run(tree: ast.Module | None, tests: list[str], trace: str | None = None) -> str:
    """One child, waited for."""
    return _outcome(os.waitpid(_start(tree, tests, trace), 0)[1])


# ---- 4. Main ------------------------------------------------------------------------------------

def _coverage(files: list[str]) -> dict[str, set[int]] | None:
    """The lines of bob.py each test runs, from a traced run; None if the tests fail unmutated
    (twice: one failure may be a flake)."""
    if _run(None, files) != "survived" and _run(None, files) != "survived":
        return None
    trace = f"/tmp/bob-mutants-lines-{os.getpid()}.json"
    _run(None, files, trace)
    by_test = {k: set(v) for k, v in json.loads(Path(trace).read_text()).items()}
    os.unlink(trace)
    return by_test


def _run_all(mutants: list, by_test: dict[str, set[int]], jobs: int
             ) -> tuple[dict[str, int], list[str]]:
    """Run every mutant, `jobs` at a time; the counts by outcome and the survivors in order."""
    counts, survivors = {"killed": 0, "survived": 0, "timeout": 0}, []
    running: dict[int, tuple[int, str]] = {}   # pid -> (mutant number, what it changed)

    def record(i: int, what: str, outcome: str) -> None:
        counts[outcome] += 1
        if outcome == "survived":
            survivors.append((i, what))
        if outcome != "killed":
            print(f"  [{i}/{len(mutants)}] {outcome.upper()} {what}", flush=True)

    for i, (name, k, line, (first, last)) in enumerate(mutants, 1):
        tree, before, after = _mutate(name, k)
        span = set(range(first, last + 1))
        tests = [t for t, lines in by_test.items() if lines & span]  # in run order
        what = f"bob.py:{line} {name}: {before}  ->  {after}" + ("" if tests else " [uncovered]")
        if not tests:
            record(i, what, "survived")
            continue
        while len(running) >= jobs:
            pid, status = os.wait()
            record(*running.pop(pid), _outcome(status))
        running[_start(tree, tests)] = (i, what)
    while running:
        pid, status = os.wait()
        record(*running.pop(pid), _outcome(status))
    return counts, [w for _, w in sorted(survivors)]


def main(argv: list[str]) -> int:
    os.chdir(ROOT)
    only = next((a for a in argv if not a.startswith("-")), "")
    jobs = int(next((a[2:] for a in argv if a.startswith("-j")), "1") or 1)
    files = next((a[8:].split(",") for a in argv if a.startswith("--tests=")), TEST_FILES)
    mutants = _mutants(only)
    if "--list" in argv:
        for name, k, line, _ in mutants:
            _, before, after = _mutate(name, k)
            print(f"bob.py:{line} {name}: {before}  ->  {after}")
        print(f"{len(mutants)} mutants")
        return 0
    import hypothesis  # noqa: F401  (imported once here; every forked child reuses them)
    import pytest  # noqa: F401
    import requests  # noqa: F401
    t0 = time.monotonic()
    by_test = _coverage(files)
    if by_test is None:
        print("the unmutated tests fail (twice): fix them first", file=sys.stderr)
        return 2
    print(f"unmutated run: {time.monotonic() - t0:.1f} s; {len(mutants)} mutants", flush=True)
    counts, survivors = _run_all(mutants, by_test, jobs)
    print(f"\nmutants: {len(mutants)}  killed: {counts['killed']}  survived: "
          f"{counts['survived']}  timeouts: {counts['timeout']}  "
          f"run time: {(time.monotonic() - t0) / 60:.1f} min")
    print("survivors:" if survivors else "no survivors")
    for line in survivors:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
