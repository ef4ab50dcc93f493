"""A real sglang-jax HTTP server started for a test, and a small HTTP client for it.

``Server(args)`` starts ``python -m jax_kvcanary.integrations.sglang_jax.launch_server ARGS`` (or any
module) on 127.0.0.1 in a process group of its own, waits for ``/health`` (bounded), and stops it by
that process group (SIGTERM, then SIGKILL): never by name. Its log is a file the test can read.
The client (``generate``, ``completions``) uses ``urllib``: requests go to that server only, each
with a timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import List, Optional, Sequence

LAUNCHER = "jax_kvcanary.integrations.sglang_jax.launch_server"
REPORT_RE = re.compile(r"kv_canary violation: launch_tag=(\S+) fail_reason=(\S+) slot_idx=(-?\d+)")
PUMPED_RE = re.compile(r"step_when_pumped=(\d+)")
INJECTED_RE = re.compile(r"kv-canary: injected (\S+) at step (\d+)")

#: a tiny engine on the CPU: small pool, one batch bucket of 4 (a short precompile), prefill chunks
#: of 64 tokens
TINY_ENGINE_ARGS = (
    "--device", "cpu", "--attention-backend", "native", "--skip-server-warmup",
    "--max-total-tokens", "2048", "--max-running-requests", "4", "--dtype", "float32",
    "--mem-fraction-static", "0.1", "--precompile-bs-paddings", "4",
    "--precompile-token-paddings", "64", "--chunked-prefill-size", "64",
    "--random-seed", "42", "--context-length", "1024")
#: prompts the server tests send the tiny models, and one that hits the first one's cached prefix
PROMPTS = ["what is the capital of france", "the key value cache holds the keys",
           "numbers like 0 1 2 3 4 5", "alpha beta gamma delta"]
PREFIX_HIT = PROMPTS[0] + " and why did the server answer wrong"
#: the launcher with the CPU stand-ins of sglang-jax's TPU-only kernels in place
#: (``tests/support/launch_with_stand_ins.py``)
STAND_INS = "tests.support.launch_with_stand_ins"


def mixed_requests(srv) -> list:
    """The prompts one at a time, then two batches of four (the second with a prefix hit): each
    reply (a dict), in order."""
    replies = [srv.generate(p, 10) for p in PROMPTS]
    replies += srv.generate(PROMPTS, 10)
    replies += srv.generate([PROMPTS[0], PREFIX_HIT, PROMPTS[2], PROMPTS[1] + " again"], 10)
    return replies


def unguarded_answers(model_dir: str, log_path: str) -> list:
    """The tokens ``mixed_requests`` gets from one process of the tiny engine without the canary
    (the non-overlap scheduler), in order."""
    with Server(["--model-path", model_dir, *TINY_ENGINE_ARGS, "--disable-overlap-schedule",
                 "--kv-canary", "none"], log_path) as srv:
        return [r["output_ids"] for r in mixed_requests(srv)]


def engine_args(attention_backend: str) -> list:
    """``TINY_ENGINE_ARGS`` with ``attention_backend`` instead of ``native``."""
    args = list(TINY_ENGINE_ARGS)
    args[args.index("--attention-backend") + 1] = attention_backend
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: how long ``Server.stop`` waits after SIGTERM before SIGKILL of the process group
STOP_GRACE_S = 1.0


class Server:
    """One server process. ``Server(args, log_path).start()``; use as a context manager.

    Attributes: ``port``, ``url``, ``proc``, ``log_path``, ``start_seconds`` (launch to healthy).
    """

    def __init__(self, args: Sequence[str], log_path: str, *, module: str = LAUNCHER,
                 env: Optional[dict] = None, start_timeout: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", module, *args, "--host", "127.0.0.1",
                     "--port", str(self.port)]
        self.log_path = log_path
        self.env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **(env or {}))
        self.start_timeout = start_timeout
        self.proc = None
        self.start_seconds = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Server":
        t0 = time.monotonic()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
        while time.monotonic() - t0 < self.start_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was "
                                   f"healthy:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.start_seconds = time.monotonic() - t0
                        return self
            except (urllib.error.URLError, ConnectionError, socket.timeout):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {self.start_timeout} s:\n{self.log_tail()}")

    def wait(self, timeout: float) -> Optional[int]:
        """The exit code, or None if it still runs after ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``STOP_GRACE_S``; reaps the
        process. (sglang-jax's launcher takes ~5 s to exit on SIGTERM, in a wait of its own; the
        tests have read what they check by then, and the servers are many.)"""
        if self.proc is None:
            return
        for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 15)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            if self.wait(grace) is not None:
                break
        # the group may outlive its leader (children that ignored SIGTERM)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- the log --------------------------------------------------------------------------------
    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def reports(self) -> List[tuple]:
        """``(tag, reasons, slot, step_when_pumped)`` of every violation report in the log."""
        text = self.log()
        out = []
        for m in REPORT_RE.finditer(text):
            pumped = PUMPED_RE.search(text, m.end())
            out.append((m.group(1), m.group(2), int(m.group(3)),
                        int(pumped.group(1)) if pumped else None))
        return out

    def wait_for_log(self, pattern: str, timeout: float) -> Optional[str]:
        """The first match of the regex ``pattern`` in the log, waiting up to ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.log())
            if m or time.monotonic() > deadline:
                return m.group(0) if m else None
            time.sleep(0.05)

    def injected(self) -> Optional[tuple]:
        """``(kind, step)`` of the fault the launcher planted, or None."""
        m = INJECTED_RE.search(self.log())
        return None if m is None else (m.group(1), int(m.group(2)))

    # -- HTTP -----------------------------------------------------------------------------------
    def post(self, path: str, body: dict, timeout: float = 120.0):
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)

    def get(self, path: str, timeout: float = 30.0) -> str:
        """The body of a GET (e.g. ``/metrics``), as text."""
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read().decode()

    def generate(self, text, max_new_tokens: int = 12, **kw):
        """``/generate`` (greedy): a dict, or a list of dicts for a list of prompts."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0, **kw}
        return self.post("/generate", {"text": text, "sampling_params": params})

    def completions(self, prompt: str, max_tokens: int = 12):
        """``/v1/completions`` (greedy): the response dict."""
        return self.post("/v1/completions", {"model": "tiny", "prompt": prompt,
                                             "max_tokens": max_tokens, "temperature": 0})


def scrape(srv) -> dict:
    """sglang-jax's ``/metrics``, parsed by prometheus_client: ``{(name, labels): value}`` of the
    ``kv_canary_*`` samples."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(srv.get("/metrics"))
            for s in fam.samples if s.name.startswith("kv_canary_")}


def check_acted_on(mode: str, reply: dict, log: str) -> None:
    """A reply whose request read KV the canary reported: aborted with the canary's message (mode
    ``abort``), or its request named in the server ``log`` (mode ``log``)."""
    if mode == "abort":
        finish = reply["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and finish["message"].startswith(
            "kv-canary: request aborted"), finish
    else:
        assert re.search(rf"kv-canary: request rid={reply['meta_info']['id']} read KV", log), \
            log[-3000:]


def installed_sglang_jax() -> Optional[str]:
    """Which sglang-jax is installed, without importing it (importing it imports flax, whose
    switches sglang-jax 0.0.2 needs set first): None, ``'main'`` (its runner has ``MemoryPools``)
    or ``'0.0.2'`` (the release, whose HTTP server cannot serve on the CPU)."""
    import importlib.util

    spec = importlib.util.find_spec("sgl_jax")
    if spec is None or not spec.submodule_search_locations:
        return None
    pool = os.path.join(list(spec.submodule_search_locations)[0], "srt", "mem_cache",
                        "memory_pool.py")
    with open(pool) as f:
        return "main" if "class MemoryPools" in f.read() else "0.0.2"
