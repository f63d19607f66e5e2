"""A misbehaving MCP stdio server for bob's tests: what real servers do that they should not.

    python tests/mcp_hostile_server.py --bad-utf8     # invalid UTF-8 on stdout at startup
    python tests/mcp_hostile_server.py --setsid M     # a grandchild in a new session, argv M
    python tests/mcp_hostile_server.py --record F     # `slow` writes when it is cancelled to F
    python tests/mcp_hostile_server.py --close-stdout # close stdout at startup, live on

Tools: `noise` (a garbage line with the secret and invalid UTF-8 on stdout), `echo_env`
(an env variable, in a JSON-escaped error too), `slow` (sleeps; on notifications/cancelled it
writes time.monotonic() to the --record file: CLOCK_MONOTONIC is one clock for all processes).
"""
import argparse
import os
import signal
import subprocess
import sys
import time
import warnings


WIRE = os.dup(1)   # the real stdout: the SDK later points fd 1 at stderr to protect it


def _stdout(data: bytes) -> None:
    os.write(WIRE, data)   # around the SDK's writer: only between messages, as real servers do


def main() -> None:
    warnings.simplefilter("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--bad-utf8", action="store_true")
    p.add_argument("--setsid", default="")
    p.add_argument("--record", default="")
    p.add_argument("--close-stdout", action="store_true", help="close stdout, then live on")
    args = p.parse_args()
    secret = os.environ.get("API_KEY", "")
    if args.bad_utf8:
        _stdout(b"\xff\xfe\xc3 not utf-8\n")
    if args.close_stdout:
        os.close(1)
        os.close(WIRE)
        sys.stdin.buffer.read()   # lives on until the client closes stdin, then ends as the
        os.kill(os.getpid(), signal.SIGTERM)   # SDK's SIGTERM would end it, 2 s later
        time.sleep(60)
    if args.setsid:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", args.setsid],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)

    import anyio
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("bob-hostile", log_level="WARNING")

    @server.tool()
    def noise() -> str:
        """Write garbage and invalid UTF-8 on stdout, then answer."""
        _stdout(f"DEBUG: key is {secret}\n".encode() + b"\x80\xff bad bytes\n")
        return "ok"

    @server.tool()
    def echo_env(name: str) -> str:
        """Return an environment variable."""
        return os.environ.get(name, "(unset)")

    @server.tool()
    def leak(name: str) -> str:
        """Fail with an error that quotes an environment variable as JSON."""
        import json
        raise ToolError(json.dumps({"bad": os.environ.get(name, "")}))

    @server.tool()
    async def slow(seconds: float) -> str:
        """Sleep; if cancelled, record when."""
        if args.record:
            open(args.record + ".started", "w").close()
        try:
            await anyio.sleep(seconds)
        except anyio.get_cancelled_exc_class():
            if args.record:
                with open(args.record + ".tmp", "w") as f:
                    f.write(repr(time.monotonic()))
                os.replace(args.record + ".tmp", args.record)
            raise
        return "slept"

    server.run()


if __name__ == "__main__":
    main()
