"""Random-weight talkers built directly on the device from a seed (no checkpoint file): the full-size model for
speed tests without the real weights. Same tensors, dtypes (FP8 experts + fp32 block scales, bf16 rest) and
distributions as the random checkpoint writer (`checkpoint.init_value`), drawn with jax.random instead of numpy, so
the values differ from a written random checkpoint of the same seed."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from drama3_jax.checkpoint import (CheckpointError, checkpoint_tensors, init_value, merge_pure, set_path,
                                   to_state_keys)
from drama3_jax.config import Drama3Config
from drama3_jax.model import Drama3Model
from drama3_jax.nn import quantize_block_fp8


def random_talker(cfg: Drama3Config, seed: int = 0, *, dtype=jnp.bfloat16, fp8_experts: bool = True) -> Drama3Model:
    """A `Drama3Model` with random weights on the default device. Experts are drawn one stacked [E, out, in] array
    per layer and projection and quantised to FP8 with 128x128 block scales on device (fp8_experts=False: bf16)."""
    base = jax.random.PRNGKey(seed)
    block = tuple(cfg.quant.weight_block_size) if cfg.quant else (128, 128)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Drama3Model(cfg, dtype=dtype, fp8_experts=fp8_experts)))
    pure: dict = {}
    done_stacks = set()
    for spec in checkpoint_tensors(cfg):
        if spec.scale_of is not None:
            continue
        key = jax.random.fold_in(base, zlib.crc32(".".join(map(str, spec.path)).encode()))
        if spec.index is not None:  # one stacked draw per (layer, projection)
            if spec.path in done_stacks:
                continue
            done_stacks.add(spec.path)
            stacked = dataclasses.replace(spec, shape=(cfg.text.num_experts,) + spec.shape)
            w = _draw(stacked, key)
            if fp8_experts:
                q, scale = quantize_block_fp8(w, block, xp=jnp)
                set_path(pure, spec.path, q)
                set_path(pure, spec.path[:-1] + ("weight_scale_inv",), scale)
            else:
                set_path(pure, spec.path, w.astype(dtype))
            continue
        set_path(pure, spec.path, _draw(spec, key).astype(dtype))
    return merge_pure(graphdef, state, to_state_keys(pure), CheckpointError, f"random {cfg.name}")


def _draw(spec, key):
    k_normal, k_uniform = jax.random.split(key)
    normal = lambda m, sd, shape: m + sd * jax.random.normal(k_normal, shape, jnp.float32)
    uniform = lambda lo, hi, shape: jax.random.uniform(k_uniform, shape, jnp.float32, lo, hi)
    return init_value(spec, normal, uniform, log=jnp.log)
