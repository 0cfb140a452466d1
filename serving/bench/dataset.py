"""Benchmark request sets: a JSONL file, Seed-TTS-Eval's `meta.lst` with pre-encoded prompt codes, or a synthetic
English set generated from a seed (no download).

JSONL rows: {"text": str, "ref_text": str, "ref_audio_codes": [[int] * T] * 10, "forced_frames": int (optional),
"id": str (optional)}. Codebook 0 must be < the semantic size, codebooks 1..9 < the residual size.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

NUM_CODEBOOKS = 10
FRAME_RATE = 44100 / 2048  # Drama 3 / S2 codec: 21.53 frames per second
FRAMES_PER_WORD = 8.6  # about 2.5 English words per second of speech


class RequestFileError(ValueError):
    """A request set that cannot be used; the message names the file and row."""


@dataclasses.dataclass
class BenchRequest:
    id: str
    text: str
    ref_text: str
    ref_audio_codes: list[list[int]]
    forced_frames: int | None = None


def forced_frames_for(text: str) -> int:
    """Output length for random-weight models: about 8.6 frames per word."""
    return max(1, round(FRAMES_PER_WORD * len(text.split())))


def check_codes(codes, sizes: tuple[int, int], where: str) -> list[list[int]]:
    """Validate a [10][T] code array against (semantic size, residual size)."""
    try:
        arr = np.asarray(codes)
    except ValueError:
        arr = None
    if arr is None or arr.dtype == object or arr.ndim != 2 or arr.shape[0] != NUM_CODEBOOKS or arr.shape[1] == 0:
        raise RequestFileError(f"{where}: ref_audio_codes must be a rectangular integer array [10][T], T >= 1")
    if not np.issubdtype(arr.dtype, np.integer):
        raise RequestFileError(f"{where}: ref_audio_codes must hold integers")
    for k in range(NUM_CODEBOOKS):
        size = sizes[0] if k == 0 else sizes[1]
        if arr[k].min() < 0 or arr[k].max() >= size:
            raise RequestFileError(f"{where}: ref_audio_codes codebook {k} must be in [0, {size}) "
                                   "(see --codebook-sizes)")
    return arr.tolist()


def _row(obj, sizes, where: str, default_id: str) -> BenchRequest:
    if not isinstance(obj, dict):
        raise RequestFileError(f"{where}: each line must be a JSON object")
    for key in ("text", "ref_text"):
        if not isinstance(obj.get(key), str) or not obj[key].strip():
            raise RequestFileError(f"{where}: '{key}' must be a non-empty string")
    if "ref_audio_codes" not in obj:
        raise RequestFileError(f"{where}: missing 'ref_audio_codes'")
    forced = obj.get("forced_frames")
    if forced is not None and (isinstance(forced, bool) or not isinstance(forced, int) or forced < 1):
        raise RequestFileError(f"{where}: 'forced_frames' must be a positive integer")
    unknown = set(obj) - {"id", "text", "ref_text", "ref_audio_codes", "forced_frames"}
    if unknown:
        raise RequestFileError(f"{where}: unknown field(s) {sorted(unknown)}")
    return BenchRequest(str(obj.get("id", default_id)), obj["text"], obj["ref_text"],
                        check_codes(obj["ref_audio_codes"], sizes, where), forced)


def load_jsonl(path: str | Path, sizes: tuple[int, int]) -> list[BenchRequest]:
    path = Path(path)
    if not path.is_file():
        raise RequestFileError(f"{path}: no such file")
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestFileError(f"{path} line {i}: not valid JSON ({e.msg})") from None
        out.append(_row(obj, sizes, f"{path} line {i}", f"{path.stem}-{i}"))
    if not out:
        raise RequestFileError(f"{path}: no requests")
    return out


def load_seedtts(meta: str | Path, codes_dir: str | Path, sizes: tuple[int, int]) -> list[BenchRequest]:
    """Seed-TTS-Eval `meta.lst` (utt_id|prompt_text|prompt_wav|target_text[|gt_wav]); each prompt's codes in
    codes_dir/<prompt wav stem>.npy, written by `python -m drama3_jax.codec encode`."""
    meta, codes_dir = Path(meta), Path(codes_dir)
    if not meta.is_file():
        raise RequestFileError(f"{meta}: no such file")
    out = []
    for i, line in enumerate(meta.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("|")
        where = f"{meta} line {i}"
        if len(fields) not in (4, 5):
            raise RequestFileError(f"{where}: expected utt_id|prompt_text|prompt_wav|target_text[|gt_wav]")
        npy = codes_dir / (Path(fields[2]).stem + ".npy")
        if not npy.is_file():
            raise RequestFileError(f"{where}: no codes file {npy} (encode the prompt wav with the codec CLI)")
        out.append(_row({"id": fields[0], "ref_text": fields[1], "text": fields[3],
                         "ref_audio_codes": np.load(npy)}, sizes, where, fields[0]))
    if not out:
        raise RequestFileError(f"{meta}: no requests")
    return out


_WORDS = ("the a an this that our your their my his her its every some one two three few many other same next last "
          "old new small large long short early late quiet loud bright dark warm cold green blue red simple strange "
          "people city river garden window morning evening summer winter letter story bridge market station "
          "teacher doctor friend neighbour brother sister family village road forest music dinner question answer "
          "reason minute hour week year idea picture office kitchen paper money train ticket weather "
          "asked found kept brought walked opened closed carried watched heard painted wrote called left moved "
          "told gave made saw took built sold bought "
          "slowly quickly always never often again together almost only really still already "
          "in on at near under over behind across through after before with without from into").split()


def _sentence(rng: np.random.Generator, n_words: int) -> str:
    words = list(rng.choice(_WORDS, size=n_words))
    if n_words > 10:
        words[int(rng.integers(4, n_words - 3))] += ","
    return " ".join(words).capitalize() + str(rng.choice([".", ".", ".", "?", "!"]))


def synthetic(n: int, seed: int, sizes: tuple[int, int], words: tuple[int, int] = (8, 30),
              ref_seconds: tuple[float, float] = (3.0, 10.0)) -> list[BenchRequest]:
    """n English voice-cloning requests: target 8-30 words, a 3-10 s reference of random codes whose transcript has
    the matching word count (2.5 words/s). Deterministic in seed."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        secs = rng.uniform(*ref_seconds)
        frames = max(1, round(secs * FRAME_RATE))
        codes = np.concatenate([rng.integers(0, sizes[0], (1, frames)),
                                rng.integers(0, sizes[1], (NUM_CODEBOOKS - 1, frames))])
        ref_words = max(1, round(frames / FRAMES_PER_WORD))
        out.append(BenchRequest(f"syn-{seed}-{i}", _sentence(rng, int(rng.integers(words[0], words[1] + 1))),
                                _sentence(rng, ref_words), codes.tolist()))
    return out


def warmup_requests(reqs: list[BenchRequest], n: int) -> list[BenchRequest]:
    """n warm-up requests distinct from every timed one: row i's reference with row i+1's text (and its length)."""
    m = len(reqs)
    return [dataclasses.replace(reqs[i % m], id=f"warmup-{i}", text=reqs[(i + 1) % m].text,
                                forced_frames=reqs[(i + 1) % m].forced_frames) for i in range(n)]
