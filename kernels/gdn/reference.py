"""Plain-jnp gated delta rule: the token-by-token recurrence, the chunked (WY/UT) form, and the fused decode step.

Shapes (H_k key heads, H_v = g * H_k value heads; value head h reads key head h // g):
  q, k  [B, T, H_k, D_k]    v [B, T, H_v, D_v]    g (log decay), beta [B, T, H_v]    state [B, H_v, D_k, D_v]
Math per value head, with q and k L2-normalised (eps 1e-6) and q scaled by D_k^-1/2, state S in fp32:
  S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
Positions t >= lengths[b] leave the state untouched (beta = 0, g = 0) and give zero output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2_EPS = 1e-6


def l2_normalize(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, lengths):
    """fp32, normalised, head-expanded inputs with padded positions neutralised."""
    B, T, hk, dk = q.shape
    hv = v.shape[2]
    rep = hv // hk
    q = jnp.repeat(l2_normalize(q), rep, axis=2) * (dk ** -0.5)
    k = jnp.repeat(l2_normalize(k), rep, axis=2)
    v = v.astype(jnp.float32)
    g = g.astype(jnp.float32)
    beta = beta.astype(jnp.float32)
    if lengths is not None:
        valid = (jnp.arange(T)[None, :] < lengths[:, None])  # [B, T]
        g = jnp.where(valid[..., None], g, 0.0)
        beta = jnp.where(valid[..., None], beta, 0.0)
    else:
        valid = jnp.ones((B, T), bool)
    return q, k, v, g, beta, valid


def gated_delta_recurrent(q, k, v, g, beta, initial_state=None, lengths=None):
    """Token-by-token recurrence. Returns (o [B, T, H_v, D_v] fp32, final_state [B, H_v, D_k, D_v] fp32)."""
    q, k, v, g, beta, valid = _prepare(q, k, v, g, beta, lengths)
    B, T, hv, dk = k.shape
    dv = v.shape[-1]
    s0 = jnp.zeros((B, hv, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def step(s, xs):
        qt, kt, vt, gt, bt = xs  # [B, H, D], ..., [B, H]
        s = s * jnp.exp(gt)[..., None, None]
        kv = jnp.einsum("bhkv,bhk->bhv", s, kt)
        delta = (vt - kv) * bt[..., None]
        s = s + jnp.einsum("bhk,bhv->bhkv", kt, delta)
        o = jnp.einsum("bhkv,bhk->bhv", s, qt)
        return s, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    s, o = jax.lax.scan(step, s0, xs)
    o = jnp.moveaxis(o, 0, 1) * valid[..., None, None]
    return o, s


def gated_delta_chunked(q, k, v, g, beta, initial_state=None, lengths=None, chunk_size: int = 64):
    """Chunked WY/UT form (mathematically identical to the recurrence); same signature and outputs."""
    q, k, v, g, beta, valid = _prepare(q, k, v, g, beta, lengths)
    B, T, hv, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    if pad:
        padw = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, g, beta = map(padw, (q, k, v, g, beta))
    n = (T + pad) // C
    # -> [B, H, n, C, ...]
    to_chunks = lambda x: jnp.moveaxis(x.reshape((B, n, C) + x.shape[2:]), 3, 1)
    q, k, v, g, beta = map(to_chunks, (q, k, v, g, beta))
    gc = jnp.cumsum(g, axis=-1)  # [B, H, n, C]
    tri_incl = jnp.tril(jnp.ones((C, C), bool))
    tri_strict = jnp.tril(jnp.ones((C, C), bool), -1)
    decay = jnp.where(tri_incl, jnp.exp(gc[..., :, None] - gc[..., None, :]), 0.0)  # [B,H,n,C,C]
    kb = k * beta[..., None]
    # (I + L) with L = strictly-lower(diag(beta) K K^T * decay); its inverse applied to beta*v and beta*k*exp(gc).
    L = jnp.where(tri_strict, jnp.einsum("...ik,...jk->...ij", kb, k) * decay, 0.0)
    eye = jnp.eye(C, dtype=jnp.float32)
    rhs = jnp.concatenate([v * beta[..., None], kb * jnp.exp(gc)[..., None]], axis=-1)
    sol = jax.scipy.linalg.solve_triangular(eye + L, rhs, lower=True, unit_diagonal=True)
    u, w = sol[..., :dv], sol[..., dv:]  # [B,H,n,C,Dv], [B,H,n,C,Dk]
    qk = jnp.where(tri_incl, jnp.einsum("...ik,...jk->...ij", q, k) * decay, 0.0)
    s0 = jnp.zeros((B, hv, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def chunk_step(s, xs):
        qi, ki, ui, wi, gci, qki = xs  # [B,H,C,*]
        v_new = ui - jnp.einsum("bhck,bhkv->bhcv", wi, s)
        o = jnp.einsum("bhck,bhkv->bhcv", qi * jnp.exp(gci)[..., None], s) + jnp.einsum("bhij,bhjv->bhiv", qki, v_new)
        g_last = gci[..., -1]
        s = s * jnp.exp(g_last)[..., None, None] + jnp.einsum(
            "bhck,bhcv->bhkv", ki * jnp.exp(g_last[..., None] - gci)[..., None], v_new)
        return s, o

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, u, w, gc, qk))
    s, o = jax.lax.scan(chunk_step, s0, xs)  # o [n, B, H, C, Dv]
    o = jnp.moveaxis(o, 0, 2).reshape(B, hv, n * C, dv)[:, :, :T]
    o = jnp.moveaxis(o, 1, 2) * valid[..., None, None]
    return o, s


def causal_conv1d(x, weight, conv_state=None, lengths=None):
    """Depthwise causal conv (no bias) + SiLU over time.

    x [B, T, C]; weight [C, K]; conv_state [B, K-1, C] (the K-1 inputs before x, zeros for a new sequence).
    Returns (y [B, T, C] fp32, new_state [B, K-1, C]: the last K-1 valid inputs of each sequence)."""
    B, T, Cd = x.shape
    K = weight.shape[-1]
    if conv_state is None:
        conv_state = jnp.zeros((B, K - 1, Cd), x.dtype)
    xp = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1).astype(jnp.float32)  # [B, T+K-1, C]
    w = weight.astype(jnp.float32)
    y = sum(xp[:, j:j + T, :] * w[:, j] for j in range(K))
    end = jnp.full((B,), T, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    idx = end[:, None] + jnp.arange(K - 1)[None, :]  # positions in xp of the last K-1 valid inputs
    new_state = jnp.take_along_axis(xp, idx[..., None], axis=1).astype(conv_state.dtype)
    return jax.nn.silu(y), new_state


def packed_lanes(offsets, lengths, seq_len: int, num_rows: int) -> jax.Array:
    """[P, seq_len] int32: the packed row of position t of sequence p (sequence p at rows offsets[p] ..
    offsets[p] + lengths[p] - 1), `num_rows` (out of range) past its length."""
    t = jnp.arange(seq_len, dtype=jnp.int32)[None, :]
    return jnp.where(t < lengths[:, None], offsets[:, None] + t, num_rows).astype(jnp.int32)


def gated_delta_packed(prefill, q, k, v, g, beta, initial_state, offsets, lengths, *, seq_len: int):
    """Any [B, T] prefill (`prefill(q, k, v, g, beta, initial_state, lengths)`) on sequences packed end to end on one
    row axis: q, k [1, N, H_k, D_k], v [1, N, H_v, D_v], g, beta [1, N, H_v]; sequence p holds rows offsets[p] ..
    offsets[p] + lengths[p] - 1 (lengths <= seq_len). Gathers per-sequence lanes [P, seq_len], runs `prefill`, and
    returns (o [1, N, H_v, D_v] fp32, zero outside every sequence; final_state [P, H_v, D_k, D_v] fp32)."""
    N = q.shape[1]
    idx = packed_lanes(offsets, lengths, seq_len, N)
    lanes = [jnp.take(x[0], idx, axis=0, mode="fill", fill_value=0) for x in (q, k, v, g, beta)]
    o, st = prefill(*lanes, initial_state, lengths)
    rows = jnp.zeros((N,) + o.shape[2:], o.dtype).at[idx].set(o, mode="drop")  # idx N (past a length): dropped
    return rows[None], st


def causal_conv1d_packed(x, weight, conv_state, pack, offsets, lengths, seq_len: int):
    """`causal_conv1d` over P sequences packed end to end on one row axis (no per-sequence gather of the input).

    x [N, C]; weight [C, K]; conv_state [P, K-1, C] (the K-1 inputs before each sequence); pack [N] int32: p * seq_len
    + t for row t of sequence p, >= P * seq_len for rows outside every sequence; offsets, lengths [P]: each sequence's
    first row and length. Returns (y [N, C] fp32, zero outside every sequence; new_state [P, K-1, C]) with the same
    casts and summation order as `causal_conv1d` on each sequence."""
    N, Cd = x.shape
    P, K = conv_state.shape[0], weight.shape[-1]
    p = jnp.minimum(pack // seq_len, P - 1)
    t = pack % seq_len
    w = weight.astype(jnp.float32)
    state = conv_state.astype(x.dtype)
    flat_state = state.reshape(P * (K - 1), Cd)
    y = 0.0
    for j in range(K):  # tap j reads the input s = K-1-j rows back: a packed row, or the state before row 0
        s = K - 1 - j
        src = x
        if s:
            above = jnp.pad(x[:-s], ((s, 0), (0, 0)))
            before = jnp.take(flat_state, p * (K - 1) + jnp.clip(K - 1 - s + t, 0, K - 2), axis=0)
            src = jnp.where((t >= s)[:, None], above, before)
        y = y + src.astype(jnp.float32) * w[:, j]
    y = jnp.where((pack < P * seq_len)[:, None], jax.nn.silu(y), 0.0)
    i = lengths.astype(jnp.int32)[:, None] + jnp.arange(K - 1)[None, :]  # the last K-1 positions of [state; x_p]
    from_x = jnp.take(x, jnp.clip(offsets[:, None] + i - (K - 1), 0, N - 1), axis=0)
    from_state = jnp.take_along_axis(state, jnp.minimum(i, K - 2)[..., None], axis=1)
    new_state = jnp.where((i >= K - 1)[..., None], from_x, from_state).astype(conv_state.dtype)
    return y, new_state


def gdn_gates(a, b, A_log, dt_bias):
    """beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias), in fp32. a, b [..., H_v]."""
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(A_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return g, beta


def split_fused_decode_input(proj, conv_dim: int, num_v_heads: int, a_col: int, b_col: int):
    """(a [B, H_v], b [B, H_v], mixed_qkv [B, C]) out of a fused in-projection output [B, W]."""
    return (proj[:, a_col:a_col + num_v_heads], proj[:, b_col:b_col + num_v_heads], proj[:, :conv_dim])


def gdn_decode_step(mixed_qkv, a, b, conv_state, ssm_state, conv_weight, A_log, dt_bias, *,
                    num_k_heads: int, head_k_dim: int, head_v_dim: int, slots=None, v_major: bool = False,
                    a_col: int | None = None, b_col: int | None = None):
    """One token per stream: conv-state update + SiLU, gates, L2 norm, delta-rule update, output.

    mixed_qkv [B, 2*H_k*D_k + H_v*D_v] (the in_proj_qkv output, before the conv); a, b [B, H_v];
    conv_state [S, K-1, C] and ssm_state [S, H_v, D_k, D_v] are slot pools (S >= B); `slots` [B] picks each row's
    slot (None: row i is slot i, S == B). Returns (o [B, H_v, D_v] fp32, conv_state, ssm_state) with only the
    addressed slots changed. v_major: ssm_state holds each head's state transposed, [S, H_v, D_v, D_k].
    Fused in-projection (a, b None; a_col, b_col given): mixed_qkv [B, W] is the whole fused projection output, q/k/v
    in its first C columns, a and b in columns [a_col, a_col + H_v) and [b_col, b_col + H_v)."""
    if a_col is not None:
        a, b, mixed_qkv = split_fused_decode_input(mixed_qkv, conv_state.shape[-1], A_log.shape[-1], a_col, b_col)
    B, Cd = mixed_qkv.shape
    hv = a.shape[-1]
    kd = num_k_heads * head_k_dim
    cs = conv_state if slots is None else conv_state[slots]
    ss = ssm_state if slots is None else ssm_state[slots]
    if v_major:
        ss = jnp.swapaxes(ss, -1, -2)
    y, new_cs = causal_conv1d(mixed_qkv[:, None, :], conv_weight, cs)
    y = y[:, 0]
    q = y[:, :kd].reshape(B, 1, num_k_heads, head_k_dim)
    k = y[:, kd:2 * kd].reshape(B, 1, num_k_heads, head_k_dim)
    v = y[:, 2 * kd:].reshape(B, 1, hv, head_v_dim)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    o, new_ss = gated_delta_recurrent(q, k, v, g[:, None], beta[:, None], ss)
    new_ss = new_ss.astype(ssm_state.dtype)
    if v_major:
        new_ss = jnp.swapaxes(new_ss, -1, -2)
    if slots is None:
        return o[:, 0], new_cs, new_ss
    return o[:, 0], conv_state.at[slots].set(new_cs), ssm_state.at[slots].set(new_ss)
