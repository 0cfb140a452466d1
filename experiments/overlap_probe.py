"""Does one XLA executable overlap the talker's decode step with a streaming codec call on the GPU?

The server runs the decode step (memory-bound: expert weights and recurrent state) and the codec call (compute-bound
convolutions) as separate executables, one after the other on one stream. Inside one executable, XLA's CUDA graphs
scheduled `CONCURRENT` (drama3_jax/xla_flags.py) keep only data dependencies, so two independent chains of kernels may
run side by side. This probe measures whether they do, before the engine is built around it:

    python experiments/overlap_probe.py --out DIR [--slots 128] [--codec 128:8] [--preset full]

In one process, each back to back after warm-up (median of windows, host clock around block_until_ready):
  decode  the frame step over `--slots` slots (the server's kernels, experiments/decode_profile.py variant
          `pallas_bf16_w8a8_fused`)
  codec   the streaming codec step, B streams x T new frames (bf16)
  both    one jitted function that runs both on their own (independent) inputs
overlap = (decode + codec - both) / min(decode, codec): 0 when the two run one after the other, 1 when the shorter
one is hidden entirely. Writes DIR/overlap_probe.json and prints a table. Run it once more with
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
from drama3_jax.generate import frame_step_prefix  # noqa: E402
from drama3_jax.random_init import random_talker  # noqa: E402
from experiments.common import command_line, log, save_json  # noqa: E402
from experiments.decode_profile import VARIANTS, make_state  # noqa: E402

VARIANT = "pallas_bf16_w8a8_fused"


def median_ms(call, carry, windows: int, per_window: int):
    """-> (median ms per call over `windows` windows of `per_window` back-to-back calls, carry). `call(carry)` returns
    (outputs to wait on, next carry); 3 warm-up calls first."""
    for _ in range(3):
        out, carry = call(carry)
    jax.block_until_ready(out)
    times = []
    for _ in range(windows):
        t = time.perf_counter()
        for _ in range(per_window):
            out, carry = call(carry)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / per_window)
    return 1e3 * float(np.median(times)), carry


def parse_codec(text: str) -> tuple[int, int]:
    streams, frames = (int(v) for v in text.split(":"))
    if streams < 1 or frames < 1:
        raise argparse.ArgumentTypeError(f"--codec wants STREAMS:FRAMES, both >= 1, got {text!r}")
    return streams, frames


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="full", help="model and codec shapes (tiny: a CPU smoke run)")
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--codec", type=parse_codec, default=(128, 8), help="STREAMS:FRAMES per codec call")
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

    def codec_step(cp, cs, c):
        return nnx.merge(cgdef, cp).decode_step(cs, c, None)

    def both(p, s, cp, cs, c):
        row, s = decode(p, s)
        audio, cs = codec_step(cp, cs, c)
        return row, s, audio, cs

    decode_j = jax.jit(decode, donate_argnums=(1,))
    codec_j = jax.jit(codec_step, donate_argnums=(1,))
    both_j = jax.jit(both, donate_argnums=(1, 3))
    init_codec = jax.jit(lambda cp: nnx.merge(cgdef, cp).init_decode_state(streams))
    state = make_state(cfg, args.slots, args.max_len, args.context, state_dtype)
    cstate = init_codec(cparams)
    R = {"command": command_line(args.out), "device": str(jax.devices()[0]), "jax": jax.__version__,
         "xla_flags": os.environ.get("XLA_FLAGS", ""), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
         "preset": args.preset, "variant": VARIANT, "slots": args.slots, "codec_streams": streams,
         "codec_frames": frames, "context": args.context}
    w = (args.windows, args.per_window)

    def run_decode(s):
        row, s = decode_j(params, s)
        return row, s

    def run_codec(cs):
        audio, cs = codec_j(cparams, cs, codes)
        return audio, cs

    def run_both(carry):
        row, s, audio, cs = both_j(params, carry[0], cparams, carry[1], codes)
        return (row, audio), (s, cs)

    R["decode_ms"], state = median_ms(run_decode, state, *w)
    log(f"decode step {R['decode_ms']:.2f} ms")
    R["codec_ms"], cstate = median_ms(run_codec, cstate, *w)
    log(f"codec call {R['codec_ms']:.2f} ms")
    R["both_ms"], (state, cstate) = median_ms(run_both, (state, cstate), *w)
    log(f"both in one executable {R['both_ms']:.2f} ms")
    R["serial_ms"] = R["decode_ms"] + R["codec_ms"]
    R["overlap"] = (R["serial_ms"] - R["both_ms"]) / min(R["decode_ms"], R["codec_ms"])
    save_json(R, os.path.join(args.out, "overlap_probe.json"))
    print(f"\n{'decode ms':>10} {'codec ms':>9} {'sum ms':>8} {'both ms':>8} {'overlap':>8}   XLA_FLAGS={R['xla_flags']}")
    print(f"{R['decode_ms']:10.2f} {R['codec_ms']:9.2f} {R['serial_ms']:8.2f} {R['both_ms']:8.2f} "
          f"{R['overlap']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
