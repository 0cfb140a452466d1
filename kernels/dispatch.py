"""Backend selection shared by every op's api.py."""

from __future__ import annotations

import jax


def pick_backend(table: dict, backend: str, op: str, auto: str | None = None):
    """The implementation named `backend` in `table`. "auto" means `auto` on GPU (when given) and "reference"
    elsewhere; an unknown name raises ValueError listing the choices."""
    if backend == "auto":
        backend = auto if (auto is not None and jax.default_backend() == "gpu") else "reference"
    try:
        return table[backend]
    except KeyError:
        choices = sorted(table) + (["auto"] if auto is not None else [])
        raise ValueError(f"unknown {op} backend {backend!r}; available: {choices}") from None
