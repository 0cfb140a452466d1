"""Drama 3 backbone (Qwen3.5-MoE text stack) in Flax NNX, with an explicit cache pytree.

Module tree = checkpoint tree: `model.language_model.{embed_tokens, layers.{L}.{input_layernorm,
post_attention_layernorm, linear_attn | self_attn, mlp}, norm}`, `lm_head`, `audio_decoder.codebook_embeddings`.
Routed experts are stacked per layer (`mlp.experts.{gate,up,down}_proj.weight[E]`), in the checkpoint's
[out, in] orientation, FP8 + `weight_scale_inv` or bf16.

Entry points (one code path for prefill and decode):
  `forward(rows [B, T, 1+K] int32, cache, new_lengths [B], fresh)` -> (hidden [B, T, H] after the final norm, cache)
  `main_logits(hidden)` -> [.., band + 1]: the semantic band then EOS; `full_logits(hidden)` -> [.., vocab].
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from drama3_jax.config import Drama3Config, TextConfig
from drama3_jax.nn import Embedding, FusedLinear, Linear, RMSNorm, gated_cached_attention, rms_norm, swiglu
from drama3_jax.packing import Packing
from kernels.append_attention.api import HeadLayout, append_decode_attention
from kernels.dense.api import linear
from kernels.gdn import gdn_decode_step, gdn_prefill
from kernels.gdn.reference import causal_conv1d, causal_conv1d_packed, gdn_gates
from kernels.moe import ExpertWeights, moe_experts
from kernels.moe.quant import ACT_GROUP
from kernels.rope import apply_rope_rotate_half
from kernels.router.api import router_topk


# The prefill's causal conv + SiLU output (q, k, v) rounded to the model dtype, as transformers' Qwen3-Next does
# (its causal_conv1d returns x.dtype): in bf16 the conv fusion writes half the bytes and the three GDN prefill kernels
# read half (as fp32 they took 2.4 ms of writes in a 72 ms prefill call on the H200,
# experiments/results/profiles_2026-12-04/prefill/). The decode kernel keeps its conv output in registers (fp32).
# False: fp32 q / k / v, for A/B runs (experiments/prefill_timing.py --variants packed packed_fp32_qkv).
GDN_CONV_OUT_IN_MODEL_DTYPE = True

# With fused projections, the GDN decode kernels (q/k/v, a, b) and the router (its logits) read their operands as
# columns of the one GEMM output: a slice passed to a Pallas call is a copy kernel, 3 per GDN layer and 1 per MoE layer
# (130 of the ~1,360 kernels of the one-stream decode step, experiments/results/profiles_2026-12-04/decode_1slot/).
# False: the slices, for A/B runs (experiments/decode_profile.py --variants pallas_bf16_w8a8_fused_sliced_inputs).
FUSED_OUTPUTS_IN_PLACE = True


@dataclasses.dataclass(frozen=True)
class Backends:
    """Which implementation each op uses (static under jit): "reference" (plain jnp), a Pallas backend name, or
    "auto" (the Pallas kernel on GPU, the reference elsewhere).

    moe_activations: "bf16" (W8A16: FP8 weights dequantised, bf16 activations) or "fp8" (W8A8: the routed experts'
    inputs quantised to e4m3 per token and 128 columns, FP8 x FP8 GEMMs; kernels/moe/quant.py: the checkpoint's
    `activation_scheme: "dynamic"`, see `default_moe_activations`). Applies to FP8 expert weights in 128 x 128 blocks
    whose GEMMs' K is whole 128-column groups, on the "reference" and Pallas MoE backends.

    dense: the bf16 projections (kernels/dense/api.py); its Pallas kernel takes calls of at most 256 rows (decode),
    larger ones stay on XLA's GEMM.

    moe_skip_padding: in a multi-row call (prefill), the rows past each sequence's length are routed to no expert,
    so the grouped GEMMs skip them (prompts are right-padded to whole prefill chunks); their MoE output is 0 either
    way, and the valid rows' outputs do not change.

    router: the MoE router's top-k and the softmax of its k logits (kernels/router/api.py). On the H200 the Pallas
    kernel took 16.4 / 15.9 us against lax.top_k + softmax's 24.9 / 34.9 at 128 / 3,072 rows (same ids); the 128-slot
    decode step 17.60 against 17.65 ms and the 3,072-row prefill call 68.40 against 67.70 ms, both within their
    spread (experiments/results/ab_2026-12-04/). `auto()` picks it: one launch per layer instead of several.

    norm: the residual add + post-attention RMSNorm of each layer, with the W8A8 MoE input's e4m3 groups
    (kernels/norm/api.py): one Pallas launch per layer instead of ~4 XLA kernels; "reference" keeps XLA's ops and
    lets the MoE quantise its input itself. `auto()` picks it: on an H100 the decode step took 17.15 against 17.40 /
    17.42 ms at 64 slots and 4.49 / 4.54 against 4.55 / 4.67 / 5.28 ms at one slot, each in one process
    (experiments/results/decode_2026-12-07_h100/; the H200 and the prefill call not yet timed).

    norm_at_input (with a norm kernel): each layer's MoE output is added to the residual stream by the next layer's
    input RMSNorm launch (and the last one by the final norm's) instead of an XLA add and XLA's norm ops; off until
    timed (experiments/decode_profile.py variant pallas_bf16_w8a8_fused_norm_at_input).

    tower_norm: the tower layers' two residual add + RMSNorm pairs (attention output -> ffn_norm, FFN output ->
    final_layernorm) as norm-kernel launches; "reference" keeps XLA's ops (off until timed: decode_profile variant
    pallas_bf16_w8a8_fused_tower_norm).

    append_attention: a decode step's attention layers (backbone, fused projections; and tower) as one launch of
    kernels/append_attention each: q / k norms, RoPE, the KV-cache write and the attention, ~8 fewer XLA kernels per
    layer (23 layers per step); "reference" keeps the separate ops. Off: on H100s the one-slot step took 4.58 against
    4.58 ms and the 128-slot step 21.59 against 21.15 ms (experiments/results/append_2026-12-07_h100/,
    decode_ab_2026-12-07b_h100/)."""

    moe: str = "reference"
    gdn_prefill: str = "reference"
    gdn_decode: str = "reference"
    attention: str = "reference"
    sampling: str = "reference"
    moe_activations: str = "bf16"
    dense: str = "reference"
    moe_skip_padding: bool = True
    router: str = "reference"
    norm: str = "reference"
    norm_at_input: bool = False
    tower_norm: str = "reference"
    append_attention: str = "reference"

    def __post_init__(self):
        if self.moe_activations not in ("bf16", "fp8"):
            raise ValueError(f"moe_activations must be 'bf16' or 'fp8', got {self.moe_activations!r}")

    @classmethod
    def auto(cls) -> "Backends":
        return cls(moe="auto", gdn_prefill="auto", gdn_decode="auto", attention="auto", sampling="auto", router="auto",
                   norm="auto")


def default_moe_activations(cfg: Drama3Config) -> str:
    """The routed experts' activation precision a checkpoint asks for: "fp8" when its block-FP8 quantization_config
    has `activation_scheme: "dynamic"` (activations quantised at run time per token and 128 columns: the scheme
    block-FP8 checkpoints are made for, which vLLM's and SGLang's block-FP8 MoE kernels run), else "bf16"."""
    return "fp8" if cfg.quant is not None and cfg.quant.activation_scheme == "dynamic" else "bf16"


# ------------------------------------------------------------------------------------------------ cache
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BackboneCache:
    """Per-slot caches. k/v: one [S, max_len, n_kv, head_dim] per full-attention layer; conv: one [S, K-1, conv_dim]
    and ssm: one [S, H_v, D_v, D_k] per GDN layer (each head's state transposed: the decode kernel's D_k reductions
    then run along the contiguous axis); lengths [S] int32 = rows already in the cache."""

    k: list
    v: list
    conv: list
    ssm: list
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


def init_cache(cfg: TextConfig, slots: int, max_len: int, dtype=jnp.bfloat16, state_dtype=None) -> BackboneCache:
    state_dtype = state_dtype or jnp.dtype(cfg.ssm_state_dtype)
    nf, nl = len(cfg.full_attention_layers), len(cfg.linear_attention_layers)
    kv = lambda: jnp.zeros((slots, max_len, cfg.num_key_value_heads, cfg.head_dim), dtype)
    return BackboneCache(
        k=[kv() for _ in range(nf)], v=[kv() for _ in range(nf)],
        conv=[jnp.zeros((slots, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim), dtype) for _ in range(nl)],
        ssm=[jnp.zeros((slots, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim),
                       state_dtype) for _ in range(nl)],
        lengths=jnp.zeros((slots,), jnp.int32))


# ------------------------------------------------------------------------------------------------ layers
class _Container(nnx.Module):
    """A plain namespace node of the module tree (mirrors a checkpoint name prefix)."""


class GatedAttention(nnx.Module):
    """Gated full attention: q_proj gives [q_h | gate_h] per head; q/k zero-centred norms; partial rotate-half RoPE;
    GQA causal softmax; output * sigmoid(gate); o_proj."""

    def __init__(self, cfg: TextConfig, dtype):
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(h, nh * hd * 2, dtype=dtype)
        self.k_proj = Linear(h, nkv * hd, dtype=dtype)
        self.v_proj = Linear(h, nkv * hd, dtype=dtype)
        self.o_proj = Linear(nh * hd, h, dtype=dtype)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.qkv_proj = None  # FusedLinear(q_proj, k_proj, v_proj) after fuse_projections()
        self.cfg = cfg

    def fuse_projections(self):
        if self.qkv_proj is not None:
            return
        self.qkv_proj = nnx.data(FusedLinear([self.q_proj, self.k_proj, self.v_proj]))
        del self.q_proj, self.k_proj, self.v_proj

    def append_layout(self) -> HeadLayout | None:
        """Where q_proj's [q_h | gate_h] heads and k, v sit in the fused projection's row (kernels/append_attention),
        or None without fused projections or when a member does not start on a whole head."""
        cfg = self.cfg
        hd = cfg.head_dim
        if self.qkv_proj is None or any(c % hd for c in self.qkv_proj.columns):
            return None
        _, k0, v0 = (c // hd for c in self.qkv_proj.columns)
        return HeadLayout(cfg.num_attention_heads, cfg.num_key_value_heads, hd, q0=0, q_step=2, gate0=1, gate_step=2,
                          k0=k0, v0=v0)

    def __call__(self, x, positions, k_cache, v_cache, start, new_lengths, *, fresh: bool, backend: str,
                 dense: str = "reference", packing: Packing | None = None, append: str = "reference"):
        """x [B, T, H]; or packed prompts x [1, N, H] with `packing` (positions, caches and lengths per prompt).
        `append`: a kernel backend of kernels/append_attention for decode rows (T == 1) of fused projections, or
        "reference" (the separate ops below)."""
        cfg = self.cfg
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if (append != "reference" and x.shape[1] == 1 and not fresh and packing is None
                and (layout := self.append_layout()) is not None):
            proj = self.qkv_proj.project(x[:, 0], dense)
            o, k_cache, v_cache = append_decode_attention(
                proj, self.q_norm.weight[...], self.k_norm.weight[...], k_cache, v_cache, start, new_lengths,
                layout=layout, rotary_dim=cfg.rotary_dim, rope_theta=cfg.rope_theta, rope_style="rotate_half",
                eps=cfg.rms_norm_eps, zero_centered=self.q_norm.zero_centered, backend=append)
            return self.o_proj(o[:, None], dense), k_cache, v_cache
        if self.qkv_proj is not None:
            qg, k, v = self.qkv_proj(x, dense)
        else:
            qg, k, v = self.q_proj(x, dense), self.k_proj(x, dense), self.v_proj(x, dense)
        if packing is not None:
            qg, k, v = (packing.to_seqs(t) for t in (qg, k, v))
        B, T = qg.shape[:2]
        qg = qg.reshape(B, T, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(B, T, nh * hd)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(B, T, nkv, hd))
        v = v.reshape(B, T, nkv, hd)
        q = apply_rope_rotate_half(q, positions, cfg.rotary_dim, cfg.rope_theta)
        k = apply_rope_rotate_half(k, positions, cfg.rotary_dim, cfg.rope_theta)
        o, k_cache, v_cache = gated_cached_attention(q, k, v, gate, positions, k_cache, v_cache, start, new_lengths,
                                                     fresh=fresh, backend=backend)
        if packing is not None:
            o = packing.to_rows(o)
        return self.o_proj(o, dense), k_cache, v_cache


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet mixer: in_proj_qkv -> causal depthwise conv (k=4) + SiLU -> q, k, v; beta = sigmoid(b),
    g = -exp(A_log) softplus(a + dt_bias); gated delta rule; per-head RMSNorm (plain weight) * SiLU(z); out_proj."""

    def __init__(self, cfg: TextConfig, dtype):
        h = cfg.hidden_size
        self.in_proj_qkv = Linear(h, cfg.linear_conv_dim, dtype=dtype)
        self.in_proj_z = Linear(h, cfg.linear_value_dim, dtype=dtype)
        self.in_proj_b = Linear(h, cfg.linear_num_value_heads, dtype=dtype)
        self.in_proj_a = Linear(h, cfg.linear_num_value_heads, dtype=dtype)
        self.conv1d = _Container()
        self.conv1d.weight = nnx.Param(jnp.zeros((cfg.linear_conv_dim, 1, cfg.linear_conv_kernel_dim), dtype))
        self.A_log = nnx.Param(jnp.zeros((cfg.linear_num_value_heads,), dtype))
        self.dt_bias = nnx.Param(jnp.ones((cfg.linear_num_value_heads,), dtype))
        self.norm = RMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps, zero_centered=False, dtype=dtype)
        self.out_proj = Linear(cfg.linear_value_dim, h, dtype=dtype)
        self.in_proj = None  # FusedLinear(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) after fuse_projections()
        self.cfg = cfg

    def fuse_projections(self):
        if self.in_proj is not None:
            return
        self.in_proj = nnx.data(FusedLinear([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]))
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def __call__(self, x, conv_state, ssm_state, new_lengths, *, decode: bool, backends: Backends,
                 packing: Packing | None = None):
        """x [B, T, H]; or packed prompts x [1, N, H] with `packing` (states and lengths per prompt; prefill only)."""
        cfg = self.cfg
        hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim)
        kd = hk * dk
        fused_decode = decode and self.in_proj is not None and FUSED_OUTPUTS_IN_PLACE
        if fused_decode:  # the decode kernels read q/k/v, a and b in place from the one GEMM output
            proj = self.in_proj.project(x, backends.dense)
            _, z_col, b_col, a_col = self.in_proj.columns
            z = proj[..., z_col:z_col + self.in_proj.sizes[1]]
        elif self.in_proj is not None:
            mixed, z, b, a = self.in_proj(x, backends.dense)
        else:
            mixed, z, b, a = (p(x, backends.dense) for p in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b,
                                                              self.in_proj_a))
        B, T = z.shape[:2]
        z = z.reshape(z.shape[:2] + (hv, dv))
        conv_w = self.conv1d.weight[...][:, 0, :]
        with jax.named_scope("gdn_core"):  # profile category (experiments/decode_profile.py)
            if decode:
                slots = jnp.arange(B, dtype=jnp.int32) if conv_state.shape[0] > B else None  # a pool prefix
                gates = (dict(a=None, b=None, a_col=a_col, b_col=b_col) if fused_decode
                         else dict(a=a[:, 0], b=b[:, 0]))
                o, conv_state, ssm_state = gdn_decode_step(
                    (proj if fused_decode else mixed)[:, 0], conv_state=conv_state, ssm_state=ssm_state,
                    conv_weight=conv_w, A_log=self.A_log[...], dt_bias=self.dt_bias[...], num_k_heads=hk,
                    head_k_dim=dk, head_v_dim=dv, slots=slots, v_major=True, backend=backends.gdn_decode, **gates)
                o = o[:, None]
            else:
                if packing is None:
                    y, conv_state = causal_conv1d(mixed, conv_w, conv_state, new_lengths)
                    rows = {}
                else:  # the conv and the recurrence address each prompt's packed rows in place
                    rows = dict(offsets=packing.offsets, seq_len=packing.seq_len)
                    y, conv_state = causal_conv1d_packed(mixed[0], conv_w, conv_state, packing.pack,
                                                         rows["offsets"], new_lengths, packing.seq_len)
                    y = y[None]
                if GDN_CONV_OUT_IN_MODEL_DTYPE:
                    y = y.astype(mixed.dtype)
                q = y[..., :kd].reshape(B, T, hk, dk)
                k = y[..., kd:2 * kd].reshape(B, T, hk, dk)
                v = y[..., 2 * kd:].reshape(B, T, hv, dv)
                g, beta = gdn_gates(a, b, self.A_log[...], self.dt_bias[...])
                # the cache is v-major ([.., D_v, D_k], init_cache); the prefill kernels take and give [.., D_k, D_v]
                o, new_state = gdn_prefill(q, k, v, g, beta, jnp.swapaxes(ssm_state, -1, -2), new_lengths,
                                           backend=backends.gdn_prefill, **rows)
                ssm_state = jnp.swapaxes(new_state, -1, -2).astype(ssm_state.dtype)
        o = rms_norm(o, self.norm.weight[...], cfg.rms_norm_eps, zero_centered=False, out_dtype=jnp.float32)
        o = (o * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype).reshape(x.shape[:2] + (hv * dv,))
        return self.out_proj(o, backends.dense), conv_state, ssm_state


class ExpertProj(nnx.Module):
    """One projection of all experts: `weight` [E, out, in] (+ `weight_scale_inv` [E, ceil(out/b), ceil(in/b)])."""

    def __init__(self, num_experts: int, out_dim: int, in_dim: int, *, fp8_block: tuple[int, int] | None, dtype):
        if fp8_block is None:
            self.weight = nnx.Param(jnp.zeros((num_experts, out_dim, in_dim), dtype))
            self.weight_scale_inv = None
        else:
            self.weight = nnx.Param(jnp.zeros((num_experts, out_dim, in_dim), jnp.float8_e4m3fn))
            self.weight_scale_inv = nnx.Param(jnp.ones(
                (num_experts, math.ceil(out_dim / fp8_block[0]), math.ceil(in_dim / fp8_block[1])), jnp.float32))


class Experts(nnx.Module):
    def __init__(self, cfg: TextConfig, *, fp8_block, dtype):
        E, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = ExpertProj(E, i, h, fp8_block=fp8_block, dtype=dtype)
        self.up_proj = ExpertProj(E, i, h, fp8_block=fp8_block, dtype=dtype)
        self.down_proj = ExpertProj(E, h, i, fp8_block=fp8_block, dtype=dtype)
        self.block = tuple(fp8_block) if fp8_block else (128, 128)

    def weights(self) -> ExpertWeights:
        s = lambda p: None if p.weight_scale_inv is None else p.weight_scale_inv[...]
        return ExpertWeights(gate=self.gate_proj.weight[...], up=self.up_proj.weight[...],
                             down=self.down_proj.weight[...], gate_scale=s(self.gate_proj),
                             up_scale=s(self.up_proj), down_scale=s(self.down_proj), block=self.block)


class MLP(nnx.Module):
    """The shared expert's SwiGLU weights (SparseMoe runs them: its gate/up share a GEMM with the router)."""

    def __init__(self, hidden: int, inter: int, dtype):
        self.gate_proj = Linear(hidden, inter, dtype=dtype)
        self.up_proj = Linear(hidden, inter, dtype=dtype)
        self.down_proj = Linear(inter, hidden, dtype=dtype)


class SparseMoe(nnx.Module):
    """softmax(fp32) router -> top-k renormalised -> SwiGLU experts; + sigmoid(shared_expert_gate(x)) * shared(x)."""

    def __init__(self, cfg: TextConfig, *, fp8_block, dtype):
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, dtype=dtype)
        self.experts = Experts(cfg, fp8_block=fp8_block, dtype=dtype)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, dtype=dtype)
        # FusedLinear(gate, shared_expert.{gate,up}_proj, shared_expert_gate) after fuse_projections(): every
        # projection of the layer's input in one GEMM
        self.in_proj = None
        self.top_k = cfg.num_experts_per_tok

    def fuse_projections(self):
        if self.in_proj is not None:
            return
        se = self.shared_expert
        self.in_proj = nnx.data(FusedLinear([self.gate, se.gate_proj, se.up_proj, self.shared_expert_gate]))
        del self.gate, se.gate_proj, se.up_proj, self.shared_expert_gate

    def fp8_input_group(self, act_fp8: bool, width: int) -> int | None:
        """The activation group (128) when the routed experts run W8A8 on inputs of this width: FP8 weights in 128 x
        128 blocks and both GEMMs' K whole groups (not the tiny test models, whose K is smaller); else None."""
        w = self.experts
        fp8 = w.gate_proj.weight.dtype == jnp.float8_e4m3fn and w.block == (ACT_GROUP, ACT_GROUP)
        ok = act_fp8 and fp8 and width % ACT_GROUP == 0 and w.down_proj.weight.shape[-1] % ACT_GROUP == 0
        return ACT_GROUP if ok else None

    def route(self, logits, backend: str = "reference", num_experts: int | None = None):
        """Router logits [N, E] fp32 -> (topk_ids [N, k] int32, topk_weights [N, k] fp32) (kernels/router); with
        num_experts, the logits are the first num_experts columns of a wider array."""
        return router_topk(logits, self.top_k, num_experts=num_experts, backend=backend)

    def __call__(self, x, *, backend: str, act_fp8: bool = False, dense: str = "reference", valid=None,
                 router: str = "reference", x_fp8=None):
        """x [..., H]; valid: bool of x's leading shape or None (see Backends.moe_skip_padding); x_fp8: x's e4m3
        groups for W8A8 (q [N, H], scale [N, H / 128], kernels/norm), or None (the MoE quantises x itself)."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        se = self.shared_expert
        # bf16 x bf16 products are exact in fp32 and accumulate in fp32: the fp32 router math without an fp32 copy of
        # the router weights per call; the shared expert's projections round that fp32 result to x.dtype, as their
        # own GEMMs would
        with jax.named_scope("moe_in_proj"):
            num_experts = None
            if self.in_proj is not None and FUSED_OUTPUTS_IN_PLACE:
                # the router reads its logits in place from the GEMM output (columns [0, E)): no slice copy
                proj = self.in_proj.project(xf, dense, out_dtype=jnp.float32)
                num_experts = self.in_proj.sizes[0]
                _, c_gate, c_up, c_sg = self.in_proj.columns
                n_i = self.in_proj.sizes[1]
                logits = proj
                sh_gate = proj[:, c_gate:c_gate + n_i].astype(x.dtype)
                sh_up = proj[:, c_up:c_up + n_i].astype(x.dtype)
                sg = proj[:, c_sg:c_sg + 1]
            elif self.in_proj is not None:
                logits, sh_gate, sh_up, sg = self.in_proj(xf, dense, out_dtype=jnp.float32)
                sh_gate, sh_up = sh_gate.astype(x.dtype), sh_up.astype(x.dtype)
            else:
                logits = linear(xf, self.gate.weight[...], backend=dense, out_dtype=jnp.float32)
                sh_gate, sh_up = se.gate_proj(xf, dense), se.up_proj(xf, dense)
                sg = self.shared_expert_gate(xf, dense)
        with jax.named_scope("router"):
            ids, w = self.route(logits, router, num_experts)
        with jax.named_scope("moe_experts"):
            weights = self.experts.weights()
            w8a8 = self.fp8_input_group(act_fp8, xf.shape[-1]) is not None
            options = {"act_fp8": True} if w8a8 else {}
            if w8a8 and x_fp8 is not None:
                options["x_fp8"] = x_fp8
            routed = moe_experts(xf, ids, w, weights, backend=backend,
                                 valid=None if valid is None else valid.reshape(-1), **options)
        with jax.named_scope("shared_expert"):
            shared = se.down_proj(swiglu(sh_gate, sh_up), dense)
            sg = jax.nn.sigmoid(sg.astype(jnp.float32))
        out = routed.astype(jnp.float32) + sg * shared.astype(jnp.float32)
        return out.astype(x.dtype).reshape(shape)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TextConfig, layer_type: str, *, fp8_block, dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if layer_type == "full_attention":
            self.self_attn = GatedAttention(cfg, dtype)
        else:
            self.linear_attn = GatedDeltaNet(cfg, dtype)
        self.mlp = SparseMoe(cfg, fp8_block=fp8_block, dtype=dtype)
        self.layer_type = layer_type


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerContext:
    """What every decoder layer of one forward shares: positions [B, T], start [B] (cache rows before), new_lengths
    [B], valid (MoE rows, or None), packing (or None) and the cache lengths after the forward; static: fresh (an
    empty cache), decode (T == 1), backends."""

    positions: jax.Array
    start: jax.Array
    new_lengths: jax.Array
    valid: jax.Array | None
    packing: Packing | None
    new_cache_lengths: jax.Array
    fresh: bool = dataclasses.field(metadata=dict(static=True))
    decode: bool = dataclasses.field(metadata=dict(static=True))
    backends: Backends = dataclasses.field(metadata=dict(static=True))


def layer_states(cache: BackboneCache, layer_types) -> list[tuple]:
    """Each layer's cache entries in layer order: (k, v) of an attention layer, (conv, ssm) of a GDN layer."""
    att, gdn = iter(zip(cache.k, cache.v)), iter(zip(cache.conv, cache.ssm))
    return [next(att) if t == "full_attention" else next(gdn) for t in layer_types]


def with_layer_states(cache: BackboneCache, states: list[tuple], layer_types, lengths) -> BackboneCache:
    """`cache` with the layers' entries replaced by `states` (layer order) and its lengths by `lengths`."""
    att = [s for s, t in zip(states, layer_types) if t == "full_attention"]
    gdn = [s for s, t in zip(states, layer_types) if t != "full_attention"]
    return BackboneCache(k=[k for k, _ in att], v=[v for _, v in att], conv=[c for c, _ in gdn],
                         ssm=[s for _, s in gdn], lengths=lengths)


def decoder_layer(layer: DecoderLayer, x, state: tuple, ctx: LayerContext, pending=None):
    """One decoder layer on x [B, T, H] (or packed [1, N, H]): pre-norm token mixer with its cache entries `state`
    ((k, v) or (conv, ssm)), residual, pre-norm sparse MoE, residual. `pending`: the previous layer's MoE output not
    yet in x, or None. Returns (x, state, pending): with Backends.norm_at_input and a norm kernel, this layer's MoE
    output is not added to x but returned (`finish_stack` adds it), else it is added and pending is None."""
    be = ctx.backends
    if pending is None:
        h = layer.input_layernorm(x)
    else:
        x, h, _ = layer.input_layernorm.with_residual(x, pending, be.norm)
    if layer.layer_type == "full_attention":
        h, k, v = layer.self_attn(h, ctx.positions, *state, ctx.start, ctx.new_lengths, fresh=ctx.fresh,
                                  backend=be.attention, dense=be.dense, packing=ctx.packing,
                                  append=be.append_attention)
        state = (k, v)
    else:
        h, conv, ssm = layer.linear_attn(h, *state, ctx.new_lengths, decode=ctx.decode, backends=be,
                                         packing=ctx.packing)
        state = (conv, ssm)
    act_fp8 = be.moe_activations == "fp8"
    if be.norm == "reference":
        x = x + h
        n, x_fp8 = layer.post_attention_layernorm(x), None
    else:  # one launch: the residual sum, its norm and (W8A8) the norm's e4m3 groups
        group = layer.mlp.fp8_input_group(act_fp8, x.shape[-1])
        x, n, x_fp8 = layer.post_attention_layernorm.with_residual(x, h, be.norm, group)
    m = layer.mlp(n, backend=be.moe, act_fp8=act_fp8, dense=be.dense, valid=ctx.valid, router=be.router, x_fp8=x_fp8)
    if be.norm_at_input and be.norm != "reference":
        return x, state, m
    return x + m, state, None


def finish_stack(norm: RMSNorm, x, pending, backends: Backends):
    """The final norm of the stack's output x [..., H], with the last layer's pending MoE output (or None) added."""
    if pending is None:
        return norm(x)
    return norm.with_residual(x, pending, backends.norm)[1]


class TextModel(nnx.Module):
    def __init__(self, cfg: TextConfig, *, fp8_block, dtype):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(cfg, t, fp8_block=fp8_block, dtype=dtype) for t in cfg.layer_types])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)


# main_logits on the fused `main_head` when there is one (experiments/decode_profile.py's `_sliced_head` variant turns
# it off while a step is traced, for the A/B)
MAIN_HEAD_GEMM = True


class Drama3Backbone(nnx.Module):
    """Backbone + lm_head + the shared codebook table that feeds semantic rows."""

    def __init__(self, cfg: Drama3Config, *, dtype=jnp.bfloat16, fp8_experts: bool = True):
        fp8_block = tuple(cfg.quant.weight_block_size) if (fp8_experts and cfg.quant is not None) else None
        self.model = _Container()
        self.model.language_model = TextModel(cfg.text, fp8_block=fp8_block, dtype=dtype)
        self.lm_head = Linear(cfg.text.hidden_size, cfg.text.vocab_size, dtype=dtype)
        self.audio_decoder = _Container()
        self.audio_decoder.codebook_embeddings = Embedding(
            cfg.tower.num_codebooks * cfg.tower.vocab_size, cfg.tower.dim, dtype=dtype)
        self.main_head = None  # [band + 1, H]: lm_head's band rows then its EOS row, after fuse_projections()
        self.cfg = cfg

    def fuse_projections(self):
        """The backbone's part of Drama3Model.fuse_projections: each layer's groups of projections of one input as
        one GEMM, and a copy of lm_head's band and EOS rows for `main_logits` (band_size + 1 rows: 16.8 MB at full
        size). Idempotent."""
        for layer in self.model.language_model.layers:
            (layer.self_attn if layer.layer_type == "full_attention" else layer.linear_attn).fuse_projections()
            layer.mlp.fuse_projections()
        if self.main_head is None:
            c, w = self.cfg, self.lm_head.weight[...]
            self.main_head = nnx.data(nnx.Param(jnp.concatenate(
                [w[c.semantic_start_token_id:c.semantic_end_token_id + 1], w[c.eos_token_id][None]], axis=0)))
        return self

    # -------------------------------------------------------------------------------- embedding of frame rows
    def embed_rows(self, rows: jax.Array) -> jax.Array:
        """rows [..., 1+K] int32 -> [..., H]. Text rows: E_tok[main]. Semantic rows (main in the band):
        (E_tok[main] + sum_{k=1..B} E_cb[k*V + c_k]) / sqrt(1+B), B = vq_backbone_codebooks, V = tower vocab."""
        cfg = self.cfg
        lm = self.model.language_model
        main = rows[..., 0]
        e = lm.embed_tokens(main)
        nb = cfg.tower.vq_backbone_codebooks
        if nb == 0:
            return e
        V = cfg.tower.vocab_size
        is_sem = (main >= cfg.semantic_start_token_id) & (main <= cfg.semantic_end_token_id)
        ks = jnp.arange(1, nb + 1)
        idx = ks * V + jnp.clip(rows[..., 1 + ks], 0, V - 1)  # [..., B]
        cb = jnp.sum(self.audio_decoder.codebook_embeddings(idx).astype(jnp.float32), axis=-2)
        sem = (e.astype(jnp.float32) + cb) / math.sqrt(1 + nb)
        return jnp.where(is_sem[..., None], sem, e.astype(jnp.float32)).astype(e.dtype)

    # -------------------------------------------------------------------------------- the stack
    def forward(self, rows, cache: BackboneCache, new_lengths, *, fresh: bool = False,
                backends: Backends = Backends(), packing: Packing | None = None, active=None):
        """rows [B, T, 1+K] at positions cache.lengths + t; new_lengths [B] valid rows per sequence (right padding).
        `fresh`: the cache rows are empty (prompt prefill), so attention only looks at the new rows.
        T == 1 takes the fused GDN decode step. The cache may hold more rows than B (a slot pool): rows [0, B) are
        these sequences, updated in place, the others untouched. Returns (final-norm hidden [B, T, H], cache).
        With `packing` (drama3_jax/packing.py), rows [1, N, 1+K] are P prompts end to end: cache, new_lengths and the
        positions are per prompt ([P, ...], B = P and T = packing.seq_len), and the hidden is [1, N, H].
        active [B] (decode, T == 1; None: every row): rows with 0 (free slots of a pool) are routed to no expert."""
        x, ctx = self.stack_inputs(rows, cache.lengths, new_lengths, fresh=fresh, backends=backends, packing=packing,
                                   active=active)
        types = self.cfg.text.layer_types
        states = layer_states(cache, types)
        pending = None
        for i, layer in enumerate(self.model.language_model.layers):
            x, states[i], pending = decoder_layer(layer, x, states[i], ctx, pending)
        hidden = finish_stack(self.model.language_model.norm, x, pending, backends)
        return hidden, with_layer_states(cache, states, types, ctx.new_cache_lengths)

    def stack_inputs(self, rows, cache_lengths, new_lengths, *, fresh: bool, backends: Backends,
                     packing: Packing | None = None, active=None) -> tuple[jax.Array, "LayerContext"]:
        """The embedded rows and what every layer of a forward over them shares (see `forward`)."""
        B, T = (packing.num_seqs, packing.seq_len) if packing is not None else rows.shape[:2]
        start = cache_lengths[:B]
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        valid = None
        if T > 1 and backends.moe_skip_padding:
            valid = packing.valid() if packing is not None else jnp.arange(T)[None, :] < new_lengths[:, None]
        elif T == 1 and active is not None:
            valid = active[:, None]
        new_cache_lengths = cache_lengths.at[:B].set(start + new_lengths.astype(jnp.int32))
        return self.embed_rows(rows), LayerContext(positions, start, new_lengths, valid, packing, new_cache_lengths,
                                                   fresh=fresh, decode=T == 1, backends=backends)

    def full_logits(self, hidden):
        return self.lm_head(hidden)

    def main_logits(self, hidden):
        """Logits of the main-token candidates: the semantic band (in order) then EOS, fp32 [..., band+1].
        Only those lm_head rows are multiplied: one GEMM on `main_head` after fuse_projections, else two products
        on slices of lm_head (no per-call copy of the band's weights) and a concatenation. In the decode step that
        concatenation was one ~36 us kernel at 1 and at 128 slots, for at most 2 MB of output (H200 decode profiles
        of 2026-12-02 and 2026-12-04, H100 of 2026-12-07: `lm_head/concatenate`)."""
        c = self.cfg
        w = self.lm_head.weight[...]
        h = hidden.astype(w.dtype)
        dot = lambda rows: jax.lax.dot_general(h, rows, (((h.ndim - 1,), (1,)), ((), ())),
                                               preferred_element_type=jnp.float32)
        if self.main_head is not None and MAIN_HEAD_GEMM:
            return dot(self.main_head[...])
        band = dot(w[c.semantic_start_token_id:c.semantic_end_token_id + 1])
        return jnp.concatenate([band, dot(w[c.eos_token_id][None])], axis=-1)
