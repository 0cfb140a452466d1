"""Does one XLA executable overlap the talker's decode step with a streaming codec call on the GPU?

The server runs the decode step (memory-bound: expert weights and recurrent state), the codec call and the packed
prefill call (both compute-bound) as separate executables, one after the other on one stream. Inside one executable,
XLA's CUDA graphs scheduled `CONCURRENT` (drama3_jax/xla_flags.py) keep only data dependencies, so two independent
chains of kernels may run side by side. This probe measures whether they do, before the engine is built around it:

    python experiments/overlap_probe.py --out DIR [--slots 128] [--codec 128:8] [--prefill 3072:8] [--preset full]

In one process, each back to back after warm-up (experiments/decode_profile.py `time_step`: median of windows,
host clock around block_until_ready):
  decode   the frame step over `--slots` slots (the server's kernels, experiments/decode_profile.py variant
           `pallas_bf16_w8a8_fused`)
  X        the partner alone: `codec` (the streaming codec step, B streams x T new frames, bf16) and, unless
           `--prefill 0:0`, `prefill` (a packed prefill call of N rows over L lanes of equal random prompts)
  decode+X one jitted function that runs both on their own (independent) inputs
overlap = (decode + X - both) / min(decode, X): 0 when the two run one after the other, 1 when the shorter one is
hidden entirely. Writes DIR/overlap_probe.json and prints a table. Run it once more with
XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=LHS for XLA's serial graph order.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from drama3_jax.codec import codec_preset  # noqa: E402
from drama3_jax.codec.convert import random_codec  # noqa: E402
from drama3_jax.config import preset  # noqa: E402
from drama3_jax.generate import frame_step_prefix, prefill_packed  # noqa: E402
from drama3_jax.model import init_model_cache  # noqa: E402
from drama3_jax.packing import Packing, pack_layout  # noqa: E402
from drama3_jax.random_init import random_talker  # noqa: E402
from experiments.common import command_line, log, save_json  # noqa: E402
from experiments.decode_profile import VARIANTS, make_state, time_step  # noqa: E402

VARIANT = "pallas_bf16_w8a8_fused"


def parse_pair(text: str) -> tuple[int, int]:
    """'A:B' with A, B >= 1 (or 0:0, which `--prefill` takes as 'none')."""
    a, b = (int(v) for v in text.split(":"))
    if (a, b) != (0, 0) and (a < 1 or b < 1):
        raise argparse.ArgumentTypeError(f"want A:B, both >= 1 (or 0:0), got {text!r}")
    return a, b


def prefill_inputs(cfg, num_rows: int, lanes: int, chunk: int, rng):
    """Random prompts of equal length filling ~94% of a packed call: (rows [1, N, 1+K], next_rows, lengths [L],
    Packing)."""
    n = min(chunk, int(0.94 * num_rows) // lanes)
    lens = np.full(lanes, n, np.int64)
    offsets, unpack, pack = pack_layout(lens, num_rows, lanes, chunk)
    rows = np.zeros((1, num_rows, cfg.row_width), np.int32)
    for o in offsets:
        rows[0, o:o + n, 0] = rng.integers(0, cfg.text.vocab_size, n)
        rows[0, o:o + n, 1:] = rng.integers(0, cfg.tower.vocab_size, (n, cfg.row_width - 1))
    next_rows = np.zeros_like(rows)
    for o in offsets:
        next_rows[0, o:o + n - 1] = rows[0, o + 1:o + n]
    return (jnp.asarray(rows), jnp.asarray(next_rows), jnp.asarray(lens, jnp.int32),
            Packing(jnp.asarray(unpack), jnp.asarray(pack)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="full", help="model and codec shapes (tiny: a CPU smoke run)")
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--codec", type=parse_pair, default=(128, 8), help="STREAMS:FRAMES per codec call")
    ap.add_argument("--prefill", type=parse_pair, default=(3072, 8),
                    help="ROWS:LANES of the packed prefill call paired with the step (0:0: none)")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="most rows per prompt (the server's default)")
    ap.add_argument("--prefill-max-len", type=int, default=1026, help="cache rows per prompt (the server's default)")
    ap.add_argument("--context", type=int, default=512, help="mean cache rows per slot (ragged +-50%%)")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--per-window", type=int, default=8)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    backends, state_dtype, _ = VARIANTS[VARIANT]
    cfg = preset(args.preset)
    t = time.time()
    talker = random_talker(cfg, 0).fuse_projections()
    gdef, params = nnx.split(talker)
    codec = random_codec(codec_preset(args.preset), seed=0, dtype=jnp.bfloat16)
    cgdef, cparams = nnx.split(codec)
    jax.block_until_ready((params, cparams))
    log(f"talker and codec built in {time.time() - t:.1f} s")

    streams, frames = args.codec
    rng = np.random.default_rng(0)
    codes = jnp.asarray(np.stack([rng.integers(0, n, (streams, frames)) for n in codec.cfg.codebook_sizes], axis=1),
                        jnp.int32)

    def decode(p, s):
        return frame_step_prefix(nnx.merge(gdef, p), s, args.slots, backends)

    def codec_call(cp, cs):
        audio, cs = nnx.merge(cgdef, cp).decode_step(cs, codes, None)
        return audio, cs

    # partner name -> (its params, function (params, carry) -> (output, next carry), first carry); the carry is donated
    partners = {"codec": (cparams, codec_call,
                          jax.jit(lambda cp: nnx.merge(cgdef, cp).init_decode_state(streams))(cparams))}
    rows_n, lanes = args.prefill
    if rows_n:
        prompt = prefill_inputs(cfg, rows_n, lanes, args.prefill_chunk, rng)

        def prefill_call(p, cache):  # a fresh cache each call, as the engine's prefill: the carry only feeds the shape
            cache, h = prefill_packed(nnx.merge(gdef, p), cache, *prompt, backends)
            return h, cache

        partners["prefill"] = (params, prefill_call, init_model_cache(cfg, lanes, args.prefill_max_len, jnp.bfloat16,
                                                                      jnp.dtype(state_dtype)))
    R = {"command": command_line(args.out), "device": str(jax.devices()[0]), "jax": jax.__version__,
         "xla_flags": os.environ.get("XLA_FLAGS", ""), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
         "preset": args.preset, "variant": VARIANT, "slots": args.slots, "context": args.context,
         "codec": {"streams": streams, "frames": frames}, "prefill": {"rows": rows_n, "lanes": lanes}, "pairs": {}}
    w = (args.windows, args.per_window)
    decode_j = jax.jit(decode, donate_argnums=(1,))
    state = make_state(cfg, args.slots, args.max_len, args.context, state_dtype)
    R["decode_ms"], _, state = time_step(decode_j, params, state, *w)
    log(f"decode step {R['decode_ms']:.2f} ms")
    lines = []
    for name, (xp, fn, carry) in partners.items():
        alone = jax.jit(fn, donate_argnums=(1,))

        def pair_step(ps, sc, fn=fn):  # (decode params, partner params), (decode state, partner carry)
            (row, s), (out, c) = decode(ps[0], sc[0]), fn(ps[1], sc[1])
            return (row, out), (s, c)

        x_ms, _, carry = time_step(alone, xp, carry, *w)
        both_ms, _, (state, carry) = time_step(jax.jit(pair_step, donate_argnums=(1,)), (params, xp),
                                               (state, carry), *w)
        serial = R["decode_ms"] + x_ms
        pair = {"alone_ms": x_ms, "with_decode_ms": both_ms, "serial_ms": serial,
                "overlap": (serial - both_ms) / min(R["decode_ms"], x_ms)}
        R["pairs"][name] = pair
        log(f"{name}: {pair}")
        save_json(R, os.path.join(args.out, "overlap_probe.json"))
        lines.append(f"{name:>8} {R['decode_ms']:10.2f} {x_ms:9.2f} {serial:8.2f} {both_ms:8.2f} "
                     f"{pair['overlap']:8.2f}")
    print(f"\n{'partner':>8} {'decode ms':>10} {'alone ms':>9} {'sum ms':>8} {'both ms':>8} {'overlap':>8}"
          f"   XLA_FLAGS={R['xla_flags']}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
