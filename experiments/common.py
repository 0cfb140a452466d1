"""Helpers shared by the experiment scripts: the reproducible command line, a timestamped log, JSON results, and
`guard` (a failing variant is recorded, the run goes on). Importing it applies the server's default XLA flags
(drama3_jax/xla_flags.py) where XLA_FLAGS does not set them, so the scripts measure what the server runs; every
script imports it before its first device use."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
import traceback

from drama3_jax.xla_flags import apply_default_xla_flags

apply_default_xla_flags()
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


def category_of(op_name: str, categories: tuple[str, ...]) -> str:
    """The first of `categories` (named scopes) on a kernel's op_name path, else "other"."""
    parts = op_name.split("/")
    for c in categories:
        if c in parts:
            return c
    return "other"


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


def patched(patches) -> contextlib.ExitStack:
    """Apply (module, attr, key, value) patches until the returned stack is closed: key None replaces the module
    attribute by value; else the dict attribute's entry `key` is updated with the dict `value`. A jitted function
    must be traced while they hold (after jax.clear_caches() when it was traced before)."""
    from unittest import mock
    stack = contextlib.ExitStack()
    for module, attr, key, value in patches:
        mod = importlib.import_module(module)
        if key is None:
            stack.enter_context(mock.patch.object(mod, attr, value))
        else:
            table = getattr(mod, attr)
            stack.enter_context(mock.patch.dict(table, {key: table[key] | value}))
    return stack
