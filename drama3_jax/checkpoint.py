"""Checkpoint layout: ONE table of checkpoint-name patterns drives the random-checkpoint writer, the converter to
Orbax and the loader, so they cannot disagree.

HF layout (fishaudio/drama-3): `config.json`, `model.safetensors.index.json`, `model-0000N-of-0000M.safetensors`;
bf16 everywhere except routed experts (float8_e4m3fn `weight` [out, in] + fp32 `weight_scale_inv`
[ceil(out/128), ceil(in/128)]). The Flax tree uses the same names; the only structural change is that experts
are stacked: `...mlp.experts.{E}.gate_proj.weight` -> `...mlp.experts.gate_proj.weight[E]`.

Converted layout (`convert`): `DIR/config.json`, `DIR/drama3_manifest.json`, `DIR/weights/<group>/` (one Orbax
checkpoint per group: `embed`, `layer_000`..., `head`, `tower`), so conversion holds at most one layer in memory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import sys
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from drama3_jax.config import Drama3Config
from drama3_jax.nn import quantize_block_fp8, scale_shape
from drama3_jax.safetensors_io import CheckpointReader, write_safetensors

log = logging.getLogger(__name__)

MANIFEST = "drama3_manifest.json"
FORMAT_VERSION = 1
NP_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "f32": np.dtype(np.float32),
             "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}


class CheckpointError(ValueError):
    """A checkpoint that does not match the layout, naming the tensor."""


@dataclasses.dataclass(frozen=True)
class Pattern:
    """One row of the layout table. `scope`: where {L}/{E}/{i} expand: global, layer (all layers), linear (GDN
    layers), full (attention layers), expert (all layers x experts), tower_shared / tower_residual (tower layers). `shape(cfg)` is the checkpoint shape; `init` names the
    distribution of the random writer."""

    hf: str
    scope: str
    shape: Callable[[Drama3Config], tuple[int, ...]]
    dtype: str = "bf16"
    init: str = "linear"
    group: str = ""  # for global tensors


LM = "model.language_model."
LAYER = LM + "layers.{L}."
_t = lambda f: (lambda c: f(c.text))  # noqa: E731

_a = lambda f: (lambda c: f(c.tower))  # noqa: E731


def _tower_layer_patterns(prefix: str, scope: str, embedding: str) -> tuple[Pattern, ...]:
    tl = prefix + "transformer_layer."
    qkv = lambda a: (2 * a.n_head * a.head_dim + 2 * a.n_local_heads * a.head_dim, a.dim)
    return (
        Pattern(prefix + embedding + ".weight", scope, _a(lambda a: (a.vocab_size, a.dim)), init="embed"),
        Pattern(prefix + "enorm.weight", scope, _a(lambda a: (a.dim,)), init="norm0"),
        Pattern(prefix + "hnorm.weight", scope, _a(lambda a: (a.dim,)), init="norm0"),
        Pattern(prefix + "eh_proj.weight", scope, _a(lambda a: (a.dim, 2 * a.dim))),
        Pattern(prefix + "final_layernorm.weight", scope, _a(lambda a: (a.dim,)), init="norm0"),
        Pattern(tl + "attention.wqkv.weight", scope, _a(qkv)),
        Pattern(tl + "attention.wo.weight", scope, _a(lambda a: (a.dim, a.n_head * a.head_dim))),
        Pattern(tl + "attention.q_norm.weight", scope, _a(lambda a: (a.head_dim,)), init="norm0"),
        Pattern(tl + "attention.k_norm.weight", scope, _a(lambda a: (a.head_dim,)), init="norm0"),
        Pattern(tl + "attention_norm.weight", scope, _a(lambda a: (a.dim,)), init="norm0"),
        Pattern(tl + "ffn_norm.weight", scope, _a(lambda a: (a.dim,)), init="norm0"),
        Pattern(tl + "feed_forward.w1.weight", scope, _a(lambda a: (a.intermediate_size, a.dim))),
        Pattern(tl + "feed_forward.w3.weight", scope, _a(lambda a: (a.intermediate_size, a.dim))),
        Pattern(tl + "feed_forward.w2.weight", scope, _a(lambda a: (a.dim, a.intermediate_size))),
    )


# Tower names: drama3-architecture.md 3.3 (sglang-omni weights.py / mlx-audio convert.py prefixes).
TOWER_PATTERNS: tuple[Pattern, ...] = (
    *_tower_layer_patterns("audio_decoder_mtp_shared.layers.{i}.", "tower_shared", "semantic_embedding"),
    *_tower_layer_patterns("audio_decoder_mtp.layers.{i}.", "tower_residual", "codebook_embedding"),
    Pattern("audio_decoder_mtp.heads.{i}.weight", "tower_residual", _a(lambda a: (a.vocab_size, a.dim))),
)

PATTERNS: tuple[Pattern, ...] = (
    Pattern(LM + "embed_tokens.weight", "global", _t(lambda t: (t.vocab_size, t.hidden_size)), init="embed",
            group="embed"),
    Pattern("audio_decoder.codebook_embeddings.weight", "global",
            lambda c: (c.tower.num_codebooks * c.tower.vocab_size, c.tower.dim), init="embed", group="embed"),
    Pattern(LAYER + "input_layernorm.weight", "layer", _t(lambda t: (t.hidden_size,)), init="norm0"),
    Pattern(LAYER + "post_attention_layernorm.weight", "layer", _t(lambda t: (t.hidden_size,)), init="norm0"),
    # Gated DeltaNet layers
    Pattern(LAYER + "linear_attn.in_proj_qkv.weight", "linear", _t(lambda t: (t.linear_conv_dim, t.hidden_size))),
    Pattern(LAYER + "linear_attn.in_proj_z.weight", "linear", _t(lambda t: (t.linear_value_dim, t.hidden_size))),
    Pattern(LAYER + "linear_attn.in_proj_b.weight", "linear", _t(lambda t: (t.linear_num_value_heads, t.hidden_size))),
    Pattern(LAYER + "linear_attn.in_proj_a.weight", "linear", _t(lambda t: (t.linear_num_value_heads, t.hidden_size))),
    Pattern(LAYER + "linear_attn.conv1d.weight", "linear",
            _t(lambda t: (t.linear_conv_dim, 1, t.linear_conv_kernel_dim)), init="conv"),
    Pattern(LAYER + "linear_attn.A_log", "linear", _t(lambda t: (t.linear_num_value_heads,)), init="A_log"),
    Pattern(LAYER + "linear_attn.dt_bias", "linear", _t(lambda t: (t.linear_num_value_heads,)), init="dt_bias"),
    Pattern(LAYER + "linear_attn.norm.weight", "linear", _t(lambda t: (t.linear_value_head_dim,)), init="norm1"),
    Pattern(LAYER + "linear_attn.out_proj.weight", "linear", _t(lambda t: (t.hidden_size, t.linear_value_dim))),
    # gated full-attention layers
    Pattern(LAYER + "self_attn.q_proj.weight", "full",
            _t(lambda t: (2 * t.num_attention_heads * t.head_dim, t.hidden_size))),
    Pattern(LAYER + "self_attn.k_proj.weight", "full",
            _t(lambda t: (t.num_key_value_heads * t.head_dim, t.hidden_size))),
    Pattern(LAYER + "self_attn.v_proj.weight", "full",
            _t(lambda t: (t.num_key_value_heads * t.head_dim, t.hidden_size))),
    Pattern(LAYER + "self_attn.o_proj.weight", "full",
            _t(lambda t: (t.hidden_size, t.num_attention_heads * t.head_dim))),
    Pattern(LAYER + "self_attn.q_norm.weight", "full", _t(lambda t: (t.head_dim,)), init="norm0"),
    Pattern(LAYER + "self_attn.k_norm.weight", "full", _t(lambda t: (t.head_dim,)), init="norm0"),
    # MoE
    Pattern(LAYER + "mlp.gate.weight", "layer", _t(lambda t: (t.num_experts, t.hidden_size))),
    Pattern(LAYER + "mlp.shared_expert.gate_proj.weight", "layer",
            _t(lambda t: (t.shared_expert_intermediate_size, t.hidden_size))),
    Pattern(LAYER + "mlp.shared_expert.up_proj.weight", "layer",
            _t(lambda t: (t.shared_expert_intermediate_size, t.hidden_size))),
    Pattern(LAYER + "mlp.shared_expert.down_proj.weight", "layer",
            _t(lambda t: (t.hidden_size, t.shared_expert_intermediate_size))),
    Pattern(LAYER + "mlp.shared_expert_gate.weight", "layer", _t(lambda t: (1, t.hidden_size))),
    Pattern(LAYER + "mlp.experts.{E}.gate_proj.weight", "expert",
            _t(lambda t: (t.moe_intermediate_size, t.hidden_size)), dtype="fp8"),
    Pattern(LAYER + "mlp.experts.{E}.up_proj.weight", "expert",
            _t(lambda t: (t.moe_intermediate_size, t.hidden_size)), dtype="fp8"),
    Pattern(LAYER + "mlp.experts.{E}.down_proj.weight", "expert",
            _t(lambda t: (t.hidden_size, t.moe_intermediate_size)), dtype="fp8"),
    Pattern(LM + "norm.weight", "global", _t(lambda t: (t.hidden_size,)), init="norm0", group="head"),
    *TOWER_PATTERNS,
    Pattern("lm_head.weight", "global", _t(lambda t: (t.vocab_size, t.hidden_size)), group="head"),
)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: HF name, shape, dtype; where it lands in the Flax tree (`path`, stacked at `index`)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    path: tuple[str | int, ...]
    index: int | None
    group: str
    init: str
    scale_of: str | None = None  # set on `weight_scale_inv` tensors: the name of their FP8 weight


def _flax_path(name: str) -> tuple[str | int, ...]:
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


def checkpoint_tensors(cfg: Drama3Config) -> list[TensorSpec]:
    """Every tensor of the HF checkpoint, in a stable order grouped for streaming (embed, layer_000..., head)."""
    t = cfg.text
    block = tuple(cfg.quant.weight_block_size) if cfg.quant else None
    layers = {"layer": range(t.num_hidden_layers), "linear": t.linear_attention_layers,
              "full": t.full_attention_layers, "expert": range(t.num_hidden_layers)}
    tower = {"tower_shared": range(cfg.tower.n_layer), "tower_residual": range(cfg.tower.num_residual_layers)}
    by_group: dict[str, list[TensorSpec]] = defaultdict(list)
    for p in PATTERNS:
        shape = tuple(p.shape(cfg))
        if p.scope == "global":
            by_group[p.group].append(TensorSpec(p.hf, shape, p.dtype, _flax_path(p.hf), None, p.group, p.init))
            continue
        if p.scope in tower:
            for i in tower[p.scope]:
                name = p.hf.format(i=i)
                by_group["tower"].append(TensorSpec(name, shape, p.dtype, _flax_path(name), None, "tower", p.init))
            continue
        for L in layers[p.scope]:
            group = f"layer_{L:03d}"
            if p.scope != "expert":
                name = p.hf.format(L=L)
                by_group[group].append(TensorSpec(name, shape, p.dtype, _flax_path(name), None, group, p.init))
                continue
            stacked = _flax_path(p.hf.replace(".{E}", "").format(L=L))
            for E in range(t.num_experts):
                name = p.hf.format(L=L, E=E)
                if p.dtype == "fp8" and block is not None:
                    by_group[group].append(TensorSpec(name, shape, "fp8", stacked, E, group, "expert"))
                    by_group[group].append(TensorSpec(name + "_scale_inv", scale_shape(shape, block), "f32",
                                                      stacked[:-1] + ("weight_scale_inv",), E, group, "scale",
                                                      scale_of=name))
                else:
                    by_group[group].append(TensorSpec(name, shape, "bf16", stacked, E, group, "expert"))
    order = ["embed"] + [f"layer_{L:03d}" for L in range(t.num_hidden_layers)] + ["head", "tower"]
    return [s for g in order for s in by_group.get(g, [])]


def count_params(cfg: Drama3Config) -> dict[str, int]:
    """Parameter counts from the layout table (scales excluded). `active` = all non-expert parameters (embedding
    tables included) plus top-k of the routed experts; `backbone*` leave out the tower (`audio_decoder_mtp*`), whose
    FFN width is a placeholder in the `full` preset."""
    total = routed = tower = 0
    for s in checkpoint_tensors(cfg):
        if s.scale_of is not None:
            continue
        n = math.prod(s.shape)
        total += n
        routed += n if s.init == "expert" else 0
        tower += n if s.group == "tower" else 0
    active_routed = routed * cfg.text.num_experts_per_tok // cfg.text.num_experts
    backbone = total - tower
    return {"total": total, "active": total - routed + active_routed, "backbone": backbone,
            "backbone_active": backbone - routed + active_routed, "routed_experts": routed, "tower": tower}


# ------------------------------------------------------------------------------------ random checkpoints
def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def init_value(spec: TensorSpec, normal, uniform, log=np.log):
    """The random-init distribution of one tensor, drawn with `normal(mean, std, shape)` / `uniform(lo, hi, shape)`
    (numpy on the host for checkpoint files, jax.random + jnp.log on device for in-memory models). float32."""
    shape = spec.shape
    if spec.init in ("linear", "expert"):
        return normal(0.0, 1.0 / math.sqrt(shape[-1]), shape)
    if spec.init == "embed":
        return normal(0.0, 1.0, shape)
    if spec.init == "norm0":  # zero-centred gamma (applied as 1 + w)
        return normal(0.0, 0.2, shape)
    if spec.init == "norm1":
        return 1.0 + normal(0.0, 0.2, shape)
    if spec.init == "conv":
        return normal(0.0, 0.5, shape)
    if spec.init == "A_log":
        return log(uniform(1.0, 16.0, shape))
    if spec.init == "dt_bias":
        return normal(0.0, 0.5, shape)
    raise ValueError(f"no random init for {spec.init!r} ({spec.name})")


def random_tensor(spec: TensorSpec, seed: int) -> np.ndarray:
    """A deterministic random float32 value for one tensor (FP8 quantisation happens in `random_tensors`)."""
    r = _rng(seed, spec.name)
    return np.asarray(init_value(spec, lambda m, sd, sh: r.normal(m, sd, sh), lambda lo, hi, sh: r.uniform(lo, hi, sh)),
                      np.float32)


def random_tensors(cfg: Drama3Config, seed: int) -> Iterator[tuple[TensorSpec, np.ndarray]]:
    """(spec, array in its checkpoint dtype) for every tensor, FP8 experts with their block scales."""
    block = tuple(cfg.quant.weight_block_size) if cfg.quant else (128, 128)
    pending_scale: dict[str, np.ndarray] = {}
    for s in checkpoint_tensors(cfg):
        if s.scale_of is not None:
            yield s, pending_scale.pop(s.scale_of)
        elif s.dtype == "fp8":
            q, scale = quantize_block_fp8(random_tensor(s, seed), block)
            pending_scale[s.name] = scale
            yield s, q
        else:
            yield s, random_tensor(s, seed).astype(NP_DTYPES[s.dtype])


def write_random_checkpoint(cfg: Drama3Config, out_dir: str | Path, *, seed: int = 0,
                            shard_bytes: int = 256 << 10, tokenizer: bool = True, codec_cfg=None) -> Path:
    """Write config.json + sharded safetensors + index in the exact HF layout, deterministic from `seed`; for configs
    with the tiny vocabulary layout a real byte-level BPE tokenizer.json; with `codec_cfg` a random codec.pth in
    Fish's key layout (needs torch, a dev dependency)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, np.ndarray]]] = [[]]
    size = 0
    for spec, arr in random_tensors(cfg, seed):
        if size and size + arr.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((spec.name, arr))
        size += arr.nbytes
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / fname, tensors, metadata={"format": "pt"})
        for n, a in tensors:
            weight_map[n] = fname
            total += a.nbytes
    with open(out / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(out / "config.json", "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)
    if tokenizer:
        from drama3_jax.tokenizer import write_synthetic_tokenizer

        write_synthetic_tokenizer(out / "tokenizer.json", cfg)
    if codec_cfg is not None:
        from drama3_jax.codec.convert import write_random_codec_pth

        write_random_codec_pth(out / "codec.pth", codec_cfg, seed)
    return out


# ------------------------------------------------------------------------------------------ conversion
def set_path(tree: dict, path: tuple, value) -> None:
    """tree[p0][p1]...[pn] = value, with string keys (as Orbax restores them; `to_state_keys` turns indices back)."""
    for p in path[:-1]:
        tree = tree.setdefault(str(p), {})
    tree[str(path[-1])] = value


def _progress(done: int, total: int, what: str) -> None:
    if sys.stderr.isatty() or done == total:
        width = 30
        fill = int(width * done / max(total, 1))
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {what:<24}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


@dataclasses.dataclass
class ConversionStats:
    tensors: int = 0
    groups: int = 0
    peak_group_bytes: int = 0


def _dequantize_np(w: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    """bf16(fp8 * scale broadcast per block) for one [out, in] expert weight."""
    s = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:w.shape[0], :w.shape[1]]
    return (w.astype(np.float32) * s).astype(ml_dtypes.bfloat16)


def convert(hf_dir: str | Path, out_dir: str | Path, *, experts: str = "fp8", codec: str | Path | None = None,
            progress: bool = True) -> ConversionStats:
    """Stream a HF checkpoint into per-group Orbax checkpoints (one tensor read at a time, one group held), and the
    codec (`codec`, else `hf_dir/codec.pth` when present) into `out_dir/codec/`.

    experts: "fp8" keeps FP8 weights + fp32 scales; "bf16" dequantises them (W = fp8 * scale per block)."""
    import orbax.checkpoint as ocp

    if experts not in ("fp8", "bf16"):
        raise ValueError(f"experts must be 'fp8' or 'bf16', got {experts!r}")
    hf_dir, out = Path(hf_dir), Path(out_dir)
    cfg = Drama3Config.from_json(hf_dir / "config.json")
    reader = CheckpointReader(hf_dir)
    specs = checkpoint_tensors(cfg)
    expected = {s.name for s in specs}
    present = set(reader.names())
    missing = sorted(expected - present)
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), first: {missing[0]!r}")
    extra = sorted(present - expected)
    if extra:
        raise CheckpointError(f"checkpoint has {len(extra)} unexpected tensor(s), first: {extra[0]!r}")
    if out.exists():
        shutil.rmtree(out)
    (out / "weights").mkdir(parents=True)
    block = tuple(cfg.quant.weight_block_size) if cfg.quant else (128, 128)
    stats = ConversionStats()
    groups: dict[str, list[TensorSpec]] = defaultdict(list)
    for s in specs:
        groups[s.group].append(s)
    ckptr = ocp.StandardCheckpointer()
    done = 0
    for group, gspecs in groups.items():
        tree: dict = {}
        stacks: dict[tuple, np.ndarray] = {}
        pending: dict[str, np.ndarray] = {}
        held = 0
        for s in gspecs:
            dtype, shape = reader.info(s.name)
            want = {"bf16": "BF16", "f32": "F32", "fp8": "F8_E4M3"}[s.dtype]
            if tuple(shape) != s.shape:
                raise CheckpointError(f"tensor {s.name!r} has shape {tuple(shape)}, expected {s.shape}")
            if dtype != want:
                raise CheckpointError(f"tensor {s.name!r} has dtype {dtype}, expected {want}")
            arr = reader.get(s.name)
            if s.index is None:
                set_path(tree, s.path, arr)
                held += arr.nbytes
            elif experts == "bf16" and s.dtype == "fp8":
                pending[s.name] = arr  # dequantised when its scale (the next tensor) arrives
            else:
                path = s.path
                if experts == "bf16" and s.scale_of is not None:
                    arr = _dequantize_np(pending.pop(s.scale_of), arr, block)
                    path = s.path[:-1] + ("weight",)
                if path not in stacks:
                    stacks[path] = np.zeros((cfg.text.num_experts,) + arr.shape, arr.dtype)
                    held += stacks[path].nbytes
                stacks[path][s.index] = arr
            done += 1
            if progress:
                _progress(done, len(specs), group)
        for path, stack in stacks.items():
            set_path(tree, path, stack)
        stats.peak_group_bytes = max(stats.peak_group_bytes, held)
        ckptr.save((out / "weights" / group).absolute(), tree)
        ckptr.wait_until_finished()
        del tree, stacks
        stats.groups += 1
    stats.tensors = done
    shutil.copy(hf_dir / "config.json", out / "config.json")
    for extra_file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (hf_dir / extra_file).exists():
            shutil.copy(hf_dir / extra_file, out / extra_file)
    codec_path = Path(codec) if codec is not None else hf_dir / "codec.pth"
    if codec is not None and not codec_path.exists():
        raise FileNotFoundError(f"codec checkpoint {codec_path} does not exist")
    if codec_path.exists():
        from drama3_jax.codec.convert import convert_codec

        convert_codec(codec_path, out)
    with open(out / MANIFEST, "w") as f:
        json.dump({"format_version": FORMAT_VERSION, "experts": experts, "groups": list(groups),
                   "codec": codec_path.exists(), "source": str(hf_dir.absolute())}, f, indent=1)
    return stats


# ------------------------------------------------------------------------------------------------ loading
def to_state_keys(tree):
    """Orbax restores dict keys as strings; list indices of the NNX state are ints."""
    if isinstance(tree, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): to_state_keys(v) for k, v in tree.items()}
    return tree


def _merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def load_model(path: str | Path, *, dtype=None):
    """Restore a converted checkpoint into a `Drama3Model` (backbone + tower).

    dtype: cast floating weights (not FP8 weights or their fp32 scales) to this dtype, e.g. jnp.float32 for parity."""
    import orbax.checkpoint as ocp
    from flax import nnx

    from drama3_jax.model import Drama3Model

    path = Path(path)
    with open(path / MANIFEST) as f:
        manifest = json.load(f)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported converted-checkpoint format {manifest.get('format_version')}")
    cfg = Drama3Config.from_json(path / "config.json")
    fp8 = manifest["experts"] == "fp8"
    abstract = nnx.eval_shape(lambda: Drama3Model(cfg, fp8_experts=fp8))
    graphdef, state = nnx.split(abstract)
    pure: dict = {}
    ckptr = ocp.StandardCheckpointer()
    for group in manifest["groups"]:
        _merge(pure, to_state_keys(ckptr.restore((path / "weights" / group).absolute())))

    def cast(x):
        x = jnp.asarray(x)
        if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype not in (
                jnp.float8_e4m3fn, jnp.float32):
            x = x.astype(dtype)
        return x

    return merge_pure(graphdef, state, jax.tree.map(cast, pure), CheckpointError, f"{path}: converted checkpoint")


def merge_pure(graphdef, abstract_state, pure: dict, error: type[Exception], where: str):
    """Fill an abstract NNX state with restored arrays and build the module; `error` names the first weight the
    restored tree lacks."""
    from flax import nnx

    nnx.replace_by_pure_dict(abstract_state, pure)
    unfilled = [jax.tree_util.keystr(k) for k, v in jax.tree_util.tree_flatten_with_path(abstract_state)[0]
                if isinstance(v, jax.ShapeDtypeStruct)]
    if unfilled:
        raise error(f"{where} lacks {len(unfilled)} weight(s), first: {unfilled[0]}")
    return nnx.merge(graphdef, abstract_state)


if __name__ == "__main__":  # python -m drama3_jax.checkpoint [full|tiny]: parameter counts from the layout table
    from drama3_jax.config import preset

    counts = count_params(preset(sys.argv[1] if len(sys.argv) > 1 else "full"))
    print(json.dumps({k: f"{v / 1e9:.3f}B ({v:,})" for k, v in counts.items()}, indent=1))
