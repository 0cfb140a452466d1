"""The command line experiment scripts record: repo-relative, with the output directory written as $OUT."""

from __future__ import annotations

import sys

from experiments.common import command_line


def test_command_line_hides_the_output_directory(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["experiments/gdn_bench.py", "--out", "runs/gdn", "--budget", "150"])
    assert command_line("runs/gdn") == "python experiments/gdn_bench.py --out $OUT --budget 150"
    monkeypatch.setattr(sys, "argv", ["experiments/moe_bench.py", "--out=runs/moe", "--phases", "bench"])
    assert command_line("runs/moe") == "python experiments/moe_bench.py --out=$OUT --phases bench"
