"""sglang-jax's PD disaggregation on one host for a test: the bootstrap server, a prefill server, a
decode server (both through ``tests.support.launch_with_stand_ins``: the kv-canary launcher with the
CPU stand-ins) and the mini load balancer in front, each a ``Server`` in a process group of its own,
stopped by that group (a prefill engine has survived SIGTERM here: ``Server.stop`` ends with
SIGKILL of the group).

The transfer engine is ``jax_transfer``; sglang-jax refuses a loopback ``--disaggregation-host-ip``,
so the servers get this machine's host name (which may resolve to 127.0.0.1).
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import List, Optional, Sequence

from tests.support.sglang_server import STAND_INS, TINY_ENGINE_ARGS, Server, free_port

#: PD pulls whole pages (page size 128 is sglang-jax's PD bucket); no prefix cache on either side
PD_ENGINE_ARGS = ("--page-size", "128", "--disable-radix-cache", "--chunked-prefill-size", "128",
                  "--precompile-token-paddings", "128")


class PDCluster(contextlib.ExitStack):
    """``with PDCluster(model_dir, tmp_path, prefill_args, decode_args) as pd:`` the four
    processes up; ``pd.router`` takes the requests, ``pd.prefill`` / ``pd.decode`` have the logs.

    Args besides the four: ``name`` (the logs are ``log_dir/NAME-ROLE.log``), ``env`` (added to
    every process's environment), ``engine_args`` (both engines' sglang-jax arguments).
    """

    def __init__(self, model_dir: str, log_dir, prefill_args: Sequence[str] = (),
                 decode_args: Sequence[str] = (), name: str = "pd", env: Optional[dict] = None,
                 engine_args: Sequence[str] = TINY_ENGINE_ARGS + PD_ENGINE_ARGS):
        super().__init__()
        self.model_dir, self.log_dir, self.name, self.env = model_dir, log_dir, name, env
        self.prefill_args, self.decode_args = list(prefill_args), list(decode_args)
        self.engine_args = list(engine_args)
        self.bootstrap = self.prefill = self.decode = self.router = None

    def _log(self, role: str) -> str:
        return os.path.join(str(self.log_dir), f"{self.name}-{role}.log")

    def logs(self) -> List[str]:
        """The prefill and decode servers' logs."""
        return [self.prefill.log(), self.decode.log()]

    def _engine(self, role: str, bootstrap_url: str, args: Sequence[str]) -> Server:
        return Server(["--model-path", self.model_dir, *self.engine_args,
                       "--disaggregation-mode", role,
                       "--disaggregation-bootstrap-url", bootstrap_url,
                       "--disaggregation-transfer-port", str(free_port()),
                       "--disaggregation-side-channel-port", str(free_port()),
                       "--disaggregation-host-ip", socket.gethostname(), *args],
                      self._log(role), module=STAND_INS, env=self.env)

    def __enter__(self) -> "PDCluster":
        super().__enter__()
        try:
            self.bootstrap = self.enter_context(
                Server([], self._log("bootstrap"), env=self.env,
                       module="sgl_jax.srt.disaggregation.run_bootstrap"))
            self.prefill = self.enter_context(
                self._engine("prefill", self.bootstrap.url, self.prefill_args))
            self.decode = self.enter_context(
                self._engine("decode", self.bootstrap.url, self.decode_args))
            self.router = self.enter_context(
                Server(["--pd-disaggregation", "--mini-lb", "--prefill", self.prefill.url,
                        "--decode", self.decode.url], self._log("router"), env=self.env,
                       module="sgl_jax.srt.disaggregation.launch_router"))
        except BaseException:
            self.close()
            raise
        return self
