"""Fish's codec.pth <-> our codec checkpoint. ONE table (`codec_tensors`) drives the random writer, the converter and
the shape checks, so they cannot disagree.

codec.pth is a raw `torch.save` state dict (fish-speech modded_dac.py `DAC`). Weight-normed convs come in two styles:
`torch.nn.utils.parametrizations.weight_norm` (`<conv>.parametrizations.weight.original0` = g, `original1` = v) on
the encoder/decoder convs and the old `weight_norm` (`<proj>.weight_g`, `weight_v`) on the VQ projections; both use
dim 0, w = g * v / ||v|| with the norm over all other axes. For ConvTranspose1d (weight [C_in, C_out, k]) dim 0 is the
input channel. Some Fish versions also store the transformers' `freqs_cis` / `causal_mask` buffers; they are skipped.

Converted layout: `OUT/codec_config.json` ({"format_version", "config", "groups", "source"}) and one Orbax checkpoint
per top-level module, `OUT/codec/{encoder,quantizer,decoder}`, fp32, in our layouts (conv [k, C_in, C_out], depthwise
[k, C], transposed conv [C_in, k, C_out], 1x1 convs and linears [out, in], Snake alpha [C]). The real codec.pth has
no config: `convert_codec` takes the preset whose table matches every tensor shape (full or tiny), or `cfg`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from drama3_jax.codec.config import CODEC_PRESETS, CodecConfig, CodecTransformerConfig
from drama3_jax.codec.model import DILATIONS
from drama3_jax.codec.torch_pickle import load_state_dict

FORMAT_VERSION = 1
CONFIG_FILE = "codec_config.json"
WEIGHTS_DIR = "codec"
GROUPS = ("encoder", "quantizer", "decoder")
BUFFERS = ("freqs_cis", "causal_mask")


class CodecCheckpointError(ValueError):
    """A codec checkpoint that does not match the layout, naming the tensor."""


@dataclasses.dataclass(frozen=True)
class CodecTensor:
    """One weight: our module path, Fish's name (`<module>.weight` for weight-normed ones) and shape, how Fish's
    layout maps to ours, its weight-norm style, and the random writer's distribution (init, scale)."""

    path: str
    fish: str
    fish_shape: tuple[int, ...]
    layout: str = "same"  # same | snake | conv | dwconv | tconv | linear1x1
    weight_norm: str | None = None  # None | "parametrization" | "legacy"
    init: str = "normal"  # normal (std = scale) | bias | alpha | ones (1 + N(0, scale)) | uniform (scale/2 .. scale)
    scale: float = 0.02

    @property
    def fish_keys(self) -> tuple[str, ...]:
        if self.weight_norm == "parametrization":
            base = self.fish[:-len(".weight")] + ".parametrizations.weight.original"
            return base + "0", base + "1"
        if self.weight_norm == "legacy":
            return self.fish + "_g", self.fish + "_v"
        return (self.fish,)

    @property
    def group(self) -> str:
        return self.path.split(".")[0]


# ------------------------------------------------------------------------------------------------- the table
def _conv(path, fish, c_in, c_out, k, *, wn=True, gain=1.0):
    return [CodecTensor(path + ".weight", fish + ".weight", (c_out, c_in, k), "conv",
                        "parametrization" if wn else None, scale=gain / np.sqrt(c_in * k)),
            CodecTensor(path + ".bias", fish + ".bias", (c_out,), init="bias")]


def _tconv(path, fish, c_in, c_out, k, stride, *, wn=True):
    return [CodecTensor(path + ".weight", fish + ".weight", (c_in, c_out, k), "tconv",
                        "parametrization" if wn else None, scale=1 / np.sqrt(c_in * k // stride)),
            CodecTensor(path + ".bias", fish + ".bias", (c_out,), init="bias")]


def _snake(path, fish, c):
    return [CodecTensor(path + ".alpha", fish + ".alpha", (1, c, 1), "snake", init="alpha")]


def _residual_unit(path, fish, c, dilation):
    return (_snake(path + ".snake1", fish + ".block.0", c) + _conv(path + ".conv1", fish + ".block.1.conv", c, c, 7)
            + _snake(path + ".snake2", fish + ".block.2", c)
            + _conv(path + ".conv2", fish + ".block.3.conv", c, c, 1, gain=0.3))


def _linear(path, fish, c_in, c_out):
    return [CodecTensor(path + ".weight", fish + ".weight", (c_out, c_in), scale=1 / np.sqrt(c_in))]


def _transformer(path, fish, t: CodecTransformerConfig):
    hd = t.n_head * t.head_dim
    out = []
    for i in range(t.n_layer):
        p, f = f"{path}.layers.{i}", f"{fish}.layers.{i}"
        out += (_linear(p + ".attention.wqkv", f + ".attention.wqkv", t.dim, 3 * hd)
                + _linear(p + ".attention.wo", f + ".attention.wo", hd, t.dim)
                + _linear(p + ".feed_forward.w1", f + ".feed_forward.w1", t.dim, t.intermediate_size)
                + _linear(p + ".feed_forward.w3", f + ".feed_forward.w3", t.dim, t.intermediate_size)
                + _linear(p + ".feed_forward.w2", f + ".feed_forward.w2", t.intermediate_size, t.dim))
        out += [CodecTensor(f"{p}.{n}.weight", f"{f}.{n}.weight", (t.dim,), init="ones", scale=0.1)
                for n in ("attention_norm", "ffn_norm")]
        out += [CodecTensor(f"{p}.{n}.gamma", f"{f}.{n}.gamma", (t.dim,), init="uniform", scale=0.3)
                for n in ("attention_layer_scale", "ffn_layer_scale")]
    return out + [CodecTensor(path + ".norm.weight", fish + ".norm.weight", (t.dim,), init="ones", scale=0.1)]


def _convnext(path, fish, dim):
    return [CodecTensor(path + ".dwconv.weight", fish + ".dwconv.conv.weight", (dim, 1, 7), "dwconv",
                        scale=1 / np.sqrt(7)),
            CodecTensor(path + ".dwconv.bias", fish + ".dwconv.conv.bias", (dim,), init="bias"),
            CodecTensor(path + ".norm.weight", fish + ".norm.weight", (dim,), init="ones", scale=0.1),
            CodecTensor(path + ".norm.bias", fish + ".norm.bias", (dim,), init="normal", scale=0.1),
            CodecTensor(path + ".pwconv1.weight", fish + ".pwconv1.weight", (4 * dim, dim), scale=1 / np.sqrt(dim)),
            CodecTensor(path + ".pwconv1.bias", fish + ".pwconv1.bias", (4 * dim,), init="bias"),
            CodecTensor(path + ".pwconv2.weight", fish + ".pwconv2.weight", (dim, 4 * dim),
                        scale=1 / np.sqrt(4 * dim)),
            CodecTensor(path + ".pwconv2.bias", fish + ".pwconv2.bias", (dim,), init="bias"),
            CodecTensor(path + ".gamma", fish + ".gamma", (dim,), init="uniform", scale=0.3)]


def _vq(path, fish, dim, size, cdim):
    return [CodecTensor(path + ".in_proj.weight", fish + ".in_proj.weight", (cdim, dim, 1), "linear1x1", "legacy",
                        scale=1 / np.sqrt(dim)),
            CodecTensor(path + ".in_proj.bias", fish + ".in_proj.bias", (cdim,), init="bias"),
            CodecTensor(path + ".out_proj.weight", fish + ".out_proj.weight", (dim, cdim, 1), "linear1x1", "legacy",
                        scale=1 / np.sqrt(cdim)),
            CodecTensor(path + ".out_proj.bias", fish + ".out_proj.bias", (dim,), init="bias"),
            CodecTensor(path + ".codebook.weight", fish + ".codebook.weight", (size, cdim), scale=1.0)]


def transformer_prefixes(cfg: CodecConfig) -> dict[str, CodecTransformerConfig]:
    """Fish module prefix of each transformer (where `freqs_cis` / `causal_mask` buffers may sit)."""
    n = len(cfg.encoder_rates)
    return {f"encoder.block.{n}.block.5": cfg.encoder_transformer, "quantizer.pre_module": cfg.quantizer_transformer,
            "quantizer.post_module": cfg.quantizer_transformer}


def codec_tensors(cfg: CodecConfig) -> list[CodecTensor]:
    """Every weight of the codec in Fish's state-dict order (buffers excluded)."""
    t = []
    # encoder: fish `encoder.block` = [conv_in, EncoderBlock x n, Snake, conv_out]
    t += _conv("encoder.conv_in", "encoder.block.0.conv", 1, cfg.encoder_dim, 7)
    c = cfg.encoder_dim
    n = len(cfg.encoder_rates)
    for i, (dim, s) in enumerate(zip(cfg.encoder_dims, cfg.encoder_rates)):
        p, f = f"encoder.blocks.{i}", f"encoder.block.{i + 1}.block"
        for j, d in enumerate(DILATIONS):
            t += _residual_unit(f"{p}.units.{j}", f"{f}.{j}", c, d)
        t += _snake(p + ".snake", f + ".3", c) + _conv(p + ".downsample", f + ".4.conv", c, dim, 2 * s)
        if i == n - 1:
            t += _transformer(p + ".transformer", f + ".5", cfg.encoder_transformer)
        c = dim
    t += _snake("encoder.snake_out", f"encoder.block.{n + 1}", c)
    t += _conv("encoder.conv_out", f"encoder.block.{n + 2}.conv", c, cfg.latent_dim, 3)
    # quantizer
    d = cfg.latent_dim
    t += _vq("quantizer.semantic_quantizer.quantizers.0", "quantizer.semantic_quantizer.quantizers.0", d,
             cfg.semantic_codebook_size, cfg.codebook_dim)
    for i in range(cfg.n_residual_codebooks):
        t += _vq(f"quantizer.quantizer.quantizers.{i}", f"quantizer.quantizer.quantizers.{i}", d,
                 cfg.codebook_size, cfg.codebook_dim)
    for i, factor in enumerate(cfg.downsample_factors):
        t += _conv(f"quantizer.downsample.{i}.conv", f"quantizer.downsample.{i}.0.conv", d, d, factor, wn=False)
        t += _convnext(f"quantizer.downsample.{i}.convnext", f"quantizer.downsample.{i}.1", d)
    for i, factor in enumerate(reversed(cfg.downsample_factors)):
        t += _tconv(f"quantizer.upsample.{i}.conv", f"quantizer.upsample.{i}.0.conv", d, d, factor, factor, wn=False)
        t += _convnext(f"quantizer.upsample.{i}.convnext", f"quantizer.upsample.{i}.1", d)
    t += _transformer("quantizer.pre_module", "quantizer.pre_module", cfg.quantizer_transformer)
    t += _transformer("quantizer.post_module", "quantizer.post_module", cfg.quantizer_transformer)
    # decoder: fish `decoder.model` = [conv_in, DecoderBlock x n, Snake, conv_out, Tanh]
    dims = cfg.decoder_dims
    t += _conv("decoder.conv_in", "decoder.model.0.conv", d, dims[0], 7)
    for i, s in enumerate(cfg.decoder_rates):
        p, f = f"decoder.blocks.{i}", f"decoder.model.{i + 1}.block"
        t += _snake(p + ".snake", f + ".0", dims[i])
        t += _tconv(p + ".upsample", f + ".1.conv", dims[i], dims[i + 1], 2 * s, s)
        for j, dil in enumerate(DILATIONS):
            t += _residual_unit(f"{p}.units.{j}", f"{f}.{j + 2}", dims[i + 1], dil)
    nd = len(cfg.decoder_rates)
    t += _snake("decoder.snake_out", f"decoder.model.{nd + 1}", dims[-1])
    t += _conv("decoder.conv_out", f"decoder.model.{nd + 2}.conv", dims[-1], 1, 7, gain=0.1)
    return t


def expected_shapes(cfg: CodecConfig) -> dict[str, tuple[int, ...]]:
    """Fish key -> shape for every weight key of the codec (weight-norm g/v split out; buffers excluded)."""
    out = {}
    for s in codec_tensors(cfg):
        if s.weight_norm is None:
            out[s.fish] = s.fish_shape
        else:
            g, v = s.fish_keys
            out[g] = (s.fish_shape[0],) + (1,) * (len(s.fish_shape) - 1)
            out[v] = s.fish_shape
    return out


# ------------------------------------------------------------------------------------------- fish <-> ours
def fold_weight_norm(g: np.ndarray, v: np.ndarray) -> np.ndarray:
    """w = g * v / ||v||, norm over every axis but 0 (torch weight_norm with dim=0), fp32."""
    v = v.astype(np.float32)
    norm = np.sqrt(np.sum(np.square(v), axis=tuple(range(1, v.ndim)), keepdims=True))
    return (v * (g.astype(np.float32) / norm)).astype(np.float32)


def to_our_layout(spec: CodecTensor, w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, np.float32)
    if spec.layout == "same":
        return w
    if spec.layout == "snake":  # [1, C, 1] -> [C]
        return w.reshape(-1)
    if spec.layout == "conv":  # [out, in, k] -> [k, in, out]
        return np.ascontiguousarray(w.transpose(2, 1, 0))
    if spec.layout == "dwconv":  # [C, 1, k] -> [k, C]
        return np.ascontiguousarray(w[:, 0, :].T)
    if spec.layout == "tconv":  # [in, out, k] -> [in, k, out]
        return np.ascontiguousarray(w.transpose(0, 2, 1))
    if spec.layout == "linear1x1":  # [out, in, 1] -> [out, in]
        return w[..., 0]
    raise ValueError(f"unknown layout {spec.layout!r}")


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def random_fish_tensors(spec: CodecTensor, seed: int) -> dict[str, np.ndarray]:
    """Deterministic random values of one weight in Fish's layout (g/v split for weight-normed ones)."""
    r = _rng(seed, spec.fish)
    shape = spec.fish_shape
    uniform = lambda lo, hi, size: lo + (hi - lo) * r.random(size, dtype=np.float32)  # noqa: E731
    if spec.init == "normal":
        w = spec.scale * r.standard_normal(shape, dtype=np.float32)
    elif spec.init == "bias":
        w = 0.02 * r.standard_normal(shape, dtype=np.float32)
    elif spec.init == "alpha":
        w = uniform(0.5, 1.5, shape)
    elif spec.init == "ones":
        w = 1.0 + spec.scale * r.standard_normal(shape, dtype=np.float32)
    elif spec.init == "uniform":
        w = uniform(spec.scale / 2, spec.scale, shape)
    else:
        raise ValueError(f"no random init {spec.init!r} ({spec.fish})")
    if spec.weight_norm is None:
        return {spec.fish: w.astype(np.float32)}
    axes = tuple(range(1, len(shape)))
    g = np.sqrt(np.sum(w * w, axis=axes, keepdims=True)) * uniform(0.8, 1.25, (shape[0],) + (1,) * len(axes))
    v = w * uniform(0.5, 2.0, g.shape)  # any per-row scale: the fold must normalise it away
    gk, vk = spec.fish_keys
    return {gk: g.astype(np.float32), vk: v.astype(np.float32)}


def fish_buffers(t: CodecTransformerConfig) -> tuple[np.ndarray, np.ndarray]:
    """The persistent buffers fish-speech 0.1.0 stores per transformer: the RoPE table [block_size, head_dim/2, 2]
    (fp32 here; Fish stores it rounded to bf16) and the lower-triangular bool mask [block_size, block_size]."""
    inv = 1.0 / (t.rope_base ** (np.arange(0, t.head_dim, 2, dtype=np.float32) / t.head_dim))
    ang = np.outer(np.arange(t.block_size, dtype=np.float32), inv.astype(np.float32))
    return np.stack([np.cos(ang), np.sin(ang)], axis=-1), np.tril(np.ones((t.block_size,) * 2, bool))


def write_random_codec_pth(path: str | Path, cfg: CodecConfig, seed: int = 0, *, buffers: bool = True) -> Path:
    """Write a random codec.pth in Fish's exact key layout (torch.save of a flat state dict; needs torch, from the
    `reference` extra), deterministic from `seed`. `buffers`: include the freqs_cis / causal_mask buffers."""
    import torch

    sd = OrderedDict()
    for spec in codec_tensors(cfg):
        for k, v in random_fish_tensors(spec, seed).items():
            sd[k] = torch.from_numpy(v)
    if buffers:
        for prefix, t in transformer_prefixes(cfg).items():
            table, mask = fish_buffers(t)
            sd[prefix + ".freqs_cis"] = torch.from_numpy(table).to(torch.bfloat16)
            sd[prefix + ".causal_mask"] = torch.from_numpy(mask)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(sd, path)
    return path


def layout_problems(cfg: CodecConfig, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Every mismatch between a state dict's key -> shape map and `cfg`'s layout (buffers at transformer prefixes
    are allowed), as messages naming the key; empty when it matches."""
    want = expected_shapes(cfg)
    allowed = {f"{p}.{b}" for p in transformer_prefixes(cfg) for b in BUFFERS}
    problems = [f"missing tensor {k!r} (expected shape {s})" for k, s in want.items() if k not in shapes]
    problems += [f"unexpected tensor {k!r} with shape {s}" for k, s in shapes.items()
                 if k not in want and k not in allowed]
    problems += [f"tensor {k!r} has shape {shapes[k]}, expected {s}" for k, s in want.items()
                 if k in shapes and tuple(shapes[k]) != s]
    return problems


def match_preset(shapes: dict[str, tuple[int, ...]]) -> CodecConfig:
    """The codec preset whose layout matches every tensor shape; otherwise an error naming the first mismatches
    against the closest preset."""
    tried = []
    for name, make in CODEC_PRESETS.items():
        cfg = make()
        problems = layout_problems(cfg, shapes)
        if not problems:
            return cfg
        tried.append((len(problems), name, problems))
    n, name, problems = min(tried)
    raise CodecCheckpointError(f"codec.pth matches no codec preset; closest is {name!r} with {n} problem(s): "
                               + "; ".join(problems[:3]) + " (pass an explicit CodecConfig if this is a new size)")


# --------------------------------------------------------------------------------------------- conversion
def _set(tree: dict, path: str, value) -> None:
    parts = path.split(".")
    for p in parts[:-1]:
        tree = tree.setdefault(p, {})
    tree[parts[-1]] = value


def convert_codec(pth_path: str | Path, out_dir: str | Path, cfg: CodecConfig | None = None) -> CodecConfig:
    """Stream Fish's codec.pth into `out_dir/codec/<group>` Orbax checkpoints + `out_dir/codec_config.json`, folding
    weight norm. Only the codec's files in out_dir are replaced. cfg None: take the preset matching the shapes.
    Raises CodecCheckpointError naming the key on unknown, missing or mis-shaped tensors."""
    import orbax.checkpoint as ocp

    sd = load_state_dict(pth_path)
    shapes = {k: t.shape for k, t in sd.items()}
    if cfg is None:
        cfg = match_preset(shapes)
    else:
        problems = layout_problems(cfg, shapes)
        if problems:
            raise CodecCheckpointError(f"{pth_path}: {len(problems)} problem(s) against the given config: "
                                       + "; ".join(problems[:3]))
    out = Path(out_dir)
    weights = out / WEIGHTS_DIR
    if weights.exists():
        shutil.rmtree(weights)
    weights.mkdir(parents=True)
    ckptr = ocp.StandardCheckpointer()
    specs = codec_tensors(cfg)
    for group in GROUPS:
        tree: dict = {}
        for spec in (s for s in specs if s.group == group):
            arrays = [sd[k].numpy() for k in spec.fish_keys]
            w = arrays[0] if spec.weight_norm is None else fold_weight_norm(*arrays)
            if not np.all(np.isfinite(w)):
                raise CodecCheckpointError(f"{pth_path}: tensor {spec.fish!r} has non-finite values")
            _set(tree, spec.path, to_our_layout(spec, w))
        ckptr.save((weights / group).absolute(), tree[group])
        ckptr.wait_until_finished()
    with open(out / CONFIG_FILE, "w") as f:
        json.dump({"format_version": FORMAT_VERSION, "config": cfg.to_dict(), "groups": list(GROUPS),
                   "source": str(Path(pth_path).absolute())}, f, indent=1)
    return cfg


def read_codec_config(out_dir: str | Path) -> CodecConfig:
    path = Path(out_dir) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{out_dir}: no {CONFIG_FILE} (convert a codec.pth with convert_codec first)")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CodecCheckpointError(f"{path}: unsupported codec checkpoint format {meta.get('format_version')}")
    return CodecConfig.from_dict(meta["config"])


def _codec_from_pure(cfg: CodecConfig, pure: dict, dtype, where: str):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from drama3_jax.checkpoint import merge_pure, to_state_keys
    from drama3_jax.codec.model import ModifiedDAC

    graphdef, state = nnx.split(nnx.eval_shape(lambda: ModifiedDAC(cfg, dtype=jnp.float32)))
    pure = jax.tree.map(lambda x: jnp.asarray(x, dtype or jnp.float32), to_state_keys(pure))
    return merge_pure(graphdef, state, pure, CodecCheckpointError, f"{where}: codec checkpoint")


def load_codec(out_dir: str | Path, dtype=None):
    """Restore a converted codec into a `ModifiedDAC`; dtype None keeps fp32, e.g. jnp.bfloat16 for serving."""
    import orbax.checkpoint as ocp

    cfg = read_codec_config(out_dir)
    ckptr = ocp.StandardCheckpointer()
    pure = {g: ckptr.restore((Path(out_dir) / WEIGHTS_DIR / g).absolute()) for g in GROUPS}
    return _codec_from_pure(cfg, pure, dtype, str(out_dir))


def random_codec(cfg: CodecConfig, seed: int = 0, dtype=None):
    """A `ModifiedDAC` holding the same random weights `write_random_codec_pth(..., cfg, seed)` writes, built in
    memory (no torch, no files): for benchmarks and tests that need no Fish reference."""
    tree: dict = {}
    for spec in codec_tensors(cfg):
        arrays = list(random_fish_tensors(spec, seed).values())
        _set(tree, spec.path, to_our_layout(spec, arrays[0] if len(arrays) == 1 else fold_weight_norm(*arrays)))
    return _codec_from_pure(cfg, tree, dtype, f"random {cfg.name}")
