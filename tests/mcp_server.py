"""A small real MCP server for bob's tests and benchmark, over stdio or streamable HTTP.

    python tests/mcp_server.py                      # stdio
    python tests/mcp_server.py --http 8765          # streamable HTTP on 127.0.0.1:8765/mcp
    python tests/mcp_server.py --fail               # print an error on stderr and exit 3
    python tests/mcp_server.py --hang               # never answer the handshake
    python tests/mcp_server.py --child              # also spawn a long-lived grandchild

`--marker X` is ignored by the server; tests pass a unique one to find its processes in /proc.

Sections:
    1. Startup modes that never reach MCP (kept before the mcp import, so they are fast)
    2. The tools
    3. Main
"""
import argparse
import os
import subprocess
import sys
import warnings


# ---- 1. Startup modes that never reach MCP ----

def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--http", type=int, default=0, help="serve streamable HTTP on this port")
    p.add_argument("--marker", default="", help="ignored; lets tests find this process")
    p.add_argument("--fail", action="store_true", help="exit at once with an error")
    p.add_argument("--hang", action="store_true", help="read stdin, never answer")
    p.add_argument("--child", action="store_true", help="spawn a sleeping grandchild")
    p.add_argument("--extra", action="append", default=[], help="one more tool with this name")
    return p.parse_args()


def _early_exit(args: argparse.Namespace) -> None:
    if args.fail:
        print("mcp_server: fatal: cannot open database 'nowhere.db'", file=sys.stderr, flush=True)
        sys.exit(3)
    if args.hang:
        print("mcp_server: hanging on purpose", file=sys.stderr, flush=True)
        for _ in sys.stdin:   # exit at stdin EOF, like a well-behaved server
            pass
        sys.exit(0)
    if args.child:  # a grandchild that holds only stderr, like `npx` spawning node
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", args.marker],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


# ---- 2. The tools ----

def _build_server(extra_tools: list[str]):  # noqa: C901 - one flat list of tools reads best
    import base64

    import anyio
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp.types import (CallToolResult, ImageContent, SamplingMessage, TextContent)

    server = MCPServer("bob-test", log_level="WARNING")

    @server.tool()
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    @server.tool()
    def pid() -> int:
        """Return the server's process id."""
        return os.getpid()

    @server.tool()
    def env(name: str) -> str:
        """Return an environment variable of the server process."""
        return os.environ.get(name, "(unset)")

    @server.tool()
    def header(name: str, ctx: Context) -> str:
        """Return an HTTP request header (HTTP transport only)."""
        return (ctx.headers or {}).get(name.lower(), "(none)")

    for name in extra_tools:   # odd names, to test how bob exposes them
        server.add_tool(lambda name=name: f"I am {name}", name=name, description="Says its name.")

    @server.tool()
    def structured(n: int) -> CallToolResult:
        """Return only structured content."""
        return CallToolResult(content=[], structured_content={"n": n, "square": n * n})

    @server.tool()
    def picture() -> CallToolResult:
        """Return a text block and an image block."""
        png = base64.b64encode(b"\x89PNG" + b"\0" * 96).decode()
        return CallToolResult(content=[TextContent(type="text", text="a picture"),
                                       ImageContent(type="image", data=png, mime_type="image/png")])

    @server.tool()
    def fail(message: str) -> str:
        """Fail with the message."""
        raise ToolError(message)

    @server.tool()
    def shout(text: str) -> str:
        """Write the text on stderr."""
        print(text, file=sys.stderr, flush=True)
        return "ok"

    @server.tool()
    def rpc_error(code: int) -> str:
        """Answer with a JSON-RPC error of this code (-32000 is a server's generic one)."""
        from mcp import MCPError
        raise MCPError(code, f"server-side problem (code {code})")

    @server.tool()
    async def slow(seconds: float) -> str:
        """Sleep, then answer."""
        await anyio.sleep(seconds)
        return "slept"

    @server.tool()
    def die(code: int) -> str:
        """Exit the server process at once."""
        print(f"mcp_server: dying with code {code}", file=sys.stderr, flush=True)
        os._exit(code)

    @server.tool()
    async def grow(name: str, ctx: Context) -> str:
        """Add a tool called `name` and tell the client the list changed."""
        def added() -> str:
            return f"{name} works"
        server.add_tool(added, name=name, description="Added at run time.")
        await ctx.session.send_tool_list_changed()
        return "added"

    @server.tool()
    async def roots(ctx: Context) -> str:
        """Ask the client for its roots and return their URIs."""
        result = await ctx.session.list_roots()
        return "\n".join(str(r.uri) for r in result.roots)

    @server.tool()
    async def sample(ctx: Context) -> str:
        """Ask the client to sample; report how it answered."""
        try:
            msg = SamplingMessage(role="user", content=TextContent(type="text", text="hi"))
            await ctx.session.create_message([msg], max_tokens=5)
        except Exception as e:  # the client is expected to decline
            return f"declined: {e}"
        return "sampled"

    return server


# ---- 3. Main ----

def main() -> None:
    warnings.simplefilter("ignore")   # roots and sampling are deprecated in MCP 2026; we test them
    args = _parse_args()
    _early_exit(args)
    server = _build_server(args.extra)
    if args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.http)
    else:
        server.run()


if __name__ == "__main__":
    main()
