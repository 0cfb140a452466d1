"""Decode-step profile of the full-size random-weight talker on one GPU (issue: full-size Drama 3 on one H200).

Phase "timing": for each kernel variant and slot count, the jitted `frame_step` (main-token sampling, 13 tower layers
with 9 head samplings, the backbone step) on a slot pool whose caches hold `--context` rows (ragged, +-50%) of random
data; time per step as the median over windows of back-to-back steps (device throughput: dispatch runs ahead), and
per host round trip (one step, then wait: what a synchronous server loop sees). With `--pool S` the step runs over the
first `--slots` rows of an S-slot pool (`frame_step_prefix`, the server's `--decode-sizes`).
Phase "profile": one variant at one slot count under `jax.profiler.trace`; GPU kernel time per category (the named
scopes of `frame_step`: moe_experts, gdn_core, attention_core, sampling, ...) beside each category's roofline
(bytes / 4.2 TB/s, flops / 780 TFLOP/s). Run it with XLA command buffers off (XLA_FLAGS=
--xla_gpu_enable_command_buffer=) so that each kernel is attributed to its HLO op.

    python experiments/decode_profile.py --out DIR --phase timing [--slots 1 64 128 256] [--variants ...]
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python experiments/decode_profile.py --out DIR --phase profile
    python experiments/decode_profile.py --out DIR --plot-from DIR/decode_timing.json   (redraw a PNG from results)

Run as a script it reserves the server's GPU memory fraction (drama3_jax/xla_flags.py, 0.92 unless
XLA_PYTHON_CLIENT_MEM_FRACTION is set): with JAX's 0.75 the 128-slot state did not fit an 80 GB H100 beside the
full-size weights (experiments/results/decode_2026-12-07_h100/).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import gzip
import hashlib
import json
import os
import re
import sys
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from drama3_jax.backbone import Backends
from drama3_jax.config import preset
from drama3_jax.generate import DecodeState, RequestSampling, frame_step_prefix
from drama3_jax.model import ModelCache, init_model_cache
from drama3_jax.random_init import random_talker
from drama3_jax.sampling import RAS_WINDOW, SamplingParams
from experiments.common import category_of, command_line, log, patched, save_json
from experiments.hlo_census import launches

HBM_BPS, PEAK_FLOPS = 4.2e12, 780e12  # measured on the H200 (../shared/docs/h200-baselines.md)
VARIANTS = {  # name -> (backends, GDN state dtype, projections fused: Drama3Model.fuse_projections)
    "reference": (Backends(), "float32", False),
    "pallas_fp32": (Backends.auto(), "float32", False),
    "pallas_bf16": (Backends.auto(), "bfloat16", False),
    "pallas_bf16_ref_attention": (dataclasses.replace(Backends.auto(), attention="reference"), "bfloat16", False),
    "pallas_bf16_w8a8": (dataclasses.replace(Backends.auto(), moe_activations="fp8"), "bfloat16", False),
    "pallas_bf16_w8a8_fused": (dataclasses.replace(Backends.auto(), moe_activations="fp8"), "bfloat16", True),
    # with lax.top_k + softmax for the router instead of the Pallas router kernel (kernels/router)
    "pallas_bf16_w8a8_fused_ref_router": (
        dataclasses.replace(Backends.auto(), moe_activations="fp8", router="reference"), "bfloat16", True),
    # with XLA's residual add + post-attention RMSNorm and the MoE quantising its input, not the one Pallas launch
    # of kernels/norm
    "pallas_bf16_w8a8_fused_ref_norm": (
        dataclasses.replace(Backends.auto(), moe_activations="fp8", norm="reference"), "bfloat16", True),
    "pallas_bf16_dense": (dataclasses.replace(Backends.auto(), dense="auto"), "bfloat16", False),
    # with each layer's MoE output added by the next layer's input-norm launch (Backends.norm_at_input)
    "pallas_bf16_w8a8_fused_norm_at_input": (
        dataclasses.replace(Backends.auto(), moe_activations="fp8", norm_at_input=True), "bfloat16", True),
    # with the tower layers' residual add + norm pairs as norm-kernel launches (Backends.tower_norm)
    "pallas_bf16_w8a8_fused_tower_norm": (
        dataclasses.replace(Backends.auto(), moe_activations="fp8", tower_norm="auto"), "bfloat16", True),
    # with every attention layer's norms, RoPE, KV write and attention as one launch (Backends.append_attention)
    "pallas_bf16_w8a8_fused_append": (
        dataclasses.replace(Backends.auto(), moe_activations="fp8", append_attention="auto"), "bfloat16", True),
    # the three kernel-count cuts together: append attention, norm_at_input, tower_norm
    "pallas_bf16_w8a8_fused_append_norms": (
        dataclasses.replace(Backends.auto(), moe_activations="fp8", append_attention="auto", norm_at_input=True,
                            tower_norm="auto"), "bfloat16", True),
    # the decode-size Pallas projection kernel (kernels/dense) for the default step's GEMMs: timed at 128 slots only
    # (no change, experiments/results/dense_2026-12-01/), where one slot's GEMVs are ~1.7 of its ~4.5 ms
    "pallas_bf16_w8a8_fused_dense": (dataclasses.replace(Backends.auto(), moe_activations="fp8", dense="auto"),
                                     "bfloat16", True),
    "pallas_bf16_w8a8_dense": (dataclasses.replace(Backends.auto(), moe_activations="fp8", dense="auto"), "bfloat16",
                               False),
}


def _w8a8_table_with_small_row(**tile) -> dict:
    """The MoE tuning table with one more W8A8 row in front, for <= 64 (token, slot) pairs (one to eight streams):
    the table's W8A8 decode row with the activations quantised in-kernel (not prequant, whose gate/up N tile must be
    128), and `tile`. The prequant row gives one stream's gate/up I / 128 = 4 programs per expert, 32 in all."""
    from kernels.moe.tuning import TRITON_TABLE
    row = TRITON_TABLE["w8a8"][0][1] | {"prequant": False} | tile
    return TRITON_TABLE | {"w8a8": [(64, row)] + TRITON_TABLE["w8a8"]}


# variants that also switch a module-level choice, for A/B runs in one call: (module, attribute, key or None, value)
PATCHES = {
    # the fifth session's step: the argsort expert grouping in XLA and the XLA conv-state shift
    "pallas_bf16_w8a8_fused_argsort_xlashift": ("pallas_bf16_w8a8_fused", [
        ("kernels.moe.routing", "RANK_MAX_PAIRS", None, 0),
        ("kernels.moe.routing_triton", "MAX_PAIRS", None, 0),
        ("kernels.gdn.pallas_triton", "TUNING", "decode", {"conv_shift": "xla"}),
    ]),
    # the main logits as two products on lm_head's slices and a concatenation (one ~36 us kernel in the profiles), not
    # one GEMM on the fused band + EOS weight (Drama3Backbone.main_head)
    "pallas_bf16_w8a8_fused_sliced_head": ("pallas_bf16_w8a8_fused", [
        ("drama3_jax.backbone", "MAIN_HEAD_GEMM", None, False),
    ]),
    # the expert block schedule in XLA at every size (not the one-program Pallas schedule for <= 64 pairs)
    "pallas_bf16_w8a8_fused_xla_schedule": ("pallas_bf16_w8a8_fused", [
        ("kernels.moe.routing_triton", "MAX_PAIRS", None, 0),
    ]),
    # the GDN decode as one launch per state tile (grid "tiles", the default until 2026-12-02's twelfth session)
    "pallas_bf16_w8a8_fused_gdn_tiles": ("pallas_bf16_w8a8_fused", [
        ("kernels.gdn.pallas_triton", "TUNING", "decode", {"grid": "tiles"}),
    ]),
    "pallas_bf16_w8a8_fused_gdn_split_bv16_w1": ("pallas_bf16_w8a8_fused", [
        ("kernels.gdn.pallas_triton", "TUNING", "decode_split", {"bv": 16, "num_warps": 1}),
    ]),
    "pallas_bf16_w8a8_fused_xlashift": ("pallas_bf16_w8a8_fused", [
        ("kernels.gdn.pallas_triton", "TUNING", "decode", {"conv_shift": "xla"}),
    ]),
    # one to eight streams: narrow gate/up (and down) N tiles for more programs per expert (gu16 at one slot: 5.08
    # against 4.45 ms on an H100, rejected; experiments/results/append_2026-12-07_h100/)
    "pallas_bf16_w8a8_fused_moe_gu16": ("pallas_bf16_w8a8_fused", [
        ("kernels.moe.pallas_triton", "TRITON_TABLE", None, _w8a8_table_with_small_row(gu_block_n=16, gu_warps=1)),
    ]),
    "pallas_bf16_w8a8_fused_moe_gu32": ("pallas_bf16_w8a8_fused", [
        ("kernels.moe.pallas_triton", "TRITON_TABLE", None, _w8a8_table_with_small_row(gu_block_n=32, gu_warps=2)),
    ]),
    "pallas_bf16_w8a8_fused_moe_gu16_dn64": ("pallas_bf16_w8a8_fused", [
        ("kernels.moe.pallas_triton", "TRITON_TABLE", None,
         _w8a8_table_with_small_row(gu_block_n=16, gu_warps=1, dn_block_n=64, dn_warps=2)),
    ]),
    # the GDN decode kernels' and the router's inputs as slices of the fused projections (copies), as before
    # 2026-12-06's twenty-seventh session
    "pallas_bf16_w8a8_fused_sliced_inputs": ("pallas_bf16_w8a8_fused", [
        ("drama3_jax.backbone", "FUSED_OUTPUTS_IN_PLACE", None, False),
    ]),
}
# profile categories, first match wins, on the op_name path of each kernel's HLO instruction
CATEGORIES = ("sampling", "attention_core", "kv_write", "gdn_core", "moe_experts", "moe_in_proj", "router",
              "shared_expert", "tower_heads", "lm_head", "tower", "backbone")


def make_state(cfg, slots: int, max_len: int, context: int, state_dtype: str, seed: int = 0,
               active_rows: int = 0) -> DecodeState:
    """A decode pool mid-generation: random caches (never zeros) with ragged lengths around `context`. active_rows
    > 0: only the first that many rows hold streams, the others are free slots (DecodeState.active 0)."""
    rng = np.random.default_rng(seed)
    cache = init_model_cache(cfg, slots, max_len, jnp.bfloat16, jnp.dtype(state_dtype))
    key = jax.random.PRNGKey(seed)
    leaves, tree = jax.tree.flatten(cache)
    filled = []
    for i, x in enumerate(leaves):
        if x.dtype == jnp.int32:
            filled.append(x)
            continue
        filled.append((0.1 * jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32)).astype(x.dtype))
    cache = jax.tree.unflatten(tree, filled)
    lengths = jnp.asarray(np.clip(rng.integers(context // 2, context * 3 // 2 + 1, slots), 2, max_len - 64), jnp.int32)
    cache = ModelCache(dataclasses.replace(cache.backbone, lengths=lengths),
                       dataclasses.replace(cache.tower, lengths=lengths - 1))
    band = cfg.band_size
    row = np.concatenate([cfg.semantic_start_token_id + rng.integers(0, band, (slots, 1)),
                          rng.integers(0, cfg.tower.vocab_size, (slots, cfg.num_codebooks))], axis=1)
    recent = cfg.semantic_start_token_id + rng.integers(0, band, (slots, RAS_WINDOW))
    smp = RequestSampling.make([SamplingParams()] * slots, list(range(slots)))
    h = (jax.random.normal(jax.random.fold_in(key, 10_000), (slots, cfg.text.hidden_size))).astype(jnp.bfloat16)
    return DecodeState(cache=cache, h=h, row=jnp.asarray(row, jnp.int32), recent=jnp.asarray(recent, jnp.int32),
                       frame=jnp.zeros((slots,), jnp.int32), keys=smp.keys, temperature=smp.temperature,
                       top_p=smp.top_p, top_k=smp.top_k,
                       active=jnp.asarray(np.arange(slots) < (active_rows or slots), jnp.int32))


def make_step(graphdef, backends: Backends, rows: int):
    """The jitted frame step over the first `rows` rows of the state (all of them when it has no more)."""
    return jax.jit(lambda p, s: frame_step_prefix(nnx.merge(graphdef, p), s, rows, backends), donate_argnums=(1,))


def time_step(step, params, state, windows: int = 5, per_window: int = 8):
    """-> (ms per step back to back, ms per synchronous round trip, state). Medians after 3 warm-up steps."""
    for _ in range(3):
        row, state = step(params, state)
    jax.block_until_ready(row)
    back, sync = [], []
    for _ in range(windows):
        t = time.perf_counter()
        for _ in range(per_window):
            row, state = step(params, state)
        jax.block_until_ready(row)
        back.append((time.perf_counter() - t) / per_window)
    for _ in range(windows * 2):
        t = time.perf_counter()
        row, state = step(params, state)
        jax.block_until_ready(row)
        sync.append(time.perf_counter() - t)
    return 1e3 * float(np.median(back)), 1e3 * float(np.median(sync)), state


# ------------------------------------------------------------------------------------------------ rooflines
def category_rooflines(talker, cfg, slots: int, context: int, state_dtype: str, active: int = 0) -> dict:
    """Fewest bytes / flops each category must move / do per decode step (uniform routing assumed for the experts).
    active > 0: only that many rows are routed to experts (the others are free slots); every row counts elsewhere."""
    t, a = cfg.text, cfg.tower
    by_cat = defaultdict(lambda: [0.0, 0.0])  # bytes, flops

    for path, x in nnx.to_flat_state(nnx.state(talker)):
        name = ".".join(str(p) for p in path)
        n = int(np.prod(x.get_value().shape))
        nbytes = n * x.get_value().dtype.itemsize
        if "experts" in name and "shared" not in name:
            continue  # counted below from the touched experts
        if "embed" in name or "embedding" in name:
            continue  # one row per token: negligible
        if name.startswith("lm_head"):
            cat, n_used = "lm_head", (cfg.band_size + 1) * t.hidden_size
            nbytes = n_used * x.get_value().dtype.itemsize
            n = n_used
        elif name.startswith("audio_decoder_mtp.heads"):
            cat = "tower_heads"
        elif name.startswith("audio_decoder_mtp"):
            cat = "tower"
        elif any(k in name for k in (".mlp.gate.", ".mlp.in_proj.", "shared_expert.gate_proj", "shared_expert.up_proj",
                                     ".mlp.shared_expert_gate.")):
            cat = "moe_in_proj"  # the router and every other projection of the MoE input (one GEMM when fused)
        elif "shared_expert" in name:
            cat = "shared_expert"
        else:
            cat = "backbone"
        by_cat[cat][0] += nbytes
        by_cat[cat][1] += 2.0 * slots * n if x.get_value().ndim >= 2 else 0.0
    expert_params = 3 * t.hidden_size * t.moe_intermediate_size
    routed = active or slots
    touched = t.num_experts * (1 - (1 - t.num_experts_per_tok / t.num_experts) ** routed)
    by_cat["moe_experts"] = [t.num_hidden_layers * touched * expert_params * (1 + 3 * 4 / 128 ** 2),
                             2.0 * t.num_hidden_layers * routed * t.num_experts_per_tok * expert_params]
    n_gdn, n_attn = len(t.linear_attention_layers), len(t.full_attention_layers)
    state_bytes = t.linear_num_value_heads * t.linear_key_head_dim * t.linear_value_head_dim * jnp.dtype(
        state_dtype).itemsize
    conv_bytes = (t.linear_conv_kernel_dim - 1) * t.linear_conv_dim * 2
    by_cat["gdn_core"] = [n_gdn * slots * 2 * (state_bytes + conv_bytes),
                          n_gdn * slots * 4.0 * t.linear_num_value_heads * t.linear_key_head_dim
                          * t.linear_value_head_dim]
    kv_row = 2 * t.num_key_value_heads * t.head_dim * 2  # k and v, bf16
    layers = n_attn + a.num_layers
    by_cat["attention_core"] = [layers * slots * context * kv_row,
                                layers * slots * context * 4.0 * t.num_attention_heads * t.head_dim]
    by_cat["kv_write"] = [layers * slots * kv_row, 0.0]
    by_cat["sampling"] = [slots * (cfg.band_size + 1 + (a.num_codebooks - 1) * a.vocab_size) * 4 * 2, 0.0]
    return {c: {"bytes": b, "flops": f, "roofline_ms": 1e3 * max(b / HBM_BPS, f / PEAK_FLOPS)}
            for c, (b, f) in by_cat.items()}


# ------------------------------------------------------------------------------------------------ trace parsing
def op_names_from_hlo(text: str) -> dict:
    """HLO instruction name -> op_name metadata (the jax name-scope path)."""
    out = {}
    for m in re.finditer(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name="([^"]*)"', text, re.M):
        out[m.group(1)] = m.group(2)
    return out


def kernel_names_from_hlo(text: str) -> dict:
    """GPU kernel name -> op_name, for trace events without an `hlo_op` (kernels replayed from a command buffer
    carry only their kernel name): a fusion's kernel is its instruction name with '.' and '-' as '_'; a Pallas
    kernel is the `name` in its custom call's backend config (every layer's call has the same scope path). Unverified
    on the device for Pallas kernels inside command buffers (experiments/results/decode_profile_2026-12-02/)."""
    out = {}
    for m in re.finditer(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=(.*?)op_name="([^"]*)"(.*)$', text, re.M):
        name, before, op_name, after = m.groups()
        out.setdefault(re.sub(r"[.\-]", "_", name), op_name)
        # the backend config as JSON ("name":"...") or, for typed-FFI custom calls such as Pallas-Triton's, as an
        # MLIR dictionary attribute (name = "...")
        k = re.search(r'(?:\\?"name\\?"\s*:|\bname\s*=)\s*\\?"([\w.\-]+)\\?"', before + after)
        if k and "custom-call(" in before:
            out.setdefault(k.group(1), op_name)
    return out


def gpu_kernel_events(trace_dir: str) -> list[dict]:
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        d = json.load(f)
    events = d["traceEvents"] if isinstance(d, dict) else d
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    if not gpu_pids:  # a CPU smoke run: the thunks executed on the host, tagged with their HLO op
        return [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {}) and "dur" in e]
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]


def profile(step, params, state, hlo_text: str, n_steps: int, trace_dir: str, hlo_out: str | None = None) -> dict:
    """Device time of `n_steps` decode steps by category and op (ms per step), after 3 warm-up steps; the compiled
    HLO gzipped to `hlo_out` if given."""
    def run():
        nonlocal state
        row, state = step(params, state)
        return row

    p = profile_calls(run, hlo_text, n_steps, trace_dir, warmup=3, hlo_out=hlo_out)
    return {k.replace("_per_call", "_per_step"): v for k, v in p.items()}


def profile_calls(run, hlo_text: str, n_calls: int, trace_dir: str, *, warmup: int = 1,
                  module: str | None = None, categories: tuple[str, ...] = CATEGORIES,
                  hlo_out: str | None = None) -> dict:
    """Profile `n_calls` of run() (which returns something to block on) after `warmup` calls: GPU kernel time per call
    by category (the first of `categories` among the name scopes of `hlo_text`'s ops), by op and by name-scope path.
    With `module`, kernels of other jitted modules (e.g. a prefill's cache set-up) are summed apart as
    "other_modules_ms_per_call"."""
    if hlo_out:  # the fusions behind the kernel names, gzipped (the HLO of the full model is megabytes)
        with gzip.open(hlo_out, "wt") as fh:
            fh.write(hlo_text)
    names, kernels = op_names_from_hlo(hlo_text), kernel_names_from_hlo(hlo_text)
    for _ in range(warmup):
        jax.block_until_ready(run())
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(n_calls):
            out = run()
        jax.block_until_ready(out)
    events = gpu_kernel_events(trace_dir)
    per_cat, per_op, unattributed, other_modules = defaultdict(float), defaultdict(float), 0.0, 0.0
    per_scope = defaultdict(lambda: [0.0, 0])  # op_name path (same for every layer) -> [ms, kernels] per call
    for e in events:
        args = e.get("args", {})
        dur = e["dur"] / 1e3 / n_calls  # us -> ms per call
        if module is not None and module not in str(args.get("hlo_module", module)):
            other_modules += dur
            continue
        hlo_op = args.get("hlo_op", "")
        op_name = names.get(hlo_op) or kernels.get(e["name"])
        if op_name is None:
            unattributed += dur
            per_op[f"(unattributed) {e['name'][:60]}"] += dur
            continue
        per_cat[category_of(op_name, categories)] += dur
        per_op[f"{hlo_op or e['name'][:40]} {op_name[-80:]}"] += dur
        per_scope[op_name][0] += dur
        per_scope[op_name][1] += 1 / n_calls
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3 / n_calls if events else 0
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:120]
    scopes = sorted(([k, round(v[0], 5), round(v[1], 2)] for k, v in per_scope.items()), key=lambda r: -r[1])
    out = {"kernel_ms_per_call": dict(per_cat), "unattributed_ms_per_call": unattributed,
           "gpu_span_ms_per_call": span, "n_events": len(events), "top_ops": top, "by_scope": scopes[:80]}
    if module is not None:
        out["other_modules_ms_per_call"] = other_modules
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", choices=["timing", "profile"], default="timing")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 64, 128, 256])
    ap.add_argument("--variants", nargs="+", default=["pallas_bf16"], choices=sorted(VARIANTS) + sorted(PATCHES))
    ap.add_argument("--extra", nargs="*", default=[],
                    help="variant@slots[@active] timed in addition, e.g. reference@128, or pallas_bf16@16@1 (a 16-row "
                         "step holding one stream: the other rows are free slots, routed to no expert)")
    ap.add_argument("--pool", type=int, default=0,
                    help="slot pool size: each step runs over the first --slots rows of a pool this large (the "
                         "server's --decode-sizes); 0 = a pool of exactly --slots")
    ap.add_argument("--context", type=int, default=512, help="mean cache rows per slot (ragged +-50%%)")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--preset", default="full", help="model shapes (tiny: a CPU smoke run of this script)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="timing: time every run this many times, round-robin after all are compiled, and report the "
                         "median of the rounds (drift over a process hits every variant alike); holds every run's "
                         "state at once, so for small slot counts (one slot's steps vary 4.7-5.3 ms within a process)")
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--plot-from", help="only draw the PNG of this decode_timing.json / decode_profile.json")
    args = ap.parse_args(argv)
    if args.plot_from:
        with open(args.plot_from) as f:
            R = json.load(f)
        return write_plot(R, os.path.join(args.out, f"decode_{R['phase']}.png"))
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    cfg = preset(args.preset)
    R = {"command": command_line(args.out), "device": str(jax.devices()[0]), "jax": jax.__version__,
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "context": args.context, "max_len": args.max_len,
         "xla_flags": os.environ.get("XLA_FLAGS", ""), "phase": args.phase, "rows": []}
    out_json = os.path.join(args.out, f"decode_{args.phase}.json")
    t = time.time()
    talker = random_talker(cfg, 0)
    graphdef, params = nnx.split(talker)
    jax.block_until_ready(params)
    log(f"talker built in {time.time() - t:.1f} s")
    fused = None  # (talker, graphdef, params) with fused projections, made on first use (new copies of those weights)
    kept = []  # --rounds: [row, compiled step, params, state] of every timed run
    runs = [(v, s, 0) for v in args.variants for s in args.slots]
    runs += [(e.split("@")[0], int(e.split("@")[1]), int((e.split("@") + [0])[2])) for e in args.extra]
    for variant, slots, active in runs:
        if time.time() - t_start > args.budget_s:
            R["rows"].append({"variant": variant, "slots": slots, "skipped": "budget"})
            continue
        backends, state_dtype, fuse = VARIANTS[PATCHES[variant][0] if variant in PATCHES else variant]
        if fuse and fused is None:
            f = nnx.merge(graphdef, params).fuse_projections()
            fused = (f, *nnx.split(f))
        model, gdef, prm = fused if fuse else (talker, graphdef, params)
        pool = max(slots, args.pool)
        row = {"variant": variant, "slots": slots, "pool": pool, "backends": dataclasses.asdict(backends),
               "ssm_state_dtype": state_dtype, "active_rows": active or slots}
        patches = variant_patches(variant)
        try:
            state = make_state(cfg, pool, args.max_len, args.context, state_dtype, active_rows=active or slots)
            step = make_step(gdef, backends, slots)
            t = time.time()
            compiled = step.lower(prm, state).compile()
            row["compile_s"] = round(time.time() - t, 1)
            hlo = compiled.as_text()
            row["launches"] = launches(hlo)  # kernels per step (experiments/hlo_census.py)
            roof = category_rooflines(model, cfg, slots, args.context, state_dtype, active)
            row["roofline_ms"] = sum(r["roofline_ms"] for r in roof.values())
            if args.phase == "timing":
                back, sync, state = time_step(compiled, prm, state)
                out, state = compiled(prm, state)  # one more step from the timed state: same inputs, same tokens
                row["tokens_digest"] = hashlib.sha1(np.asarray(out).tobytes()).hexdigest()[:12]
                set_step_time(row, back, sync)
                if args.rounds > 1:
                    row["step_ms_rounds"] = [back]
                    if room_for_another(state):
                        kept.append([row, compiled, prm, state])
                        state = None
                    else:  # this card cannot hold the next run's state beside this one: its rounds now, in a row
                        for _ in range(args.rounds - 1):
                            back, _, state = time_step(compiled, prm, state)
                            row["step_ms_rounds"].append(back)
                        row["rounds_in_place"] = True
                        set_step_time(row, float(np.median(row["step_ms_rounds"])), row["round_trip_ms"])
            else:
                p = profile(step, prm, state, hlo, args.profile_steps,
                            os.path.join(args.out, f"trace_{variant}_{slots}"),
                            os.path.join(args.out, f"hlo_{variant}_{slots}.txt.gz"))
                row.update(p)
                row["categories"] = {c: {"kernel_ms": p["kernel_ms_per_step"].get(c, 0.0), **roof.get(c, {})}
                                     for c in sorted(set(roof) | set(p["kernel_ms_per_step"]))}
            del state
        except Exception as e:  # record and go on: partial results survive
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        finally:
            patches.close()
        R["rows"].append(row)
        log({k: v for k, v in row.items() if k not in ("top_ops", "categories", "backends")})
        save_json(R, out_json)
    for _ in range(args.rounds - 1):
        for entry in kept:
            row, compiled, prm, state = entry
            back, _, entry[3] = time_step(compiled, prm, state)
            row["step_ms_rounds"].append(back)
    for row, *_ in kept:
        set_step_time(row, float(np.median(row["step_ms_rounds"])), row["round_trip_ms"])
        log({"variant": row["variant"], "slots": row["slots"], "step_ms_rounds": row["step_ms_rounds"]})
    if kept:
        save_json(R, out_json)
    write_markdown(R, os.path.join(args.out, f"decode_{args.phase}.md"))
    write_plot(R, os.path.join(args.out, f"decode_{args.phase}.png"))


def room_for_another(state) -> bool:
    """Whether the device has free memory for another run's state of this size (twice it: the state and the step's
    donated copy) beside the states --rounds keeps; on an 80 GB H100 two 128-slot states do not fit beside the full
    model (experiments/results/decode_2026-12-08_h100/). True where the backend reports no memory figures."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return True
    need = 2 * sum(x.nbytes for x in jax.tree.leaves(state))
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0) > need


def set_step_time(row: dict, back: float, sync: float):
    """The timing fields of a run's row from its back-to-back and round-trip ms per step."""
    streams = row["active_rows"]  # frames come from the rows that hold streams
    row.update(step_ms=back, round_trip_ms=sync, frames_per_s=1e3 * streams / back,
               audio_s_per_s=1e3 * streams / back / (44100 / 2048), pct_roofline=100 * row["roofline_ms"] / back)


def variant_patches(variant: str) -> contextlib.ExitStack:
    """Apply the variant's PATCHES (undone by closing the returned stack); the step is traced while they hold."""
    return patched(PATCHES.get(variant, (None, []))[1])


def write_plot(R: dict, path: str):
    """timing: ms per step vs slots per variant, with the roofline; profile: kernel ms vs roofline ms by category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if R["phase"] == "timing":
        rows = [r for r in R["rows"] if "step_ms" in r]
        for v in sorted({r["variant"] for r in rows}):
            pts = sorted((r["slots"], r["step_ms"]) for r in rows if r["variant"] == v)
            ax.plot(*zip(*pts), "o-", label=v)
        roof = sorted({(r["slots"], r["roofline_ms"]) for r in rows if r["ssm_state_dtype"] == "bfloat16"})
        if roof:
            ax.plot(*zip(*roof), "k--", label="roofline (bf16 state)")
        ax.set_xlabel("slots (streams)")
        ax.set_ylabel("ms per decode step")
        ax.set_xscale("log", base=2)
        ax.legend()
    else:
        r = next(r for r in R["rows"] if "categories" in r)
        cats = sorted(r["categories"].items(), key=lambda kv: -kv[1]["kernel_ms"])
        names = [c for c, _ in cats]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [v["kernel_ms"] for _, v in cats], 0.4, label="measured kernel time")
        ax.bar([i + 0.2 for i in x], [v.get("roofline_ms", 0.0) for _, v in cats], 0.4, label="roofline")
        ax.set_xticks(list(x), names, rotation=45, ha="right")
        ax.set_ylabel(f"ms per decode step ({r['slots']} slots)")
        ax.legend()
    ax.set_title(f"decode step {R['phase']}, {R['device']}, {R['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_markdown(R: dict, path: str):
    lines = [f"# decode step, {R['phase']} ({R['device']}, jax {R['jax']}, {R['date']})", "",
             f"Command: `{R['command']}`; context {R['context']} rows (ragged +-50%), max_len {R['max_len']}, "
             f"XLA_FLAGS `{R['xla_flags']}`.", ""]
    if R["phase"] == "timing":
        lines += ["| variant | slots | step ms (back to back) | round trip ms | frames/s | audio s/s | roofline ms | "
                  "% of roofline | kernels | compile s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in R["rows"]:
            if "step_ms" not in r:
                lines.append(f"| {r['variant']} | {r['slots']} | {r.get('error') or r.get('skipped')} ||||||||")
                continue
            n = f"{r['slots']} of {r['pool']}" if r.get("pool", r["slots"]) > r["slots"] else str(r["slots"])
            if r.get("active_rows", r["slots"]) < r["slots"]:
                n += f" ({r['active_rows']} active)"
            lines.append(f"| {r['variant']} | {n} | {r['step_ms']:.2f} | {r['round_trip_ms']:.2f} | "
                         f"{r['frames_per_s']:.0f} | {r['audio_s_per_s']:.1f} | {r['roofline_ms']:.2f} | "
                         f"{r['pct_roofline']:.0f}% | {r.get('launches', '')} | {r['compile_s']} |")
        rounds = [r for r in R["rows"] if "step_ms_rounds" in r]
        if rounds:
            lines += ["", "Step ms is the median of the rounds, timed round-robin after every run was compiled:", ""]
            lines += [f"- {r['variant']} @ {r['slots']}: " + " / ".join(f"{t:.2f}" for t in r["step_ms_rounds"])
                      for r in rounds]
    else:
        for r in R["rows"]:
            if "categories" not in r:
                lines.append(f"{r['variant']} @ {r['slots']}: {r.get('error') or r.get('skipped')}")
                continue
            busy = sum(r["kernel_ms_per_step"].values()) + r["unattributed_ms_per_step"]
            lines += [f"## {r['variant']}, {r['slots']} slots: GPU busy {busy:.2f} ms per step, kernel span "
                      f"{r['gpu_span_ms_per_step']:.2f} ms", "",
                      "| category | kernel ms/step | roofline ms | % of roofline | bytes (GB) | GFLOP |",
                      "|---|---|---|---|---|---|"]
            cats = sorted(r["categories"].items(), key=lambda kv: -kv[1]["kernel_ms"])
            for c, v in cats:
                rl = v.get("roofline_ms", 0.0)
                pct = f"{100 * rl / v['kernel_ms']:.0f}%" if v["kernel_ms"] > 0 and rl else "-"
                lines.append(f"| {c} | {v['kernel_ms']:.3f} | {rl:.3f} | {pct} | {v.get('bytes', 0) / 1e9:.3f} | "
                             f"{v.get('flops', 0) / 1e9:.1f} |")
            lines.append(f"| (unattributed) | {r['unattributed_ms_per_step']:.3f} | | | | |")
            lines += ["", "By op (name-scope path, summed over layers; ms and kernels per step):", "",
                      "| ms/step | kernels | op |", "|---|---|---|"]
            lines += [f"| {ms:.3f} | {n:g} | `{name[-110:]}` |" for name, ms, n in r.get("by_scope", [])[:45]]
            lines += ["", "Top kernels (ms per step):", ""] + [f"- {ms:.3f} {name}" for name, ms in r["top_ops"][:10]]
            lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    from drama3_jax.xla_flags import apply_gpu_memory_fraction

    apply_gpu_memory_fraction()
    main()
