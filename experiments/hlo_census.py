"""Kernel census of a compiled XLA GPU program, without a GPU: every kernel the device would launch, by kind and by
the model's named scopes, with the bytes each one reads and writes (the operands' and results' sizes: an upper bound,
since a fusion may read only part of an operand), and the longest chain of kernels that depend on each other (with
CUDA graphs scheduled CONCURRENT only data dependencies order the kernels: at one stream that chain, not the launch
count, sets the step time).

The programs are compiled on this machine for one H200 (`kernels/h200_lowering.py` `compile_for_h200`: XLA's
deviceless AOT; needs `make deviceless`). Kernel counts and fusion boundaries are the device's; GEMM tilings and
cuDNN algorithms are XLA's untuned defaults. So the census answers "how many launches, which copies, which
conversions", never "how fast": that takes the device.

    python experiments/hlo_census.py --out DIR decode --slots 1 128 [--variant pallas_bf16_w8a8_fused]
    python experiments/hlo_census.py --out DIR prefill [--variants packed ...] [--bucket -1]
    python experiments/hlo_census.py --out DIR codec --streams 128 --frames 8
    python experiments/hlo_census.py --out DIR hlo FILE.hlo        (a saved optimized-HLO text, e.g. a profile's)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import time
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.common import category_of  # noqa: E402

HBM_BPS = 4.2e12  # measured on the H200 (../shared/docs/h200-baselines.md)
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
               "f8e8m0fnu": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8,
               "s64": 8, "u64": 8, "c64": 8, "c128": 16, "token": 0}
# opcodes that launch nothing: views, tuples, control and parameters
NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "add-dependency",
             "opt-barrier", "partition-id", "replica-id"}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^(ENTRY\s+)?%([^\s(]+)\s*\(")


@dataclasses.dataclass
class Kernel:
    """One launch: `kind` (gemm, conv, pallas, fusion:<XLA fusion kind>, copy, custom:<target>, or the opcode),
    `name` (the HLO instruction), `op_name` (its jax named-scope path), bytes read / written, executions per call
    (a while body's trip count)."""

    kind: str
    name: str
    op_name: str
    read_bytes: float
    write_bytes: float
    times: int = 1
    detail: str = ""

    @property
    def bytes(self) -> float:
        return self.read_bytes + self.write_bytes


def type_bytes(text: str) -> float:
    """Bytes of an HLO type, array or tuple: `bf16[128,2048]{1,0}` or `(f32[2], s32[])`."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(text):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _elem_bytes(text: str) -> float:
    m = _ARRAY.search(text)
    return DTYPE_BYTES.get(m.group(1), 0) if m else 0


def _split_type(rest: str) -> tuple[str, str]:
    """`rest` = "TYPE opcode(...)..." -> (TYPE, "opcode(...)..."); TYPE may be a parenthesised tuple."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    ty, _, tail = rest.partition(" ")
    return ty, tail


def _operands(call: str) -> tuple[list[str], str]:
    """"opcode(%a, %b), attrs" -> ([a, b], attrs)."""
    start = call.index("(")
    depth = 0
    for i in range(start, len(call)):
        depth += call[i] == "("
        depth -= call[i] == ")"
        if depth == 0:
            return re.findall(r"%([^\s,)]+)", call[start:i + 1]), call[i + 1:]
    return re.findall(r"%([^\s,)]+)", call[start:]), ""


def parse_computations(hlo: str) -> tuple[dict[str, list[dict]], str]:
    """-> ({computation name: [instruction dicts]}, entry name). Each instruction: name, type, opcode, operands,
    attrs."""
    comps: dict[str, list[dict]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and line.rstrip().endswith("{"):
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is None:
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        ty, call = _split_type(m.group(2))
        opcode = call.split("(", 1)[0].strip()
        operands, attrs = _operands(call) if "(" in call else ([], "")
        comps[current].append(dict(name=m.group(1), type=ty, opcode=opcode, operands=operands, attrs=attrs,
                                   root=line.lstrip().startswith("ROOT")))
    return comps, entry


def _attr(attrs: str, key: str) -> str:
    m = re.search(key + r'=("(?:[^"\\]|\\.)*"|\{[^}]*\}|%[^\s,]+|[^\s,]+)', attrs)
    return m.group(1).strip('"') if m else ""


def _kind(ins: dict) -> str:
    op, attrs = ins["opcode"], ins["attrs"]
    if op == "fusion":
        calls = _attr(attrs, "calls")
        if "gemm_fusion" in ins["name"] or "__triton_gemm" in attrs or "gemm_fusion" in calls:
            return "gemm"
        return "fusion:" + (_attr(attrs, "kind").removeprefix("k").lower() or "?")
    if op == "custom-call":
        target = _attr(attrs, "custom_call_target")
        if "gemm" in target or "cublas" in target.lower():
            return "gemm"
        if "cudnn$conv" in target:
            return "conv"
        if "triton" in target:
            return "pallas"
        return "custom:" + target
    return op


def _updates_in_place(comps: dict, fused: str) -> bool:
    """Whether the fused computation's root (or every element of a tuple root) is a dynamic-update-slice or
    scatter, which XLA runs in place in the operand's buffer."""
    body = comps.get(fused, [])
    by_name = {i["name"]: i for i in body}
    root = next((i for i in body if i["root"]), None)
    if root is None:
        return False
    parts = [by_name.get(o) for o in root["operands"]] if root["opcode"] == "tuple" else [root]
    return bool(parts) and all(p is not None and p["opcode"] in ("dynamic-update-slice", "scatter") for p in parts)


def _called(ins: dict) -> tuple[list[str], int] | None:
    """The computations a control instruction runs and how many times each: a while loop's body (its known trip count,
    else 1), a conditional's branches, a call's or async wrapper's callee. None for any other instruction."""
    op, attrs = ins["opcode"], ins["attrs"]
    if op == "while":
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
        return [_attr(attrs, "body").lstrip("%")], int(trips.group(1)) if trips else 1
    if op == "conditional":
        return re.findall(r"%([^\s,}]+)", _attr(attrs, "branch_computations")), 1
    if op in ("call", "async-start") or op.endswith("-start") and "calls=" in attrs:
        return [(_attr(attrs, "to_apply") or _attr(attrs, "calls")).lstrip("%")], 1
    return None


def _launches_kernel(op: str) -> bool:
    return op not in NO_KERNEL and not op.endswith("-done") and not op.endswith("-update")


def census(hlo: str) -> list[Kernel]:
    """Every kernel launch of the entry computation, and of the computations it calls (while bodies with their
    known trip counts, conditional branches, calls and async wrappers), in program order."""
    comps, entry = parse_computations(hlo)
    out: list[Kernel] = []

    def walk(comp: str, times: int, seen: tuple[str, ...]):
        types = {ins["name"]: ins["type"] for ins in comps.get(comp, [])}
        for ins in comps.get(comp, []):
            op, attrs = ins["opcode"], ins["attrs"]
            called = _called(ins)
            if called is not None:
                callees, trips = called
                for c in callees:  # every branch of a conditional: each may run
                    if c and c not in seen:
                        walk(c, times * trips, seen + (c,))
                continue
            if not _launches_kernel(op):
                continue
            kind = _kind(ins)
            operands = [types.get(o, "") for o in dict.fromkeys(ins["operands"])]
            if op == "fusion" and _updates_in_place(comps, _attr(attrs, "calls").lstrip("%")):
                # a dynamic-update-slice / scatter root writes into its operand's buffer: the traffic is the update
                big = max(operands, key=type_bytes, default="")
                moved = sum(type_bytes(t) for t in operands) - type_bytes(big)
                out.append(Kernel(kind, ins["name"], _attr(attrs, "op_name"), moved, moved, times, "in place"))
                continue
            if kind in ("fusion:loop", "copy"):  # elementwise: each operand read at most once per output element
                n_out = max((math.prod(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(
                    ins["type"])), default=0)
                read = sum(min(type_bytes(t), n_out * _elem_bytes(t)) for t in operands)
            else:
                read = sum(type_bytes(t) for t in operands)
            out.append(Kernel(kind, ins["name"], _attr(attrs, "op_name"), read, type_bytes(ins["type"]), times,
                              _attr(attrs, "custom_call_target") or _attr(attrs, "calls")))

    walk(entry, 1, (entry,))
    return out


def dependent_chain(hlo: str) -> tuple[int, list[str]]:
    """The longest chain of kernels each of which reads a result of the one before (data dependencies only: how the
    GPU runs a command buffer scheduled CONCURRENT, where independent kernels may overlap) -> (length, the chain's
    kernel names in order). A while loop counts its body's chain times its known trip count (the names list it
    once); a call or conditional its callee's (longest branch's) chain. With ~1,000 launches of a few microseconds
    each, this, not the launch count, is what sets a one-stream decode step's time."""
    comps, entry = parse_computations(hlo)
    memo: dict[str, tuple[int, list[str]]] = {}

    def chain(comp: str, seen: tuple[str, ...]) -> tuple[int, list[str]]:
        if comp in memo:
            return memo[comp]
        depth: dict[str, tuple[int, list[str]]] = {}
        best: tuple[int, list[str]] = (0, [])
        for ins in comps.get(comp, []):
            before = max((depth.get(o, (0, [])) for o in ins["operands"]), key=lambda d: d[0], default=(0, []))
            inner: tuple[int, list[str]] = (0, [])
            called = _called(ins)
            if called is not None:  # the longest callee (branch) chain, times the trip count
                callees, trips = called
                n, path = max((chain(c, seen + (c,)) for c in callees if c and c not in seen), key=lambda d: d[0],
                              default=(0, []))
                inner = (n * trips, path)
            elif _launches_kernel(ins["opcode"]):
                inner = (1, [ins["name"]])
            depth[ins["name"]] = (before[0] + inner[0], before[1] + inner[1])
            best = max(best, depth[ins["name"]], key=lambda d: d[0])
        memo[comp] = best
        return best

    return chain(entry, (entry,))


def launches(hlo: str) -> int:
    """Kernel launches per call of a compiled program (its optimized HLO text)."""
    return sum(k.times for k in census(hlo))


def summarise(kernels: list[Kernel], scopes: tuple[str, ...] = ()) -> dict:
    """Launches and bytes per kind and per scope, and the largest kernels by bytes."""
    by_kind, by_scope = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for k in kernels:
        for table, key in ((by_kind, k.kind), (by_scope, category_of(k.op_name, scopes))):
            table[key][0] += k.times
            table[key][1] += k.bytes * k.times
    launches = sum(k.times for k in kernels)
    total = sum(k.bytes * k.times for k in kernels)
    top = sorted(kernels, key=lambda k: -k.bytes * k.times)[:25]
    rows = lambda t: {key: {"launches": n, "mb": round(b / 1e6, 2)} for key, (n, b) in
                      sorted(t.items(), key=lambda kv: -kv[1][0])}
    return {"launches": launches, "bytes_mb": round(total / 1e6, 2), "traffic_ms_at_hbm": round(total / HBM_BPS * 1e3,
            3), "by_kind": rows(by_kind), "by_scope": rows(by_scope),
            "largest": [dict(kind=k.kind, name=k.name, op_name=k.op_name[-120:], mb=round(k.bytes * k.times / 1e6, 2))
                        for k in top]}


# ------------------------------------------------------------------------------------------------ targets
def decode_hlo(slots: int, variant: str, context: int = 512, max_len: int = 2048, model: str = "full") -> str:
    """The server's decode step (`frame_step_prefix` over `slots` rows of the `model` preset, a decode_profile variant),
    compiled for an H200."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from drama3_jax.config import preset
    from drama3_jax.generate import frame_step_prefix
    from drama3_jax.model import Drama3Model
    from experiments.decode_profile import PATCHES, VARIANTS, make_state, variant_patches
    from kernels.h200_lowering import as_if_on_gpu, compile_for_h200

    cfg = preset(model)
    backends, state_dtype, fuse = VARIANTS[PATCHES[variant][0] if variant in PATCHES else variant]
    model = nnx.eval_shape(lambda: Drama3Model(cfg, dtype=jnp.bfloat16, fp8_experts=True))
    if fuse:
        model = nnx.eval_shape(lambda m: m.fuse_projections(), model)
    graphdef, params = nnx.split(model)
    with as_if_on_gpu():
        state = jax.eval_shape(lambda: make_state(cfg, slots, max_len, context, state_dtype))
    with variant_patches(variant):
        return compile_for_h200(lambda p, s: frame_step_prefix(nnx.merge(graphdef, p), s, slots, backends), params,
                                state, donate_argnums=(1,))


def prefill_hlo(variant: str = "packed", bucket: int = -1, max_len: int = 2048, model: str = "full") -> tuple[str, str]:
    """One packed prefill call of the engine (`Prefiller.packed` on the `model` preset over the engine's packed bucket
    `bucket`: rows and lanes from EngineConfig.packed_buckets, the largest by default), compiled for an H200;
    `variant` is one of prefill_timing.py's packed variants. -> (HLO text, "rows x lanes")."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from drama3_jax.config import preset
    from drama3_jax.generate import Prefiller
    from drama3_jax.model import Drama3Model
    from drama3_jax.packing import Packing, pack_layout
    from experiments.common import patched
    from experiments.prefill_timing import PATCHES, variants
    from kernels.h200_lowering import as_if_on_gpu, compile_for_h200
    from serving.engine import EngineConfig

    cfg = preset(model)
    base, patches = PATCHES.get(variant, (variant, []))
    model = nnx.eval_shape(lambda: Drama3Model(cfg, dtype=jnp.bfloat16, fp8_experts=True))
    model = nnx.eval_shape(lambda m: m.fuse_projections(), model)
    rows, lanes = EngineConfig().packed_buckets[bucket]
    with as_if_on_gpu():
        pf = Prefiller(model, max_len, EngineConfig().prefill_chunk, variants(cfg)[base],
                       cache_dtype=jnp.bfloat16, state_dtype=jnp.bfloat16)
        cache = jax.eval_shape(lambda: pf._init(lanes)[0])
    ids = jax.ShapeDtypeStruct((1, rows, pf.row_width), jnp.int32)
    _, unpack, pack = pack_layout([2], rows, lanes, pf.chunk)
    lengths, packing = jax.ShapeDtypeStruct((lanes,), jnp.int32), Packing(jnp.asarray(unpack), jnp.asarray(pack))
    with patched(patches):
        hlo = compile_for_h200(pf._packed, pf._param_leaves, cache, ids, ids, lengths, packing)
    return hlo, f"{rows} rows x {lanes} lanes"


def codec_hlo(streams: int, frames: int, variant: str = "default", model: str = "full") -> str:
    """The streaming codec's `Codec.step` (the `model` codec preset, bf16) over `streams` x `frames` new frames,
    compiled for an H200; `variant` is one of codec_throughput.py's."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from drama3_jax.codec import streaming
    from drama3_jax.codec.config import codec_preset
    from drama3_jax.codec.model import ModifiedDAC
    from experiments.codec_throughput import VARIANTS as CODEC_VARIANTS
    from experiments.common import patched
    from kernels.h200_lowering import compile_for_h200

    cfg = codec_preset(model)
    model = nnx.eval_shape(lambda: ModifiedDAC(cfg, dtype=jnp.bfloat16))
    graphdef, params = nnx.split(model)
    state = jax.eval_shape(lambda: nnx.merge(graphdef, params).init_decode_state(streams))
    codes = jax.ShapeDtypeStruct((streams, cfg.n_codebooks, frames), jnp.int32)
    with patched(CODEC_VARIANTS[variant]):
        return compile_for_h200(streaming._step, graphdef, params, state, codes, None, static_argnums=(0,),
                                donate_argnums=(2,))




def write_markdown(R: dict, path: str):
    lines = [f"# Kernel census ({R['date']}, compiled for an H200 on a machine without one)", "",
             f"Command: `{R['command']}`. jax {R['jax']}. Launches and operand + result bytes per call, from the "
             "optimized HLO (kernels/h200_lowering.py `compile_for_h200`; GEMM tiles and cuDNN algorithms are XLA's "
             "untuned defaults). Bytes are an upper bound on traffic; the ms column is those bytes at 4.2 TB/s.", ""]
    for run in R["runs"]:
        s = run["summary"]
        lines += [f"## {run['target']}", "", f"{s['launches']} launches, {s['dependent_chain']} of them in the "
                  f"longest chain of dependent kernels; {s['bytes_mb']} MB ({s['traffic_ms_at_hbm']} ms at 4.2 TB/s); "
                  f"compiled in {run['compile_s']} s.", "",
                  "Longest dependent chain by scope: " + ", ".join(f"{k} {v}" for k, v in s["chain_by_scope"].items()),
                  "",
                  "| kind | launches | MB |", "|---|---|---|"]
        lines += [f"| {k} | {v['launches']} | {v['mb']} |" for k, v in s["by_kind"].items()]
        lines += ["", "| scope | launches | MB |", "|---|---|---|"]
        lines += [f"| {k} | {v['launches']} | {v['mb']} |" for k, v in s["by_scope"].items()]
        lines += ["", "Largest kernels by bytes:", "", "| kind | MB | op |", "|---|---|---|"]
        lines += [f"| {k['kind']} | {k['mb']} | `{k['op_name'] or k['name']}` |" for k in s["largest"][:12]]
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep-hlo", action="store_true", help="write each compiled HLO text beside the results")
    ap.add_argument("--preset", default="full", help="model and codec shapes (tiny: a quick check of this script)")
    sub = ap.add_subparsers(dest="target", required=True)
    d = sub.add_parser("decode")
    d.add_argument("--slots", type=int, nargs="+", default=[1, 128])
    d.add_argument("--variants", nargs="+", default=["pallas_bf16_w8a8_fused"])
    pr = sub.add_parser("prefill")
    pr.add_argument("--variants", nargs="+", default=["packed"])
    pr.add_argument("--bucket", type=int, default=-1, help="index into the engine's packed buckets (-1: largest)")
    c = sub.add_parser("codec")
    c.add_argument("--streams", type=int, default=128)
    c.add_argument("--frames", type=int, nargs="+", default=[8])
    c.add_argument("--variants", nargs="+", default=["default"])
    h = sub.add_parser("hlo")
    h.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax starts: this machine compiles, it runs nothing

    import jax

    from experiments.codec_throughput import PROFILE_CATEGORIES as CODEC_SCOPES
    from experiments.common import command_line, log, save_json
    from experiments.decode_profile import CATEGORIES as DECODE_SCOPES

    os.makedirs(args.out, exist_ok=True)
    R = {"command": command_line(args.out), "jax": jax.__version__,
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    jobs = []
    if args.target == "decode":
        jobs = [(f"decode {v} @ {n} slots", DECODE_SCOPES, lambda v=v, n=n: decode_hlo(n, v, model=args.preset))
                for v in args.variants for n in args.slots]
    elif args.target == "prefill":
        def prefill_job(v):
            hlo, shape = prefill_hlo(v, args.bucket, model=args.preset)
            log(f"prefill {v}: {shape}")
            return hlo
        jobs = [(f"prefill {v}", DECODE_SCOPES, lambda v=v: prefill_job(v)) for v in args.variants]
    elif args.target == "codec":
        jobs = [(f"codec {v} {args.streams} x {t}", CODEC_SCOPES,
                 lambda v=v, t=t: codec_hlo(args.streams, t, v, model=args.preset))
                for v in args.variants for t in args.frames]
    else:
        jobs = [(p, DECODE_SCOPES + CODEC_SCOPES, lambda p=p: open(p).read()) for p in args.files]
    for name, scopes, make in jobs:
        t = time.time()
        hlo = make()
        run = {"target": name, "compile_s": round(time.time() - t, 1)}
        kernels = census(hlo)
        run["summary"] = summarise(kernels, scopes)
        length, path = dependent_chain(hlo)
        by_name = {k.name: k for k in kernels}
        run["summary"]["dependent_chain"] = length
        run["summary"]["chain_by_scope"] = dict(Counter(
            category_of(by_name[n].op_name, scopes) if n in by_name else "other" for n in path).most_common())
        run["kinds"] = dict(Counter(k.kind for k in kernels))
        if args.keep_hlo:
            with open(os.path.join(args.out, re.sub(r"[^a-z0-9]+", "_", name.lower()) + ".hlo"), "w") as f:
                f.write(hlo)
        R["runs"].append(run)
        log({"target": name, "launches": run["summary"]["launches"], "chain": length, "mb": run["summary"]["bytes_mb"],
             "compile_s": run["compile_s"]})
        save_json(R, os.path.join(args.out, "hlo_census.json"))
    write_markdown(R, os.path.join(args.out, "hlo_census.md"))


if __name__ == "__main__":
    main()
