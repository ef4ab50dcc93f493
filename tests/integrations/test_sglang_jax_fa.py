"""The ``fa`` attention backend (what sglang-jax users run on TPUs: page-aligned page tables, the
fused KV buffer in pages) guarded in sglang-jax's own HTTP server.

sglang-jax's ``fa`` kernel runs on TPUs only, and on the CPU its model runner switches ``fa`` back to
``native``; these servers keep ``fa`` with the CPU stand-in of its kernel
(``tests/support/cpu_stand_ins.py``: a plain-JAX ragged paged attention, checked against sglang-jax's
own reference in ``test_cpu_stand_ins.py``), started by ``tests.support.launch_with_stand_ins``.
The reference answers are the ``native`` backend's.
"""

import re

import pytest

from tests.support.sglang_server import (PREFIX_HIT, PROMPTS, STAND_INS, Server, check_acted_on,
                                        engine_args, installed_sglang_jax)

pytestmark = pytest.mark.integration
if installed_sglang_jax() != "main":
    pytest.skip("these tests need sglang-jax's main branch (BUILD.md)", allow_module_level=True)

from tests.support.tiny_qwen2 import write_tiny_qwen2  # noqa: E402

LONG = " ".join(["a canary record per slot holds the token, its position and a hash"] * 10)
TOKEN_FLAGS = ("--kv-canary-write-input-assert", "--kv-canary-token-check")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2")))


def server(model_dir, tmp_path, backend, page_size, *args, name):
    return Server(["--model-path", model_dir, *engine_args(backend), "--page-size", str(page_size),
                   *args],
                  str(tmp_path / f"{name}.log"), module=STAND_INS)


def answers(srv) -> list:
    """Output ids: one request at a time (a prefix hit, a chunked prefill among them), then four
    prompts in one ``/generate`` (a batch)."""
    out = [srv.generate(PROMPTS[0], 12)["output_ids"], srv.generate(PREFIX_HIT, 8)["output_ids"],
           srv.generate(LONG, 6)["output_ids"]]
    return out + [r["output_ids"] for r in srv.generate(PROMPTS, 10)]


def backend_line(srv) -> str:
    m = re.search(r"kv-canary: installed \(.*?, (\w+) attention, page size (\d+)", srv.log())
    return m and f"{m.group(1)} {m.group(2)}"


@pytest.fixture(scope="module")
def native(model_dir, tmp_path_factory):
    """The stock server on the ``native`` backend (page size 1)."""
    with server(model_dir, tmp_path_factory.mktemp("native"), "native", 1, "--kv-canary", "none",
                name="native") as srv:
        return answers(srv)


def test_the_fa_stand_in_answers_as_the_native_backend(model_dir, native, tmp_path):
    """The stock server on ``fa`` (with the stand-in) gives the native backend's tokens."""
    with server(model_dir, tmp_path, "fa", 1, "--kv-canary", "none", name="fa") as srv:
        got = answers(srv)
        log = srv.log()
    assert "falling back to native" not in log and "kv-canary" not in log
    assert got == native


@pytest.mark.parametrize("page_size", [1, 4])
def test_fa_is_guarded_with_the_stock_tokens(model_dir, native, tmp_path, page_size):
    """The canary on ``fa`` (its layout: the fused buffer in pages, page-aligned tables), with the
    write-input assert and the token check: the stock tokens, no report."""
    with server(model_dir, tmp_path, "fa", page_size, "--kv-canary", "log", *TOKEN_FLAGS,
                name=f"fa-{page_size}") as srv:
        got = answers(srv)
        reports, line, log = srv.reports(), backend_line(srv), srv.log()
    assert line == f"fa {page_size}", log[-3000:]
    assert reports == [] and "Traceback" not in log, log[-3000:]
    assert got == native


@pytest.mark.parametrize("kind,page_size,mode", [("real_kv_used", 4, "abort")])
def test_faults_on_fa_are_reported(model_dir, tmp_path, kind, page_size, mode):
    """A flipped KV byte on ``fa`` (page size 4): reported within two steps of the fault, and the
    request that reads it ends with the canary's abort (mode log names it instead)."""
    with server(model_dir, tmp_path, "fa", page_size, "--kv-canary", mode,
                "--kv-canary-inject", kind, "--kv-canary-inject-step", "3",
                name=f"{kind}-{page_size}") as srv:
        reply = srv.generate(LONG, 24)
        injected, reports, log = srv.injected(), srv.reports(), srv.log()
    assert injected is not None and injected[0] == kind, log[-3000:]
    assert reports and min(p for _, _, _, p in reports) <= injected[1] + 2, reports
    check_acted_on(mode, reply, log)
