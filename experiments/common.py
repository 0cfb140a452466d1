"""Helpers shared by the experiment scripts: the reproducible command line, a timestamped log, JSON results, and
`guard` (a failing variant is recorded, the run goes on)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

_T0 = time.time()


def command_line(out: str) -> str:
    """`python experiments/<script> <args>` with the output directory written as $OUT (no machine-local paths)."""
    args = ["$OUT" if a == out else a.replace(out, "$OUT") if a.startswith("--out=") else a for a in sys.argv[1:]]
    return " ".join(["python", "experiments/" + os.path.basename(sys.argv[0])] + args)


def log(*parts) -> None:
    print(f"[{time.time() - _T0:7.1f}s]", *parts, flush=True)


def save_json(obj, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def guard(errors: list, name: str, fn, *a, **k):
    """fn(*a, **k), or None after logging the failure and appending it to `errors`: one failing variant must not cost
    the whole device call."""
    try:
        return fn(*a, **k)
    except Exception as e:
        msg = f"{name}: {type(e).__name__}: {str(e)[:1500]}"
        log("ERROR", msg)
        traceback.print_exc(limit=4)
        errors.append(msg)
        return None
