"""drama3-jax: Fish Audio Drama 3 text-to-speech in JAX/Flax."""

from drama3_jax.config import Drama3Config, preset

__all__ = ["Drama3Config", "preset", "load"]


def load(path, *, dtype=None):
    """Restore a converted checkpoint directory (see `scripts/convert_checkpoint.py`)."""
    from drama3_jax.checkpoint import load_model

    return load_model(path, dtype=dtype)
