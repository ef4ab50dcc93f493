"""Real sglang-jax KV bugs replayed against the guarded server (``tests/integrations/replay``):
two of them here: #1504 without and with background CPU load, #994 with it (the load under which
abort mode once let damaged answers through); the whole suite, every bug idle and busy, is
``python -m tests.integrations.replay``.

Per replay: no damaged answer delivered without the abort, no right answer aborted, every damaged
answer named in mode ``log``, and the fixed build gives no damaged answer, no row and no abort.
And the replay is not vacuous: the bug's build fired (the canary recorded rows on it)."""

import pytest

from tests.support.sglang_server import installed_sglang_jax

pytestmark = pytest.mark.integration
if installed_sglang_jax() != "main":
    pytest.skip("the replays need sglang-jax's main branch (BUILD.md)", allow_module_level=True)
import sgl_jax.launch_server  # noqa: E402,F401  (a broken install fails here, it does not skip)

from tests.integrations.replay import runner  # noqa: E402
from tests.integrations.replay.__main__ import failures, table  # noqa: E402
from tests.integrations.replay.bugs import BUGS  # noqa: E402


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("replay")


@pytest.mark.parametrize("key,busy", [("1504", (False, True)), ("994", (True,))])
def test_replay(workdir, key, busy):
    bug = BUGS[key]
    result = runner.run_bug(bug, str(workdir), str(workdir / "logs" / key), phases=busy)
    rows = runner.summarize(bug, result)
    print(table(rows))
    assert failures(rows) == [], table(rows)
    fired = [r for r in result["phases"] if r.build == "bug" and (r.rows or r.named_rids)]
    assert fired, f"#{key}'s build never fired: the replay proves nothing\n{table(rows)}"
