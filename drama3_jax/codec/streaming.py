"""Host-facing codec API: validated, jitted encode / decode and batched streaming decode with per-stream state.

    codec = Codec(load_codec(ckpt_dir, dtype=jnp.bfloat16))
    codes = codec.encode(samples, sample_rate)            # any rate / channels -> [K, T] int32
    audio = codec.decode(codes)                           # [K, T] -> [T * frame_length] float32
    state = codec.init_state(streams)
    audio, state = codec.step(state, new_codes, n_new)    # [B, K, T] new frames -> [B, T * frame_length] new samples
    state = codec.reset(state, slots)                     # start fresh streams in the given slots

Streaming is exact: every layer is causal and the state carries each conv's left context, the transformer's window
of K/V and the transposed convs' previous input, so concatenated chunks equal the one-shot decode for any chunking.
All state leaves are batch-major ([B, ...]): slots can be gathered / scattered with jax.tree.map.
"""

from __future__ import annotations

import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from drama3_jax.codec.audio_io import to_mono
from drama3_jax.codec.config import CodecConfig
from drama3_jax.codec.model import DecodeState, ModifiedDAC


def validate_codes(codes, cfg: CodecConfig) -> np.ndarray:
    """codes [K, T] or [B, K, T] integer, each codebook in range -> int32 [B, K, T]; ValueError otherwise."""
    codes = np.asarray(codes)
    if codes.ndim == 2:
        codes = codes[None]
    if codes.ndim != 3:
        raise ValueError(f"codes must be [codebooks, frames] or [batch, codebooks, frames], got shape {codes.shape}")
    if codes.shape[1] != cfg.n_codebooks:
        raise ValueError(f"codes have {codes.shape[1]} codebooks, the codec has {cfg.n_codebooks}")
    if codes.shape[2] == 0:
        raise ValueError("codes have no frames")
    if not np.issubdtype(codes.dtype, np.integer):
        raise ValueError(f"codes must be integers, got dtype {codes.dtype}")
    for k, size in enumerate(cfg.codebook_sizes):
        row = codes[:, k]
        if row.min() < 0 or row.max() >= size:
            bad = row[(row < 0) | (row >= size)][0]
            raise ValueError(f"codebook {k} has code {bad} outside [0, {size})")
    return codes.astype(np.int32)


def _step(graphdef, params, state, codes, n_new):
    return nnx.merge(graphdef, params).decode_step(state, codes, n_new)


def _step_slots(graphdef, params, state, slots, codes, n_new):
    """Step only the streams `slots` [n] (an index >= B is padding: it reads a clipped row, writes nothing)."""
    sub = jax.tree.map(lambda x: jnp.take(x, slots, axis=0, mode="clip"), state)
    audio, sub = nnx.merge(graphdef, params).decode_step(sub, codes, n_new)
    return audio, jax.tree.map(lambda x, y: x.at[slots].set(y, mode="drop"), state, sub)


def _reset(state, slots):
    return jax.tree.map(lambda x: jnp.where(slots.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.zeros_like(x), x), state)


@functools.cache
def _compiled():
    """Jitted entry points shared by every Codec (keyed on the static graphdef, so codecs of one config and dtype
    share compilations). The streaming state is donated on accelerators."""
    donate = (2,) if jax.default_backend() != "cpu" else ()
    return types.SimpleNamespace(
        step=jax.jit(_step, static_argnums=0, donate_argnums=donate),
        step_slots=jax.jit(_step_slots, static_argnums=0, donate_argnums=donate),
        decode=jax.jit(lambda g, p, c: nnx.merge(g, p).decode(c), static_argnums=0),
        encode=jax.jit(lambda g, p, a: nnx.merge(g, p).encode(a), static_argnums=0),
        init=jax.jit(lambda g, p, b: nnx.merge(g, p).init_decode_state(b), static_argnums=(0, 2)),
        reset=jax.jit(_reset))


class Codec:
    """Jitted encode / decode / streaming step over a `ModifiedDAC` (weights held once, in the model's dtype)."""

    def __init__(self, model: ModifiedDAC):
        self.cfg = model.cfg
        self.graphdef, self.params = nnx.split(model)

    @property
    def model(self) -> ModifiedDAC:
        return nnx.merge(self.graphdef, self.params)

    @property
    def frame_length(self) -> int:
        return self.cfg.frame_length

    @staticmethod
    def _bucket(frames: int) -> int:
        """One-shot encode/decode pad to a multiple of max(8, 2^(bits(frames) - 4)) frames: at most 8 compiled shapes
        per doubling of length, at most 12.5% padding. Exact, since the codec is causal."""
        step = max(8, 2 ** (frames.bit_length() - 4))
        return math.ceil(frames / step) * step

    # ------------------------------------------------------------------------------------------ one-shot
    def decode(self, codes) -> np.ndarray:
        """codes [K, T] -> audio [T * frame_length]; [B, K, T] -> [B, T * frame_length]; float32 in [-1, 1]."""
        batched = np.ndim(codes) == 3
        codes = validate_codes(codes, self.cfg)
        T = codes.shape[2]
        padded = np.pad(codes, ((0, 0), (0, 0), (0, self._bucket(T) - T)))
        audio = np.asarray(_compiled().decode(self.graphdef, self.params, jnp.asarray(padded)))
        audio = audio[:, :T * self.frame_length]
        return audio if batched else audio[0]

    def encode(self, audio, sample_rate: int, *, bucket_frames: int | None = None) -> np.ndarray:
        """audio [N] or [N, channels] at any rate -> codes [K, ceil(N' / frame_length)] int32, N' samples after mixing
        down and resampling to the codec rate (right-padded with zeros to whole frames, as Fish does).
        bucket_frames: pad to a multiple of this many frames (a server's fixed set of compiled shapes)."""
        mono = to_mono(audio, sample_rate, self.cfg.sample_rate)
        frames = math.ceil(mono.shape[0] / self.frame_length)
        padded_frames = math.ceil(frames / bucket_frames) * bucket_frames if bucket_frames else self._bucket(frames)
        padded = np.zeros((1, padded_frames * self.frame_length), np.float32)
        padded[0, :mono.shape[0]] = mono
        return np.asarray(_compiled().encode(self.graphdef, self.params, jnp.asarray(padded)))[0, :, :frames]

    # ----------------------------------------------------------------------------------------- streaming
    def init_state(self, streams: int) -> DecodeState:
        return _compiled().init(self.graphdef, self.params, streams)

    def step(self, state: DecodeState, codes, n_new=None):
        """Decode the next frames of every stream. codes [B, K, T] (numpy input is validated; device input is only
        shape-checked and clipped to each codebook like Fish does). n_new [B] (default T): real frames per stream;
        the rest of its row is padding. -> (audio [B, T * frame_length] float32 device array whose first
        n_new[b] * frame_length samples are stream b's new audio, next state). The state argument is donated on GPU."""
        if isinstance(codes, np.ndarray):
            codes = validate_codes(codes, self.cfg)
        B, K, T = codes.shape
        if B != state.frames.shape[0] or K != self.cfg.n_codebooks:
            raise ValueError(f"codes {codes.shape} do not match {state.frames.shape[0]} streams x "
                             f"{self.cfg.n_codebooks} codebooks")
        if n_new is not None:
            n_new = np.asarray(n_new, np.int32)
            if n_new.shape != (B,) or n_new.min() < 0 or n_new.max() > T:
                raise ValueError(f"n_new must be [{B}] ints in [0, {T}], got {n_new}")
            n_new = jnp.asarray(n_new)
        return _compiled().step(self.graphdef, self.params, state, jnp.asarray(codes, jnp.int32), n_new)

    def step_hlo(self, state: DecodeState, codes) -> str:
        """Compiled HLO text of `step(state, codes)` (module `jit__step`; for profiles)."""
        return _compiled().step.lower(self.graphdef, self.params, state, jnp.asarray(codes, jnp.int32),
                                      None).compile().as_text()

    def step_slots(self, state: DecodeState, slots, codes, n_new):
        """Decode the next frames of some streams only: slots [n] int (an index >= the stream count is padding),
        codes [n, K, T] int32, n_new [n] real frames per row. The cost is n x T frames however many streams the state
        holds. -> (audio [n, T * frame_length] float32 device array, next state; donated on GPU)."""
        slots, n_new = np.asarray(slots, np.int32), np.asarray(n_new, np.int32)
        n, K, T = np.shape(codes)
        if slots.shape != (n,) or n_new.shape != (n,) or K != self.cfg.n_codebooks:
            raise ValueError(f"slots {slots.shape}, codes {np.shape(codes)}, n_new {n_new.shape} do not agree")
        if n_new.min() < 0 or n_new.max() > T:
            raise ValueError(f"n_new must be in [0, {T}], got {n_new}")
        return _compiled().step_slots(self.graphdef, self.params, state, jnp.asarray(slots), jnp.asarray(codes,
                                      jnp.int32), jnp.asarray(n_new))

    def reset(self, state: DecodeState, slots) -> DecodeState:
        """Zero the state of the streams where `slots` [B] bool is true (they restart at frame 0)."""
        return _compiled().reset(state, jnp.asarray(slots, bool))
