"""On the GPU: the kernels that read fused-projection outputs in place, and the fused add + RMSNorm + e4m3 groups,
against their separate-input / reference forms at the decode step's shapes (128 rows, Drama 3 widths).

  python experiments/fused_inputs_check.py --out $OUT/check

Writes fused_inputs_check.json; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kernels.gdn.api import gdn_decode_step
from kernels.norm.api import add_rms_norm
from kernels.router.api import router_topk


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=128)
    args = ap.parse_args()
    B, H, E, hk, hv, d = args.rows, 2048, 256, 16, 32, 128
    ks = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    rnd = lambda shape, dt=jnp.bfloat16, s=1.0: (jax.random.normal(next(ks), shape) * s).astype(dt)  # noqa: E731
    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
    res = {"device": str(jax.devices()[0]), "rows": B}

    x, r, w = rnd((B, H), s=3.0), rnd((B, H)), rnd((H,), s=0.2)
    got = jax.jit(lambda *a: add_rms_norm(*a, eps=1e-6, quant_group=128, backend="pallas_triton"))(x, r, w)
    # the reference op by op (not jitted): under jit XLA may keep the residual sum in fp32 inside its fusion (excess
    # precision), while the model's PyTorch reference, like the kernel, normalises the sum rounded to bf16
    want = add_rms_norm(x, r, w, eps=1e-6, quant_group=128, backend="reference")
    res["norm_sum_equal"] = bool((f32(got[0]) == f32(want[0])).all())
    res["norm_y_max_rel"] = float(np.max(np.abs(f32(got[1]) - f32(want[1])) / (np.abs(f32(want[1])) + 1e-3)))
    res["norm_y_mismatch"] = float(np.mean(f32(got[1]) != f32(want[1])))
    # a y element one bf16 step away can be its group's maximum and move the group's scale, so the e4m3 codes are
    # compared dequantised: within one e4m3 step (3 mantissa bits)
    deq = lambda q, sc: (f32(q).reshape(B, -1, 128) * f32(sc)[..., None]).reshape(B, H)  # noqa: E731
    dq, dq_ref = deq(got[2], got[3]), deq(want[2], want[3])
    res["norm_deq_max_rel"] = float(np.max(np.abs(dq - dq_ref) / (np.abs(dq_ref) + 1e-2)))
    res["norm_scale_max_rel"] = float(np.max(np.abs(f32(got[3]) / f32(want[3]) - 1)))

    C = 2 * hk * d + hv * d
    proj = rnd((B, C + hv * d + 2 * hv))
    b_col, a_col = C + hv * d, C + hv * d + hv
    conv, ssm = rnd((B, 3, C)), rnd((B, hv, d, d), s=0.2)
    cw, A_log, dt = rnd((C, 4), s=0.5), rnd((hv,), jnp.float32, 0.5), rnd((hv,), jnp.float32, 0.5)
    kw = dict(num_k_heads=hk, head_k_dim=d, head_v_dim=d, v_major=True, backend="pallas_triton",
              interpret=jax.default_backend() != "gpu")  # a CPU smoke run interprets
    fused = jax.jit(lambda p, c, s: gdn_decode_step(p, None, None, c, s, cw, A_log, dt, a_col=a_col, b_col=b_col,
                                                    **kw))(proj, conv, ssm)
    sep = jax.jit(lambda p, c, s: gdn_decode_step(p[:, :C], p[:, a_col:a_col + hv], p[:, b_col:b_col + hv], c, s,
                                                  cw, A_log, dt, **kw))(proj, conv, ssm)
    res["gdn_in_place_equal"] = all(bool((f32(u) == f32(v)).all()) for u, v in zip(fused, sep))

    logits = rnd((B, E + 1088), jnp.float32, 3.0)
    ids, wts = jax.jit(lambda z: router_topk(z, 8, num_experts=E, backend="pallas_triton"))(logits)
    ids_s, wts_s = jax.jit(lambda z: router_topk(z[:, :E], 8, backend="pallas_triton"))(logits)
    res["router_in_place_equal"] = bool((np.asarray(ids) == np.asarray(ids_s)).all() and
                                        (f32(wts) == f32(wts_s)).all())
    ok = (res["norm_sum_equal"] and res["norm_y_max_rel"] <= 8e-3 and res["norm_y_mismatch"] < 1e-2
          and res["norm_deq_max_rel"] <= 2 ** -3
          and res["norm_scale_max_rel"] <= 8e-3 and res["gdn_in_place_equal"] and res["router_in_place_equal"])
    res["ok"] = ok
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fused_inputs_check.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
