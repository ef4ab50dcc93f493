"""A server of two sglang-jax nodes on this host, for tests: two launcher processes with
``--nnodes 2 --node-rank 0|1 --dist-init-addr 127.0.0.1:PORT`` (one global JAX mesh over both
processes' forced host devices, gloo between them), each in a process group of its own. Node 0
serves HTTP (``Nodes.head``, a ``Server``); node 1 runs its scheduler only. Stopped by their
process groups, never by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Optional, Sequence

from tests.support.sglang_server import LAUNCHER, Server, free_port


class Nodes:
    """``Nodes(args, log_dir, devices=1)``: ``args`` (the launcher's, both nodes) plus the node
    flags; ``devices`` forced host devices per process. Use as a context manager.

    Attributes: ``head`` (node 0's ``Server``: its HTTP client, its log), ``worker`` (node 1's
    process), ``worker_log`` (its log's path).
    """

    def __init__(self, args: Sequence[str], log_dir: str, *, devices: int = 1,
                 env: Optional[dict] = None, module: str = LAUNCHER):
        init = free_port()
        node = lambda rank: ["--nnodes", "2", "--node-rank", str(rank),
                             "--dist-init-addr", f"127.0.0.1:{init}"]
        self.env = dict(env or {}, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        self.head = Server([*args, *node(0)], os.path.join(log_dir, "node0.log"), module=module,
                           env=self.env)
        self.worker_args = [sys.executable, "-m", module, *args, *node(1), "--host", "127.0.0.1",
                            "--port", str(free_port())]
        self.worker_log = os.path.join(log_dir, "node1.log")
        self.worker = None

    def start(self) -> "Nodes":
        env = dict(self.head.env)
        with open(self.worker_log, "w") as log:
            self.worker = subprocess.Popen(self.worker_args, stdout=log, stderr=subprocess.STDOUT,
                                           env=env, start_new_session=True)
        try:
            self.head.start()                  # node 0 is healthy once both have joined
        except BaseException:
            self.stop()
            raise
        return self

    def logs(self) -> list:
        """Both nodes' logs, node 0's first."""
        with open(self.worker_log, errors="replace") as f:
            return [self.head.log(), f.read()]

    def wait(self, timeout: float) -> list:
        """Both processes' exit codes (None for one still running after ``timeout`` s each)."""
        out = [self.head.wait(timeout)]
        try:
            out.append(self.worker.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            out.append(None)
        return out

    def stop(self) -> None:
        self.head.stop()
        if self.worker is not None:
            try:
                os.killpg(self.worker.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.worker.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
