"""Tiny checkpoint writer, safetensors I/O, the Orbax converter and the loader."""

from __future__ import annotations

import hashlib
import json
import math
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest

import drama3_jax
from drama3_jax.checkpoint import CheckpointError, checkpoint_tensors, convert, write_random_checkpoint
from drama3_jax.config import tiny_config
from drama3_jax.nn import dequantize_block_fp8, quantize_block_fp8
from drama3_jax.safetensors_io import CheckpointReader, SafetensorsFile, write_safetensors


def _digest(d):
    h = hashlib.sha256()
    for p in sorted(d.glob("*")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def test_writer_layout_and_determinism(tiny_hf_dir, tiny_cfg, tmp_path):
    index = json.loads((tiny_hf_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all(s.startswith("model-") and "-of-" in s for s in shards)
    r = CheckpointReader(tiny_hf_dir)
    specs = {s.name: s for s in checkpoint_tensors(tiny_cfg)}
    assert set(r.names()) == set(specs)
    assert r.info("model.language_model.layers.0.mlp.experts.3.gate_proj.weight")[0] == "F8_E4M3"
    assert r.info("model.language_model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv") == ("F32", (1, 1))
    assert r.info("model.language_model.embed_tokens.weight")[0] == "BF16"
    assert r.info("model.language_model.layers.3.self_attn.q_proj.weight")[1] == (2 * 4 * 16, 64)
    assert r.info("model.language_model.layers.0.linear_attn.conv1d.weight")[1] == (tiny_cfg.text.linear_conv_dim, 1, 4)
    a = write_random_checkpoint(tiny_cfg, tmp_path / "a", seed=1234)
    b = write_random_checkpoint(tiny_cfg, tmp_path / "b", seed=1235)
    assert _digest(a) == _digest(tiny_hf_dir) != _digest(b)


def test_safetensors_io_round_trip_and_torch_interop(tmp_path):
    import torch
    from safetensors.torch import load_file

    rng = np.random.default_rng(0)
    tensors = [("a", rng.normal(size=(3, 5)).astype(ml_dtypes.bfloat16)),
               ("b", rng.normal(size=(4, 4)).astype(ml_dtypes.float8_e4m3fn)),
               ("c", rng.normal(size=(7,)).astype(np.float32)), ("d", np.arange(6, dtype=np.int64).reshape(2, 3))]
    write_safetensors(tmp_path / "x.safetensors", tensors)
    f = SafetensorsFile(tmp_path / "x.safetensors")
    for n, a in tensors:
        np.testing.assert_array_equal(f.get(n).view(np.uint8), a.view(np.uint8))
    t = load_file(tmp_path / "x.safetensors")
    assert t["b"].dtype == torch.float8_e4m3fn and t["a"].dtype == torch.bfloat16
    np.testing.assert_array_equal(t["b"].float().numpy(), tensors[1][1].astype(np.float32))


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (3, 512, 128), (40, 17)])
def test_block_fp8_quantise_dequantise(shape):
    w = np.random.default_rng(1).normal(size=shape).astype(np.float32) * 3
    q, s = quantize_block_fp8(w, (128, 128))
    assert q.dtype == ml_dtypes.float8_e4m3fn
    assert s.shape == shape[:-2] + (math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128))
    back = np.asarray(dequantize_block_fp8(q, s, (128, 128)))
    assert np.max(np.abs(back - w)) / np.max(np.abs(w)) < 0.07  # e4m3 has a 3-bit mantissa
    # the dequantisation is exactly fp8 value x its block's scale
    i, j = shape[-2] - 1, shape[-1] - 1
    idx = (0,) * (len(shape) - 2)
    assert back[idx + (i, j)] == np.float32(q[idx + (i, j)]) * s[idx + (i // 128, j // 128)]


def test_converter_round_trip(tiny_hf_dir, tiny_fp8_dir, tiny_cfg):
    model = drama3_jax.load_talker(tiny_fp8_dir)
    state = {jax.tree_util.keystr(k): v for k, v in
             jax.tree_util.tree_flatten_with_path(nnx_pure(model))[0]}
    r = CheckpointReader(tiny_hf_dir)
    for spec in checkpoint_tensors(tiny_cfg):
        key = "".join(f"[{p!r}]" for p in spec.path)
        got = np.asarray(state[key])
        if spec.index is not None:
            got = got[spec.index]
        want = r.get(spec.name)
        assert got.dtype == want.dtype, spec.name
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=spec.name)


def nnx_pure(model):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model))


def _copy_ckpt(src, dst, edit):
    """Rewrite a checkpoint into one shard after `edit(dict name->array)`."""
    r = CheckpointReader(src)
    tensors = {n: r.get(n) for n in r.names()}
    edit(tensors)
    dst.mkdir()
    write_safetensors(dst / "model.safetensors", list(tensors.items()))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.language_model.layers.2.linear_attn.A_log"), "missing.*layers.2.linear_attn.A_log"),
    (lambda t: t.update({"model.language_model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}),
     "unexpected.*layers.0.mlp.extra.weight"),
    (lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:-1]}), "lm_head.weight.*shape"),
    (lambda t: t.update({"model.language_model.layers.1.mlp.experts.0.up_proj.weight":
                         t["model.language_model.layers.1.mlp.experts.0.up_proj.weight"].astype(ml_dtypes.bfloat16)}),
     "experts.0.up_proj.weight.*dtype"),
])
def test_converter_errors_name_the_tensor(tiny_hf_dir, tmp_path, edit, message):
    bad = _copy_ckpt(tiny_hf_dir, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        convert(bad, tmp_path / "out", progress=False)


def _conversion_peak(tmp_path, layers: int):
    base = tiny_config()
    cfg = base.replace_text(num_hidden_layers=layers, layer_types=base.text.layer_types * (layers // 4),
                            num_experts=64, moe_intermediate_size=512)
    src = write_random_checkpoint(cfg, tmp_path / f"hf{layers}", seed=0)
    total = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    tracemalloc.start()
    stats = convert(src, tmp_path / f"out{layers}", progress=False)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert stats.groups == layers + 3  # embed, layers, head, tower
    return total, peak, stats.peak_group_bytes


def test_converter_memory_stays_bounded(tmp_path):
    """Host memory during conversion is one layer group, not the checkpoint: doubling the number of layers adds
    tensor data to the file but (almost) nothing to the peak traced memory."""
    import orbax.checkpoint  # noqa: F401  (import-time allocations are not conversion memory)

    t8, p8, g8 = _conversion_peak(tmp_path, 8)
    t16, p16, g16 = _conversion_peak(tmp_path, 16)
    print(f"8 layers: file {t8 / 2**20:.1f} MiB, peak {p8 / 2**20:.1f} MiB; 16 layers: file {t16 / 2**20:.1f} MiB, "
          f"peak {p16 / 2**20:.1f} MiB; one group {g16 / 2**20:.2f} MiB")
    assert g8 == g16
    assert p16 - p8 < 0.2 * (t16 - t8)
    assert p16 < t16 / 3


def test_one_directory_holds_all_three_parts(tmp_path, tiny_cfg, capsys):
    """make_tiny_checkpoint (its main) + the convert_checkpoint CLI: talker, codec and tokenizer come back from
    drama3_jax.load; a missing codec file is exit status 1 with its path in the message (the CLI's main, in this
    process)."""
    import subprocess
    import sys

    from drama3_jax.generate import generate
    from scripts import convert_checkpoint, make_tiny_checkpoint

    hf, out = tmp_path / "hf", tmp_path / "orbax"
    make_tiny_checkpoint.main(["--out", str(hf), "--seed", "3"])  # in-process; the converter below as users run it
    assert (hf / "codec.pth").exists() and (hf / "tokenizer.json").exists()
    conv = subprocess.run([sys.executable, "-m", "scripts.convert_checkpoint", "--hf-dir", str(hf), "--out", str(out)],
                          check=True, capture_output=True, text=True)
    assert "converted" in conv.stdout
    tts = drama3_jax.load(out)
    assert tts.cfg == tiny_cfg and tts.codec is not None and tts.tokenizer is not None
    codes = generate(tts.talker, tts.tokenizer, "All three parts.", seed=0, max_new_frames=6)
    codes = np.minimum(codes, np.array(tts.codec.cfg.codebook_sizes)[:, None] - 1)
    audio = tts.codec.decode(codes)
    assert audio.shape == (codes.shape[1] * tts.codec.frame_length,) and np.isfinite(audio).all()
    capsys.readouterr()
    status = convert_checkpoint.main(["--hf-dir", str(hf), "--out", str(tmp_path / "x"), "--codec",
                                      str(tmp_path / "missing.pth")])
    assert status == 1 and "missing.pth" in capsys.readouterr().err


def test_random_talker_on_device_matches_the_checkpoint_layout(tiny_fp8_dir, tiny_cfg):
    """The in-memory random model (used for full-size speed tests) has exactly the loaded model's tree, shapes and
    dtypes, is deterministic for a seed, and runs."""
    import jax.numpy as jnp
    from flax import nnx

    from drama3_jax.codec import tiny_codec_config
    from drama3_jax.model import init_model_cache
    from drama3_jax.random_init import random_talker
    from serving.launch import random_parts_in_memory

    flat = lambda m: {jax.tree_util.keystr(k): (v.shape, v.dtype)
                      for k, v in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(m)))[0]}
    a, b = random_talker(tiny_cfg, 5), random_talker(tiny_cfg, 5)
    assert flat(a) == flat(drama3_jax.load_talker(tiny_fp8_dir))
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    talker, tok, codec = random_parts_in_memory(tiny_cfg, tiny_codec_config(), jnp.float32)
    cache = init_model_cache(tiny_cfg, 1, 32, jnp.float32)
    rows = jnp.asarray(np.array([[[tok.im_start] + [0] * 10, [tok.voice] + [0] * 10]], np.int32))
    h, _ = talker.forward(rows, cache.backbone, jnp.array([2]), fresh=True)
    assert np.isfinite(np.asarray(talker.main_logits(h))).all()
