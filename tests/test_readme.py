"""The README's usage example runs as written and prints what its comments say."""

import os
import re
import subprocess
import sys

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def usage_example() -> str:
    text = open(README, encoding="utf-8").read()
    section = text[text.index("## Usage inside a jitted step"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_usage_example_runs_as_written_and_reports_the_corrupted_slot(tmp_path):
    out = subprocess.run([sys.executable, "-c", usage_example()], cwd=tmp_path, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    assert out.splitlines() == ["TAIL_K_FULL ('verify_real_kv_hash',) 2 1", "1"], out
