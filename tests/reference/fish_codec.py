"""Fish's PyTorch ModifiedDAC (PyPI fish-speech==0.1.0, `fish_speech.models.dac.modded_dac` + `rvq`) as a test
reference, built at any `CodecConfig` and loaded from a codec.pth state dict.

fish-speech's declared dependencies cannot be installed (pyaudio, gradio, numpy<=1.26, torchaudio...), so the three
wheels the codec code lives in are installed with `pip --no-deps` into `<venv>/fish-reference` on first use (or
$DRAMA3_FISH_REFERENCE_DIR); their light import-time dependencies come from the `reference` extra in pyproject.toml.
`torchaudio` and `librosa` are only imported, never called, on the model path: they are replaced by stub modules
while fish's modules import (cpu-references.md section 3.1) and removed from sys.modules afterwards.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

WHEELS = ("fish-speech==0.1.0", "descript-audio-codec==1.0.0", "descript-audiotools==0.7.2")
STUBBED = ("torchaudio", "librosa")


def _install_dir() -> Path:
    return Path(os.environ.get("DRAMA3_FISH_REFERENCE_DIR", Path(sys.prefix) / "fish-reference"))


def ensure_installed() -> Path:
    """Install the three no-deps wheels once (atomically) and put them on sys.path."""
    target = _install_dir()
    if not (target / "fish_speech" / "models" / "dac" / "modded_dac.py").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".fish-reference-", dir=target.parent))
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(tmp),
               *WHEELS]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"installing the fish codec reference failed: {' '.join(cmd)}\n{done.stderr[-2000:]}")
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    if str(target) not in sys.path:
        sys.path.append(str(target))  # appended: its top-level `tools` package must not shadow anything
    return target


def _stub(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)

    def missing(attr):
        raise AttributeError(f"{name} is stubbed in tests (only imported, never used, by fish's codec)")

    mod.__getattr__ = missing
    return mod


@functools.cache
def fish_modules():
    """(modded_dac, rvq) modules of fish-speech 0.1.0."""
    ensure_installed()
    added = [n for n in STUBBED if n not in sys.modules]
    for n in added:
        sys.modules[n] = _stub(n)
    try:
        from fish_speech.models.dac import modded_dac, rvq
    finally:
        for n in added:
            sys.modules.pop(n, None)
    return modded_dac, rvq


def build_fish_codec(cfg, pth_path):
    """fish-speech's `DAC` with the sizes of `cfg` (a drama3_jax CodecConfig), as modded_dac_vq.yaml builds it, in
    eval mode, holding the state dict of `pth_path` (strict). Built on the meta device so that no time goes into
    random initialisation; loading assigns the file's (memory-mapped) tensors."""
    with torch.device("meta"):
        model = _build(cfg)
    sd = torch.load(pth_path, map_location="cpu", mmap=True, weights_only=True)
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval()


def _build(cfg):
    M, R = fish_modules()
    et, qt = cfg.encoder_transformer, cfg.quantizer_transformer

    def args(t, **kw):
        return dict(block_size=t.block_size, n_local_heads=-1, head_dim=t.head_dim, rope_base=t.rope_base,
                    norm_eps=t.norm_eps, dropout_rate=0.1, attn_dropout_rate=0.1, channels_first=True, **kw)

    def quantizer_transformer():
        return M.WindowLimitedTransformer(
            causal=True, window_size=qt.window, input_dim=cfg.latent_dim,
            config=M.ModelArgs(**args(qt, n_layer=qt.n_layer, n_head=qt.n_head, dim=qt.dim,
                                      intermediate_size=qt.intermediate_size)))

    quantizer = R.DownsampleResidualVectorQuantize(
        input_dim=cfg.latent_dim, n_codebooks=cfg.n_residual_codebooks, codebook_size=cfg.codebook_size,
        codebook_dim=cfg.codebook_dim, quantizer_dropout=0.5, downsample_factor=list(cfg.downsample_factors),
        post_module=quantizer_transformer(), pre_module=quantizer_transformer(),
        semantic_codebook_size=cfg.semantic_codebook_size)
    n = len(cfg.encoder_rates)
    model = M.DAC(
        encoder_dim=cfg.encoder_dim, encoder_rates=list(cfg.encoder_rates), latent_dim=cfg.latent_dim,
        decoder_dim=cfg.decoder_dim, decoder_rates=list(cfg.decoder_rates), quantizer=quantizer,
        sample_rate=cfg.sample_rate, causal=True, encoder_transformer_layers=[0] * (n - 1) + [et.n_layer],
        # the yaml's decoder_transformer_layers [4, 0, 0, 0] builds a transformer that DecoderBlock leaves out of its
        # Sequential (no weights, no effect); zeros skip building it.
        decoder_transformer_layers=[0] * len(cfg.decoder_rates),
        transformer_general_config=functools.partial(M.ModelArgs, **args(et)))
    encoder_transformer = model.encoder.block[n].block[5]
    # modded_dac.py EncoderBlock hardcodes window 512, heads dim // 64 and FFN 3 * dim; the tiny config changes
    # the window only, so shorter test clips cross it.
    assert (encoder_transformer.config.n_head, encoder_transformer.config.intermediate_size) == (et.n_head,
                                                                                                 et.intermediate_size)
    encoder_transformer.window_size = et.window
    return model


@torch.no_grad()
def fish_decode(model, codes) -> np.ndarray:
    """codes [B, K, T] int -> audio [B, T * frame_length] float32 numpy."""
    codes = torch.as_tensor(codes, dtype=torch.long)
    lengths = torch.full((codes.shape[0],), codes.shape[2], dtype=torch.long)
    audio, _ = model.decode(codes, lengths)
    return audio[:, 0].float().numpy()


@torch.no_grad()
def fish_encode(model, audio) -> np.ndarray:
    """audio [B, N] float at the codec rate -> codes [B, K, ceil(N / frame_length)] int numpy."""
    codes, _ = model.encode(torch.as_tensor(audio, dtype=torch.float32)[:, None])
    return codes.numpy()
