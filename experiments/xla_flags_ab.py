"""A/B of XLA flag sets on the three GPU calls of serving: decode step, codec call, packed prefill call.

XLA reads `XLA_FLAGS` once per process, so every (flag set, call) pair runs the call's own experiment script in a
fresh process with that environment (`drama3_jax.xla_flags` adds the serving defaults a set does not name). Rounds
alternate the order of the sets, so drift between the first and the last process does not look like a flag effect.

  python experiments/xla_flags_ab.py --out $OUT/flags --calls decode codec \
      --set base= --set pdl=--xla_gpu_enable_pdl=true

Writes `xla_flags_ab.json` (every child's figures, command, return code) and `xla_flags_ab.md` after each child, and
keeps each child's log and JSON under OUT/<set>/<call>_r<round>/. The decode children also digest the tokens of one
step after the timed ones; the report says which sets sampled the same tokens as the first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# call -> (script arguments after --out, function(child JSON) -> {figure name: ms})
CALLS = {
    "decode": (["experiments/decode_profile.py", "--phase", "timing", "--variants", "pallas_bf16_w8a8_fused"],
               "decode_timing.json",
               lambda d: {f"decode {r['slots']} slots": r["step_ms"] for r in d["rows"] if "step_ms" in r}),
    "codec": (["experiments/codec_throughput.py", "--configs", "bfloat16:128:8", "bfloat16:8:4", "--budget-s", "60"],
              "codec_throughput.json",
              lambda d: {f"codec {r['batch']}x{r['chunk_frames']}": r["ms_per_step"] for r in d["results"]}),
    "prefill": (["experiments/prefill_timing.py", "--batch", "8", "--variants", "packed", "--calls", "5"],
                "prefill_timing.json",
                lambda d: {f"prefill {r['variant']} x{r['batch']}": r["ms"] for r in d["rows"]}),
}


def parse_set(text: str) -> tuple[str, str]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--set wants NAME=FLAGS (FLAGS may be empty), got {text!r}")
    return name, flags


def table(rows: list[dict], names: list[str]) -> str:
    """Median over rounds of every figure, one column per flag set, the change against the first set."""
    figs: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        for fig, ms in r["figures"].items():
            figs.setdefault(fig, {}).setdefault(r["set"], []).append(ms)
    med = lambda v: sorted(v)[len(v) // 2] if v else None
    head = "| figure (ms, median of rounds) | " + " | ".join(names) + " |"
    out = [head, "|" + "---|" * (len(names) + 1)]
    for fig, by_set in figs.items():
        base = med(by_set.get(names[0], []))
        cells = []
        for n in names:
            m = med(by_set.get(n, []))
            cell = "-" if m is None else f"{m:.3f}"
            if m is not None and base and n != names[0]:
                cell += f" ({100 * (m / base - 1):+.1f}%)"
            cells.append(cell)
        out.append(f"| {fig} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def digest_note(rows: list[dict], base: str) -> str:
    """Which sets' decode steps sampled the same tokens as the first set's (same state, same number of steps): a
    flag that only schedules kernels (e.g. PDL) must match; one that changes fusion may round differently."""
    ref = {}
    for r in rows:
        if r["set"] == base:
            ref.update(r.get("digests", {}))
    same, differ = set(), set()
    for r in rows:
        for fig, d in r.get("digests", {}).items():
            if r["set"] != base and fig in ref:
                (same if d == ref[fig] else differ).add(f"{r['set']} ({fig})")
    if not same and not differ:  # no decode call, or no set beside the base digested one
        return ""
    return (f"Tokens after the timed decode steps, against `{base}`: the same for {', '.join(sorted(same)) or '-'}; "
            f"different for {', '.join(sorted(differ)) or '-'}.")


def last_line(path: str) -> str:
    """The last non-empty line of a child's log (its error, when it failed), '' if none."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", dest="sets", type=parse_set, action="append", required=True,
                    help="NAME=XLA flags of one set (the first set is the baseline of the table)")
    ap.add_argument("--calls", nargs="+", choices=sorted(CALLS), default=["decode", "codec"])
    ap.add_argument("--decode-slots", type=int, nargs="+", default=[128, 1])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new child after this many seconds")
    ap.add_argument("--child-timeout-s", type=float, default=400.0)
    ap.add_argument("--child-args", default="", help="appended to every child's command (e.g. '--preset tiny')")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    names = [n for n, _ in args.sets]
    if len(set(names)) != len(names):
        raise SystemExit(f"flag set names must be distinct: {names}")
    report = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "sets": dict(args.sets), "rows": []}
    t0 = time.time()
    repo = os.path.dirname(HERE)
    for rnd in range(args.rounds):
        order = args.sets if rnd % 2 == 0 else args.sets[::-1]
        for call in args.calls:
            script, result_file, figures = CALLS[call]
            for name, flags in order:
                if time.time() - t0 > args.budget_s:
                    print(f"[{time.time() - t0:7.1f}s] budget spent: {name} {call} round {rnd} not run", flush=True)
                    continue
                out = os.path.join(args.out, name, f"{call}_r{rnd}")
                os.makedirs(out, exist_ok=True)
                cmd = [sys.executable, script[0], "--out", out, *script[1:], *args.child_args.split()]
                if call == "decode":
                    cmd += ["--slots", *map(str, args.decode_slots)]
                env = dict(os.environ, XLA_FLAGS=flags)
                start = time.time()
                with open(os.path.join(out, "log.txt"), "w") as log:
                    try:
                        rc = subprocess.run(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            timeout=args.child_timeout_s).returncode
                    except subprocess.TimeoutExpired:
                        rc = "timeout"
                row = {"set": name, "flags": flags, "call": call, "round": rnd, "rc": rc,
                       "wall_s": round(time.time() - start, 1), "figures": {}}
                try:
                    with open(os.path.join(out, result_file)) as f:
                        child = json.load(f)
                    row["figures"] = figures(child)
                    row["digests"] = {f"{call} {r['slots']} slots": r["tokens_digest"]
                                      for r in child.get("rows", []) if "tokens_digest" in r}
                except (OSError, KeyError, ValueError) as e:
                    row["error"] = f"{type(e).__name__}: {e}"
                if rc != 0:
                    row["log_tail"] = last_line(os.path.join(out, "log.txt"))
                report["rows"].append(row)
                print(f"[{time.time() - t0:7.1f}s] {name:>16} {call:>8} r{rnd} rc={rc} {row['wall_s']}s "
                      f"{json.dumps(row['figures'])}" + (f" | {row['log_tail']}" if rc != 0 else ""), flush=True)
                with open(os.path.join(args.out, "xla_flags_ab.json"), "w") as f:
                    json.dump(report, f, indent=1)
                with open(os.path.join(args.out, "xla_flags_ab.md"), "w") as f:
                    f.write(f"# XLA flag sets A/B ({report['date']})\n\nCommand: `{report['command']}`\n\n")
                    f.write("\n".join(f"- `{n}`: `{fl or '(serving defaults only)'}`" for n, fl in args.sets))
                    f.write("\n\n" + table(report["rows"], names) + "\n")
                    if note := digest_note(report["rows"], names[0]):
                        f.write("\n" + note + "\n")
                    for r in report["rows"]:
                        if r["rc"] != 0:
                            f.write(f"\n`{r['set']}` {r['call']} round {r['round']} failed (rc {r['rc']}): "
                                    f"{r.get('log_tail') or '(no log)'}\n")
    print(table(report["rows"], names))
    if note := digest_note(report["rows"], names[0]):
        print(note)


if __name__ == "__main__":
    main()
