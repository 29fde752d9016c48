#!/usr/bin/env python3
"""gemma4-t4 MCP server: deploy and benchmark all-4-bit Gemma 4 builds with vLLM, one typed tool per step.

Run:  python server.py                      (stdio, what MCP clients launch)
      python server.py --http [--port 8765]  (streamable HTTP on 127.0.0.1, bearer token required)
      --toolsets repack,serve,...            (or $GEMMA4_T4_TOOLSETS; default: the article's workflow)

This file only parses arguments, builds the app (tools/mcp/app.py, tools declared in tools/mcp/*_tools.py)
and runs it. The process never imports vllm or torch (vLLM runs as its own process).
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

# `python /path/to/server.py` from any directory: the project's packages sit next to this file, and it runs on the
# project's virtualenv whatever `python` started it (tools/core/project_python.py).
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from tools.core.project_python import missing_packages, on_project_venv  # noqa: E402  (standard library only)

if __name__ == "__main__":
    on_project_venv(__file__)

try:
    from tools.core.paths import Roots  # noqa: E402
    from tools.core.process import stdout_gone  # noqa: E402
    from tools.core.root import PROJECT_ROOT  # noqa: E402
    from tools.mcp.registry import DEFAULT_TOOLSETS, TOOLSETS, TOOLSETS_ENV, parse_toolsets  # noqa: E402
except ImportError as _exc:  # a Python without the project's packages, and no .venv beside this file
    raise missing_packages(__file__, _exc) from None

if TYPE_CHECKING:
    from tools.mcp.app import Settings, create_server

__all__ = ["Settings", "create_server", "main", "parse_args"]


def _app() -> Any:
    """The MCP app (tools/mcp/app.py, fastmcp: over a second of imports), loaded once the arguments are checked:
    a bad port or token is answered at once."""
    import tools.mcp.app

    return tools.mcp.app


def __getattr__(name: str) -> Any:
    if name in ("Settings", "create_server", "install_sigterm"):
        return getattr(_app(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

TOKEN_ENV = "GEMMA4_T4_MCP_TOKEN"
MIN_TOKEN_CHARS = 32
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def bearer_verifier(token: str) -> Any:
    """A constant-time check of one static bearer token (fastmcp's TokenVerifier interface)."""
    from fastmcp.server.auth import TokenVerifier
    from fastmcp.server.auth.auth import AccessToken

    expected = token.encode()

    class _Static(TokenVerifier):
        async def verify_token(self, presented: str) -> AccessToken | None:
            if not presented or not hmac.compare_digest(presented.encode(), expected):
                return None
            return AccessToken(token=presented, client_id="gemma4-t4-client", scopes=[], expires_at=None)

    return _Static()


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (1-65535)")
    return value


def _toolsets(text: str) -> tuple[str, ...]:
    try:
        return parse_toolsets(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="server.py", description="gemma4-t4 MCP server (stdio by default).")
    p.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio (bearer token)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8765, help="HTTP port (default 8765)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a Host header (and http(s)://NAME origin) accepted besides the loopback names "
                        "(repeatable); anything else gets 403")
    p.add_argument("--token-env", default=TOKEN_ENV,
                   help=f"environment variable holding the HTTP bearer token, at least {MIN_TOKEN_CHARS} "
                        f"characters (default {TOKEN_ENV}); if unset a random token is generated and printed")
    p.add_argument("--toolsets", type=_toolsets, default=None,
                   help=f"comma-separated toolsets to list: {', '.join(TOOLSETS)} or all (default "
                        f"${TOOLSETS_ENV}, else {','.join(DEFAULT_TOOLSETS)})")
    p.add_argument("--models-root", action="append", metavar="DIR",
                   help="folder tools may read/write checkpoints under (repeatable; default ./models or "
                        "$GEMMA4_T4_MODELS_ROOTS)")
    p.add_argument("--evidence-root", action="append", metavar="DIR",
                   help="folder for results and reports (repeatable; default ./evidence or $GEMMA4_T4_EVIDENCE_ROOTS)")
    p.add_argument("--env-file", type=Path, default=None, help="serving config (default: the project's tpu.env)")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="where the started vLLM server's state and log live (default from the serving config)")
    return p.parse_args(argv)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _host_origin_lists(port: int, extra: list[str]) -> tuple[list[str], list[str]]:
    """Host headers and Origins accepted (DNS-rebinding protection): the loopback names and --allowed-host.

    fastmcp's guard answers a foreign Host with 421 and a foreign Origin with 403.
    """
    names = [*LOOPBACK_NAMES, *extra]
    origins = [f"{scheme}://{n}{suffix}" for n in names for scheme in ("http", "https")
               for suffix in ("", f":{port}")]
    return names, origins


def _http_token(args: argparse.Namespace) -> str | None:
    """The bearer token (generated and printed if none is configured), with the plaintext warning; None, said in
    one line, when the configured one is too short."""
    token = os.environ.get(args.token_env, "").strip()
    if token and len(token) < MIN_TOKEN_CHARS:
        print(f"server.py: ${args.token_env} is {len(token)} characters; use a token of at least "
              f"{MIN_TOKEN_CHARS} (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')",
              file=sys.stderr)
        return None
    if not token:
        token = secrets.token_urlsafe(32)
        print(f"server.py: no ${args.token_env}; bearer token for this run: {token}", file=sys.stderr, flush=True)
    if not _is_loopback(args.host):
        print(f"server.py: warning: listening on {args.host}, not loopback: the transport is plaintext HTTP, so "
              "the bearer token and every result cross the network unencrypted; put TLS in front of it",
              file=sys.stderr, flush=True)
    return token


def _client_gone(exc: BaseException) -> bool:
    """Whether `exc` (the stdio transport's, often an exception group) says only that the client went away: its
    pipes closed under an answer being written. Not a failure of the server: nothing to print."""
    from anyio import BrokenResourceError, ClosedResourceError

    gone = (BrokenPipeError, ConnectionResetError, BrokenResourceError, ClosedResourceError)
    if isinstance(exc, BaseExceptionGroup):
        return all(_client_gone(e) for e in exc.exceptions)
    return isinstance(exc, gone)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.http:  # a bad token is refused before the app loads
        token = _http_token(args)
        if token is None:
            return 2
    app = _app()
    overrides: dict[str, Any] = {}
    if args.state_dir is not None:
        overrides["state_dir"] = str(args.state_dir)
    settings = app.Settings(roots=Roots.from_env(args.models_root, args.evidence_root), env_file=args.env_file,
                        config_overrides=overrides)
    if not args.http:
        mcp = app.create_server(settings, toolsets=args.toolsets)
        app.install_sigterm(mcp.gemma)  # type: ignore[attr-defined]
        try:
            mcp.run("stdio", show_banner=False)
        except BaseException as exc:
            if not _client_gone(exc):
                raise
            stdout_gone()  # its answers have nowhere to go: nor has the interpreter's last flush
        finally:  # the client closed stdin: a job still running goes with this process, cleaned up
            mcp.gemma.shutdown()  # type: ignore[attr-defined]
        return 0
    mcp = app.create_server(settings, auth=bearer_verifier(token), toolsets=args.toolsets)
    hosts, origins = _host_origin_lists(args.port, args.allowed_host)
    print(f"server.py: MCP over HTTP at http://{args.host}:{args.port}/mcp (Authorization: Bearer ...)",
          file=sys.stderr, flush=True)
    try:  # uvicorn handles SIGTERM itself (a graceful stop); the jobs are cancelled once it returns
        mcp.run("http", show_banner=False, host=args.host, port=args.port, host_origin_protection=True,
                allowed_hosts=hosts, allowed_origins=origins)
    finally:
        mcp.gemma.shutdown()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
