"""The command line experiment scripts record: repo-relative, with the output directory written as $OUT."""

from __future__ import annotations

import sys

from experiments.common import command_line


def test_command_line_hides_the_output_directory(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/abs/path/experiments/gdn_bench.py", "--out", "/root/out", "--budget", "150"])
    assert command_line("/root/out") == "python experiments/gdn_bench.py --out $OUT --budget 150"
    monkeypatch.setattr(sys, "argv", ["x/moe_bench.py", "--out=/tmp/o", "--phases", "bench"])
    assert command_line("/tmp/o") == "python experiments/moe_bench.py --out=$OUT --phases bench"
