"""sglang-jax's HTTP server with the KV-cache canary in every scheduler: one command.

    python -m jax_kvcanary.integrations.sglang_jax.launch_server --kv-canary log|abort|raise \\
        [--kv-canary-real-data none|partial|all] [--kv-canary-sweep-interval N] \\
        [--kv-canary-inject KIND --kv-canary-inject-step N [--kv-canary-inject-group SWA|DRAFT]] \\
        <sgl_jax.launch_server arguments>

(also installed as ``jax-kvcanary-sglang-jax``). Every argument that is not a ``--kv-canary*``
flag goes to sglang-jax's own parser, and the server is sglang-jax's own ``launch_server``.
``--kv-canary none`` (the default) runs exactly the stock server. Settings the canary cannot cover
are refused before anything starts: one ``kv-canary: ...`` line each, exit code 2.

Exit codes: 0 the server stopped normally; 2 a refused setting or a bad ``--kv-canary*`` flag;
otherwise what sglang-jax's server exits with (with ``--kv-canary raise`` a violation ends the
server: its report is in the log and the exit code is non-zero).
"""

from __future__ import annotations

import argparse
import os
import sys

from .flags import aborts, add_cli_args, config_from_args
from .inject import add_inject_args, spec_from_args


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_kvcanary.integrations.sglang_jax.launch_server", add_help=False,
        description="sglang-jax's HTTP server with the KV-cache canary. Every other argument is "
                    "sglang-jax's (python -m sgl_jax.launch_server --help).",
        epilog="Exit codes: 0 stopped normally; 2 a refused setting or a bad --kv-canary* flag; "
               "otherwise the server's own (with --kv-canary raise, a violation ends the server "
               "with a non-zero code).")
    p.add_argument("-h", "--help", action="store_true", help="show this help and sglang-jax's")
    add_cli_args(p)
    add_inject_args(p)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    ns, rest = p.parse_known_args(argv)
    if ns.help:
        p.print_help()
        print("\nsglang-jax's arguments:\n")
        sys.argv = [sys.argv[0], "--help"]
        from sgl_jax.srt.server_args import ServerArgs
        ServerArgs.from_cli(["--help"])               # prints and exits 0
        return 0
    try:
        config = config_from_args(ns)
        inject = spec_from_args(ns)
    except (TypeError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    if inject is not None and not config.enabled:
        print("kv-canary: --kv-canary-inject needs --kv-canary log, abort or raise",
              file=sys.stderr)
        return 2
    sys.argv = [sys.argv[0]] + rest
    if not config.enabled:                             # exactly the stock server
        from sgl_jax.launch_server import main as stock_main
        stock_main()
        return 0

    from sgl_jax.srt.entrypoints import http_server
    from sgl_jax.srt.server_args import ServerArgs
    from sgl_jax.srt.utils import kill_process_tree

    from .server import guard_engine, model_refusals, refusals

    server_args = ServerArgs.from_cli(rest)
    refused = refusals(server_args, config, inject) or model_refusals(server_args, config, inject)
    if refused:
        for line in refused:
            print(line, file=sys.stderr)
        return 2
    guard_engine(config, inject, abort=aborts(ns))
    try:
        http_server.launch(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
