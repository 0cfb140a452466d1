"""Offline generation: prefill + one frame per decode step with explicit caches (backbone + tower).

    codes = generate(model, tok, "Hello there.", references=[(codes_10xT, "transcript")], seed=0)   # [10, n]
    for frame in generate_iter(model, tok, "Hello there.", seed=0): ...                             # [10] each

`frame_step` is the whole per-frame computation (main-token sampling with RAS, the 13 tower layers with 9 head
samplings, the backbone step on the new row); the serving engine runs the same function over its slot pool.

CLI: python -m drama3_jax.generate --checkpoint DIR --text TEXT [--ref-codes X.npy --ref-text T]... --out codes.npy
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from drama3_jax.backbone import Backends, decoder_layer, layer_states, with_layer_states
from drama3_jax.model import Drama3Model, ModelCache
from drama3_jax.packing import Packing, pack_layout
from drama3_jax.prompt import build_prompt, history_for_chunk, split_long_text
from drama3_jax.sampling import (RAS_WINDOW, SamplingParams, frame_keys, initial_recent, push_recent, sample_head,
                                 sample_main)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything a stream carries between frames. h [B, H]: backbone hidden of the last row; row [B, 1+K]: the last
    row; recent [B, W]: RAS window of main tokens; frame [B]: frames generated so far; keys [B, 2] request keys;
    temperature/top_p [B] float32, top_k [B] int32; active [B] int32: 1 for a stream, 0 for a free slot of a pool (its
    row is still computed, but routed to no expert, so it adds no expert weights to the step's reads)."""

    cache: ModelCache
    h: jax.Array
    row: jax.Array
    recent: jax.Array
    frame: jax.Array
    keys: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    active: jax.Array


def frame_step(model: Drama3Model, s: DecodeState, backends: Backends = Backends()):
    """Advance every row by one frame. Returns (new row [B, 1+K] int32, new DecodeState)."""
    cfg = model.cfg
    B = s.h.shape[0]
    ones = jnp.ones((B,), jnp.int32)
    # named scopes = the categories of the decode-step profile (experiments/decode_profile.py)
    with jax.named_scope("lm_head"):
        band_logits = model.main_logits(s.h)
    with jax.named_scope("sampling"):
        fkeys = frame_keys(s.keys, s.frame)
        main = sample_main(fkeys, band_logits, s.temperature, s.top_p, s.top_k, s.recent,
                           semantic_start=cfg.semantic_start_token_id, eos_token_id=cfg.eos_token_id,
                           backend=backends.sampling)

    def choose(i, logits):
        with jax.named_scope("sampling"):
            return sample_head(fkeys, i, logits[:, 0], s.temperature, s.top_p, s.top_k,
                               backend=backends.sampling)[:, None]

    with jax.named_scope("tower"):
        codes, _, tcache = model.tower(s.h[:, None], main[:, None], s.row[:, None], s.cache.tower, ones, choose,
                                       backends=backends, compute_heads=True)
    row = jnp.concatenate([main[:, None], model.semantic_code(main)[:, None], codes[:, 0]], axis=-1)
    with jax.named_scope("backbone"):
        h, bcache = model.forward(row[:, None], s.cache.backbone, ones, backends=backends, active=s.active)
    new = DecodeState(cache=ModelCache(bcache, tcache), h=h[:, 0], row=row, recent=push_recent(s.recent, main),
                      frame=s.frame + 1, keys=s.keys, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                      active=s.active)
    return row, new


# DecodeState's [B, ...] fields
_PER_ROW = ("h", "row", "recent", "frame", "keys", "temperature", "top_p", "top_k", "active")


def frame_step_prefix(model: Drama3Model, s: DecodeState, n: int, backends: Backends = Backends()):
    """`frame_step` over rows [0, n) of a pool of S >= n rows: the per-row fields are sliced, the caches are passed
    whole and updated in place (the kernels index them), rows [n, S) are left as they are. Returns (new rows
    [n, 1+K] int32, new DecodeState of S rows). The step's cost follows n, not the pool."""
    if n == s.h.shape[0]:
        return frame_step(model, s, backends)
    view = dataclasses.replace(s, **{f: getattr(s, f)[:n] for f in _PER_ROW})
    row, new = frame_step(model, view, backends)
    return row, dataclasses.replace(new, **{f: getattr(s, f).at[:n].set(getattr(new, f)) for f in _PER_ROW})


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RequestSampling:
    """Per-row sampling arrays: keys [B, 2] uint32 (from the request seeds), temperature/top_p [B], top_k [B]."""

    keys: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array

    @classmethod
    def make(cls, params: Sequence[SamplingParams], seeds: Sequence[int]) -> "RequestSampling":
        return cls(keys=jnp.stack([jax.random.PRNGKey(s) for s in seeds]).astype(jnp.uint32),
                   temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
                   top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
                   top_k=jnp.asarray([p.top_k for p in params], jnp.int32))


def prefill_chunk(model: Drama3Model, cache: ModelCache, h_last, rows, next_rows, offset, lengths,
                  backends: Backends = Backends()):
    """Prefill one fixed-size chunk of prompt rows into existing caches (any number of chunks per prompt, one
    compiled shape). rows [B, C, 1+K] = prompt rows offset..offset+C-1, next_rows = rows offset+1..offset+C (the
    tower's teacher labels); lengths [B] prompt lengths. Backbone takes rows < n, tower rows < n-1. Returns
    (cache, h_last [B, H]: backbone hidden of row n-1 once it has been seen)."""
    C = rows.shape[1]
    n_backbone = jnp.clip(lengths - offset, 0, C).astype(jnp.int32)
    n_tower = jnp.clip(lengths - 1 - offset, 0, C).astype(jnp.int32)
    with jax.named_scope("backbone"):  # the decode step's profile categories (experiments/decode_profile.py)
        hidden, bcache = model.forward(rows, cache.backbone, n_backbone, backends=backends)
    with jax.named_scope("tower"):
        _, _, tcache = model.tower(hidden, next_rows[..., 0], rows, cache.tower, n_tower,
                                   lambda i, _: next_rows[..., 2 + i], backends=backends, compute_heads=False)
    idx = lengths - 1 - offset
    seen = (idx >= 0) & (idx < C)
    h = jnp.take_along_axis(hidden, jnp.clip(idx, 0, C - 1)[:, None, None], axis=1)[:, 0]
    return ModelCache(bcache, tcache), jnp.where(seen[:, None], h.astype(h_last.dtype), h_last)


def prefill_packed(model: Drama3Model, cache: ModelCache, rows, next_rows, lengths, packing: Packing,
                   backends: Backends = Backends()):
    """Prefill P whole prompts packed end to end (drama3_jax/packing.py) into fresh caches [P, ...] in one call.
    rows [1, N, 1+K] the packed prompt rows; next_rows [1, N, 1+K] each prompt's rows moved up by one (the tower's
    teacher labels; its last row's entry is unused); lengths [P] (0: an empty lane). The row-wise layers run over
    the N packed rows, attention and the GDN recurrence per prompt. Returns (cache, h_last [P, H]: backbone hidden
    of each prompt's last row)."""
    with jax.named_scope("backbone"):
        hidden, bcache = model.forward(rows, cache.backbone, lengths, fresh=True, backends=backends, packing=packing)
    tcache, h = packed_tower(model, hidden, cache.tower, rows, next_rows, lengths, packing, backends)
    return ModelCache(bcache, tcache), h


def packed_tower(model: Drama3Model, hidden, tower_cache, rows, next_rows, lengths, packing: Packing,
                 backends: Backends = Backends()):
    """The tower part of `prefill_packed` on the backbone's final-norm hidden [1, N, H]. Returns (tower cache,
    h_last [P, H])."""
    with jax.named_scope("tower"):
        _, _, tcache = model.tower(hidden, next_rows[..., 0], rows, tower_cache, jnp.maximum(lengths - 1, 0),
                                   lambda i, _: next_rows[..., 2 + i], fresh=True, backends=backends,
                                   compute_heads=False, packing=packing)
    last = packing.unpack[jnp.arange(packing.num_seqs), jnp.maximum(lengths - 1, 0)]  # N (a zero row) if empty
    return tcache, jnp.take(hidden[0], last, axis=0, mode="fill", fill_value=0)


def start_state(cache: ModelCache, h_last, last_row, recent, sampling: RequestSampling) -> DecodeState:
    """The DecodeState after a full prefill: last prompt row [B, 1+K], RAS window [B, W] from the prompt, frame 0."""
    return DecodeState(cache=cache, h=h_last, row=last_row, recent=recent,
                       frame=jnp.zeros(last_row.shape[:1], jnp.int32), keys=sampling.keys,
                       temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                       active=jnp.ones(last_row.shape[:1], jnp.int32))


class Prefiller:
    """Chunked prefill of right-padded prompts into fresh caches: prompts of any length (a multiple of `chunk` after
    padding) run as ceil(T / chunk) calls of one compiled shape per batch size; and packed prefill (`packed`).

    `by_layer`: a packed prefill runs as one jitted call per backbone layer (the same executable for every layer of a
    type: two layer compiles per row count instead of a 40-layer module) between an embedding call and a final call
    (norm, tower, last hidden states), instead of one call. The same math; the compilation is what changes."""

    def __init__(self, model: Drama3Model, max_len: int, chunk: int = 256, backends: Backends = Backends(),
                 cache_dtype=None, state_dtype=None, by_layer: bool = False):
        from drama3_jax.model import init_model_cache

        self.graphdef, self.params = nnx.split(model)
        self._param_leaves, param_tree = jax.tree.flatten(self.params)  # a flat list dispatches faster than a State
        self.chunk = chunk
        cfg = model.cfg
        self.row_width = cfg.row_width
        dtype = cache_dtype or model.lm_head.weight[...].dtype

        def prefill_init(b):  # named functions: the profiler reports device time by jitted module name
            return init_model_cache(cfg, b, max_len, dtype, state_dtype), jnp.zeros((b, cfg.text.hidden_size), dtype)

        def prefill_step(leaves, cache, h, rows, next_rows, offset, lengths):
            model = nnx.merge(self.graphdef, jax.tree.unflatten(param_tree, leaves))
            return prefill_chunk(model, cache, h, rows, next_rows, offset, lengths, backends)

        def prefill_packed_step(leaves, cache, rows, next_rows, lengths, packing):
            model = nnx.merge(self.graphdef, jax.tree.unflatten(param_tree, leaves))
            cache, h = prefill_packed(model, cache, rows, next_rows, lengths, packing, backends)
            return cache, h.astype(dtype)

        # by layer: each layer's own (graphdef, treedef, leaves); graphdef and treedef are equal across the layers
        # of one type, so jit compiles one executable per type and shape
        self.by_layer = by_layer
        self.layer_types = cfg.text.layer_types
        self._layers = []
        for layer in model.model.language_model.layers:
            gd, st = nnx.split(layer)
            leaves, tree = jax.tree.flatten(st)
            self._layers.append((gd, tree, leaves))

        def prefill_packed_inputs(leaves, rows, cache_lengths, lengths, packing):
            model = nnx.merge(self.graphdef, jax.tree.unflatten(param_tree, leaves))
            return model.stack_inputs(rows, cache_lengths, lengths, fresh=True, backends=backends, packing=packing)

        def prefill_packed_layer(gd, tree, leaves, x, state, ctx):
            with jax.named_scope("backbone"):  # one call per layer: the MoE output is added here (no pending)
                x, state, pending = decoder_layer(nnx.merge(gd, jax.tree.unflatten(tree, leaves)), x, state, ctx)
                return (x if pending is None else x + pending), state

        def prefill_packed_finish(leaves, x, tower_cache, rows, next_rows, lengths, packing):
            model = nnx.merge(self.graphdef, jax.tree.unflatten(param_tree, leaves))
            hidden = model.model.language_model.norm(x)
            tcache, h = packed_tower(model, hidden, tower_cache, rows, next_rows, lengths, packing, backends)
            return tcache, h.astype(dtype)

        donate = jax.default_backend() != "cpu"
        self._packed_inputs = jax.jit(prefill_packed_inputs)
        self._packed_layer = jax.jit(prefill_packed_layer, static_argnums=(0, 1),
                                     donate_argnums=(3, 4) if donate else ())
        self._packed_finish = jax.jit(prefill_packed_finish, donate_argnums=(1, 2) if donate else ())
        self._init = jax.jit(prefill_init, static_argnums=0)
        self._chunk = jax.jit(prefill_step, donate_argnums=(1, 2) if donate else ())
        self._packed = jax.jit(prefill_packed_step, donate_argnums=(1,) if donate else ())
        self._start = jax.jit(start_state)

    def chunk_hlo(self, batch: int) -> str:
        """Compiled HLO text of one chunk call at this batch size (module `jit_prefill_step`; for profiles)."""
        cache, h = self._init(batch)
        rows = jnp.zeros((batch, self.chunk, self.row_width), jnp.int32)
        return self._chunk.lower(self._param_leaves, cache, h, rows, rows, jnp.int32(0),
                                 jnp.full((batch,), 2, jnp.int32)).compile().as_text()

    def __call__(self, rows: np.ndarray, lengths: np.ndarray, sampling: RequestSampling) -> DecodeState:
        """rows [B, T, 1+K] int32 (T a multiple of `chunk`), lengths [B] >= 2. Only fixed-shape pieces ([B, chunk, 1+K]
        chunks, [B, 1+K] last rows, [B, W] RAS windows) go to the device, so no prompt length compiles anything new."""
        B, T, K = rows.shape
        C = self.chunk
        if T % C:
            raise ValueError(f"prompt rows must be padded to a multiple of {C}")
        shifted = np.concatenate([rows[:, 1:], np.zeros((B, 1, K), rows.dtype)], axis=1)
        cache, h = self._init(B)
        lengths_d = jnp.asarray(lengths, jnp.int32)
        for a in range(0, int(np.max(lengths)), C):
            cache, h = self._chunk(self._param_leaves, cache, h, jnp.asarray(rows[:, a:a + C]),
                                   jnp.asarray(shifted[:, a:a + C]), jnp.int32(a), lengths_d)
        last_row = rows[np.arange(B), np.asarray(lengths) - 1]
        return self._start(cache, h, jnp.asarray(last_row), jnp.asarray(initial_recent(rows, lengths, RAS_WINDOW)),
                           sampling)

    def packed(self, prompts: Sequence[np.ndarray], sampling: RequestSampling, num_rows: int,
               num_seqs: int) -> DecodeState:
        """Prompts [n_i, 1+K] int32 (each 2..`chunk` rows, at most num_seqs, num_rows in all) in one packed call of
        num_rows rows and num_seqs lanes (one compiled shape per (num_rows, num_seqs)); sampling has num_seqs rows.
        Returns the DecodeState of num_seqs lanes; lanes past len(prompts) are empty (length 0)."""
        C, K = self.chunk, self.row_width
        lens = np.zeros(num_seqs, np.int32)
        lens[:len(prompts)] = [len(p) for p in prompts]
        offsets, unpack, pack = pack_layout(lens[:len(prompts)], num_rows, num_seqs, C)
        rows = np.zeros((1, num_rows, K), np.int32)
        next_rows = np.zeros_like(rows)
        lanes = np.zeros((num_seqs, C, K), np.int32)
        for p, r in enumerate(prompts):
            o, n = offsets[p], len(r)
            rows[0, o:o + n] = r
            next_rows[0, o:o + n - 1] = r[1:]
            lanes[p, :n] = r
        cache, _ = self._init(num_seqs)
        run = self._packed_by_layer if self.by_layer else functools.partial(self._packed, self._param_leaves)
        cache, h = run(cache, jnp.asarray(rows), jnp.asarray(next_rows), jnp.asarray(lens),
                       Packing(jnp.asarray(unpack), jnp.asarray(pack)))
        last_row = lanes[np.arange(num_seqs), np.maximum(lens - 1, 0)]
        return self._start(cache, h, jnp.asarray(last_row), jnp.asarray(initial_recent(lanes, lens, RAS_WINDOW)),
                           sampling)

    def _packed_by_layer(self, cache: ModelCache, rows, next_rows, lengths, packing: Packing):
        """`prefill_packed` as one call per layer (see the class doc): the same (cache, h_last)."""
        x, ctx = self._packed_inputs(self._param_leaves, rows, cache.backbone.lengths, lengths, packing)
        states = layer_states(cache.backbone, self.layer_types)
        for i, (gd, tree, leaves) in enumerate(self._layers):
            x, states[i] = self._packed_layer(gd, tree, leaves, x, states[i], ctx)
        tcache, h = self._packed_finish(self._param_leaves, x, cache.tower, rows, next_rows, lengths, packing)
        return ModelCache(with_layer_states(cache.backbone, states, self.layer_types, ctx.new_cache_lengths),
                          tcache), h

    def packed_hlo(self, num_rows: int, num_seqs: int) -> str:
        """Compiled HLO text of one packed call (module `jit_prefill_packed_step`; for profiles)."""
        cache, _ = self._init(num_seqs)
        rows = jnp.zeros((1, num_rows, self.row_width), jnp.int32)
        _, unpack, pack = pack_layout([2], num_rows, num_seqs, self.chunk)
        return self._packed.lower(self._param_leaves, cache, rows, rows, jnp.zeros((num_seqs,), jnp.int32),
                                  Packing(jnp.asarray(unpack), jnp.asarray(pack))).compile().as_text()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _prefiller(model: Drama3Model, max_len: int, backends: Backends) -> Prefiller:
    """One cached Prefiller per (model, max_len, backends) for the offline API."""
    key = (id(model), max_len, backends)
    if key not in _PREFILLERS:
        _PREFILLERS[key] = Prefiller(model, max_len, chunk=64, backends=backends)
    return _PREFILLERS[key]


_PREFILLERS: dict = {}
_step = nnx.jit(frame_step, static_argnames=("backends",), donate_argnames=("s",))


def generate_rows(model: Drama3Model, prompts: Sequence[np.ndarray], params: Sequence[SamplingParams],
                  seeds: Sequence[int], max_new_frames: int, backends: Backends = Backends()) -> list[np.ndarray]:
    """Generate for a batch of prompt rows [T_i, 1+K]; returns one codes array [K, n_i] per prompt. Each stops at
    EOS (the EOS frame is not returned) or after max_new_frames; a semantic-0 frame right before EOS is dropped."""
    for p in params:
        p.validate(model.cfg.band_size)
    B = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 2:
        raise ValueError("a prompt needs at least 2 rows")
    max_len = _round_up(int(lengths.max()) + max_new_frames + 1, 256)
    prefill = _prefiller(model, max_len, backends)
    rows = np.zeros((B, _round_up(int(lengths.max()), prefill.chunk), model.cfg.row_width), np.int32)
    for i, p in enumerate(prompts):
        rows[i, :len(p)] = p
    state = prefill(rows, lengths, RequestSampling.make(params, seeds))
    frames = [[] for _ in range(B)]
    done = np.zeros(B, bool)
    eos = model.cfg.eos_token_id
    for _ in range(max_new_frames):
        row, state = _step(model, state, backends=backends)
        row = np.asarray(row)
        for i in np.flatnonzero(~done):
            if row[i, 0] == eos:
                done[i] = True
                if frames[i] and frames[i][-1][0] == model.cfg.semantic_start_token_id:
                    frames[i].pop()  # the model often emits <|semantic:0|> right before EOS: a click
            else:
                frames[i].append(row[i])
        if done.all():
            break
    K = model.cfg.num_codebooks
    return [np.stack(f, axis=1)[1:] if f else np.zeros((K, 0), np.int32) for f in frames]


def generate(model: Drama3Model, tok, text: str, references=(), previous_takes=(),
             sampling: SamplingParams = SamplingParams(), seed: int = 0, max_new_frames: int = 2048,
             backends: Backends = Backends()) -> np.ndarray:
    """Codes [K, n] for `text`. Long text is cut into chunks (split_long_text); chunk i is generated with history =
    first chunk + previous chunk; the codes of all chunks are concatenated."""
    chunks = split_long_text(text)
    takes: list[tuple[str, np.ndarray]] = []
    for i, chunk in enumerate(chunks):
        history = list(previous_takes) + history_for_chunk(i, takes)
        rows = build_prompt(tok, model.cfg, chunk, references, history)
        (codes,) = generate_rows(model, [rows], [sampling], [seed + i], max_new_frames, backends)
        takes.append((chunk, codes))
    return np.concatenate([c for _, c in takes], axis=1)


def generate_iter(model: Drama3Model, tok, text: str, references=(), previous_takes=(),
                  sampling: SamplingParams = SamplingParams(), seed: int = 0, max_new_frames: int = 2048,
                  backends: Backends = Backends()) -> Iterator[np.ndarray]:
    """Yield frames [K] as they are made (one frame is held back to apply the semantic-0-before-EOS rule)."""
    sampling.validate(model.cfg.band_size)
    rows = build_prompt(tok, model.cfg, text, references, previous_takes)
    n = len(rows)
    prefill = _prefiller(model, _round_up(n + max_new_frames + 1, 256), backends)
    padded = np.zeros((1, _round_up(n, prefill.chunk), model.cfg.row_width), np.int32)
    padded[0, :n] = rows
    state = prefill(padded, np.array([n], np.int32), RequestSampling.make([sampling], [seed]))
    held = None
    for _ in range(max_new_frames):
        row, state = _step(model, state, backends=backends)
        row = np.asarray(row)[0]
        if row[0] == model.cfg.eos_token_id:
            if held is not None and held[0] != model.cfg.semantic_start_token_id:
                yield held[1:]
            return
        if held is not None:
            yield held[1:]
        held = row
    if held is not None:
        yield held[1:]


def main(argv=None) -> int:
    import drama3_jax
    from drama3_jax.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(description="Generate Drama 3 codes [10, n] for a text.")
    ap.add_argument("--checkpoint", required=True, help="converted checkpoint directory")
    ap.add_argument("--text", required=True)
    ap.add_argument("--ref-codes", action="append", default=[], help="reference codes .npy [10, T] (repeatable)")
    ap.add_argument("--ref-text", action="append", default=[], help="transcript of each --ref-codes")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-frames", type=int, default=2048)
    ap.add_argument("--out", required=True, help="output codes .npy")
    args = ap.parse_args(argv)
    if len(args.ref_codes) != len(args.ref_text):
        ap.error("give one --ref-text per --ref-codes")
    model = drama3_jax.load_talker(args.checkpoint)
    tok = load_tokenizer(args.checkpoint, model.cfg)
    refs = [(np.load(c), t) for c, t in zip(args.ref_codes, args.ref_text)]
    codes = generate(model, tok, args.text, refs, sampling=SamplingParams(args.temperature, args.top_p, args.top_k),
                     seed=args.seed, max_new_frames=args.max_new_frames)
    np.save(args.out, codes)
    print(f"wrote codes {codes.shape} ({codes.shape[1] / 21.533:.2f} s of audio at 21.53 frames/s) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
