"""The kernel census of compiled XLA programs (experiments/hlo_census.py): the parser on a CPU-compiled program
(same HLO text format as the GPU's), and a deviceless compile for an H200 (`make deviceless`, which `make test`
runs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from experiments.hlo_census import census, dependent_chain, parse_computations, summarise, type_bytes


def _program(x, c):
    def body(i, c):
        return jax.lax.dynamic_update_slice(c, jnp.sin(x[None]) * i, (i, 0))

    return jnp.exp(x) + 1.0, jax.lax.fori_loop(0, 5, body, c)


def _cpu_hlo() -> str:
    x, c = jnp.ones((256,), jnp.float32), jnp.zeros((8, 256), jnp.float32)
    return jax.jit(_program, donate_argnums=1).lower(x, c).compile().as_text()


def test_type_bytes_of_arrays_tuples_and_fp8():
    assert type_bytes("bf16[128,2048]{1,0}") == 128 * 2048 * 2
    assert type_bytes("(f32[2]{0}, s32[], pred[3])") == 8 + 4 + 3
    assert type_bytes("f8e4m3fn[256,512,2048]{2,1,0}") == 256 * 512 * 2048
    assert type_bytes("token[]") == 0


def test_census_walks_the_loop_body_its_trip_count_times():
    hlo = _cpu_hlo()
    comps, entry = parse_computations(hlo)
    assert entry in comps and any(i["opcode"] == "while" for i in comps[entry])
    kernels = census(hlo)
    in_loop = [k for k in kernels if k.times == 5]
    assert in_loop and all(k.op_name.startswith("jit(_program)/while") or k.kind == "copy" for k in in_loop)
    s = summarise(kernels)
    assert s["launches"] == sum(k.times for k in kernels) == len(kernels) - len(in_loop) + 5 * len(in_loop)


def test_in_place_update_counts_the_update_not_the_buffer():
    kernels = census(_cpu_hlo())
    dus = [k for k in kernels if k.detail == "in place"]
    assert len(dus) == 1
    # operands: the [8, 256] buffer (aliased, not counted), the [1, 256] row and the s32 index
    assert dus[0].read_bytes == dus[0].write_bytes == 256 * 4 + 4
    elementwise = next(k for k in kernels if k.op_name.endswith("/add") and k.kind.startswith("fusion"))
    assert (elementwise.read_bytes, elementwise.write_bytes) == (256 * 4, 256 * 4)


def test_dependent_chain_follows_data_not_program_order():
    """Three chained products and one beside them: the chain holds the three (and whatever XLA runs between them),
    never the independent product; a loop body's chain counts once per trip."""
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    x = jax.random.normal(ks[0], (64, 64))
    ws = [jax.random.normal(k, (64, 64)) for k in ks[1:]]

    def prog(x, w1, w2, w3, w4):
        return jnp.tanh(jnp.tanh(x @ w1) @ w2) @ w3, x @ w4

    hlo = jax.jit(prog).lower(x, *ws).compile().as_text()
    length, path = dependent_chain(hlo)
    kernels = census(hlo)
    dots = [k.name for k in kernels if "dot" in k.kind or "dot" in k.op_name]
    assert 3 <= length < len(kernels) and len(dots) == 4
    assert sum(name in path for name in dots) == 3
    loop_len, loop_path = dependent_chain(_cpu_hlo())
    assert loop_len >= 5 and 0 < len(loop_path) < loop_len  # the body's chain is listed once, counted per trip


def test_codec_step_compiles_for_an_h200_without_a_gpu():
    """Deviceless AOT for the H200 (needs `make deviceless`): the tiny codec's streaming step, whose decoder convs
    become cuDNN custom calls, only the GPU compiler emits."""
    from flax import nnx

    from drama3_jax.codec import streaming
    from drama3_jax.codec.config import codec_preset
    from drama3_jax.codec.model import ModifiedDAC
    from kernels.h200_lowering import compile_for_h200

    cfg = codec_preset("tiny")
    graphdef, params = nnx.split(nnx.eval_shape(lambda: ModifiedDAC(cfg, dtype=jnp.bfloat16)))
    state = jax.eval_shape(lambda: nnx.merge(graphdef, params).init_decode_state(4))
    codes = jax.ShapeDtypeStruct((4, cfg.n_codebooks, 2), jnp.int32)
    hlo = compile_for_h200(streaming._step, graphdef, params, state, codes, None, static_argnums=(0,))
    kinds = {k.kind for k in census(hlo)}
    assert "conv" in kinds and "gemm" in kinds, kinds


@pytest.mark.slow
def test_census_script_on_the_tiny_presets(tmp_path):
    """The three program targets of experiments/hlo_census.py, compiled for an H200 at the tiny shapes (~40 s: the
    slow tier, with the other experiment harnesses): each run writes its launches, bytes and chain, and the Pallas
    kernels of the decode step and the prefill are in them."""
    import json

    from experiments.hlo_census import main

    for target in (["decode", "--slots", "2"], ["prefill"], ["codec", "--streams", "2", "--frames", "2"]):
        main(["--out", str(tmp_path / target[0]), "--preset", "tiny", *target])
    runs = {d: json.loads((tmp_path / d / "hlo_census.json").read_text())["runs"] for d in ("decode", "prefill",
                                                                                             "codec")}
    for d, (run,) in runs.items():
        s = run["summary"]
        assert 0 < s["dependent_chain"] <= s["launches"] and s["bytes_mb"] > 0, (d, s)
        assert (tmp_path / d / "hlo_census.md").read_text().startswith("# Kernel census")
    assert "pallas" in runs["decode"][0]["summary"]["by_kind"] and "pallas" in runs["prefill"][0]["summary"]["by_kind"]
    assert "conv" in runs["codec"][0]["summary"]["by_kind"]
