"""Drama 3 prompts in the "reference-bracket-v1" layout as int32 frame rows [T, 1+K] (drama3-architecture.md 3.2, 3.5).

Text rows are [token, 0, ..., 0]; audio rows are [semantic_start + c0, c0, c1, ..., c_{K-1}]. The prompt is a list
of segments, each literal string tokenised on its own (tokenising the joined prompt changes ids at the seams; the
tokenizer still splits the special tokens inside a segment out as single ids). Segment boundaries follow both public
builders (sglang-omni fishaudio_drama3/prompt.py build_prompt_rows, mlx-audio fish_drama3/drama3.py build_frames):

    "<|im_start|>system\\n"  instruction
      per reference n: "\\n\\n[Reference n]\\nText: <|speaker:0|> transcript\\nSpeech: "  <audio rows>
    "<|im_end|>\\n"
      per previous take: "<|im_start|>user\\n"  text  "<|im_end|>\\n"  "<|im_start|>assistant\\n<|voice|>"  <audio rows>
                         "<|im_end|>\\n"
    "<|im_start|>user\\n"  text  "<|im_end|>\\n"  "<|im_start|>assistant\\n<|voice|>"

Caller text is normalised to speaker turns "<|speaker:N|> body" joined by "\\n"; inside a body every whitespace run
holding a line break becomes one space (mlx-audio fish_drama3/chunking.py: a line break could end the model's turn).
Long text is cut into chunks by `split_long_text`; chunk i is generated with `history_for_chunk(i, takes)`.

CLI: python -m drama3_jax.prompt --checkpoint DIR --text TEXT [--reference CODES.npy TRANSCRIPT]...
     [--previous-take TEXT CODES.npy]... --out ROWS.npy
"""

from __future__ import annotations

import argparse
import bisect
import re
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from drama3_jax.config import Drama3Config
from drama3_jax.tokenizer import NUM_SPEAKERS, STRUCTURAL, Drama3Tokenizer, load_tokenizer, speaker_token

TTS_INSTRUCTION = "convert the provided text to speech"
REFERENCE_INSTRUCTION = "convert the provided text to speech reference to the following:"
SYSTEM_START = "<|im_start|>system\n"
USER_START = "<|im_start|>user\n"
MESSAGE_END = "<|im_end|>\n"
VOICE_START = "<|im_start|>assistant\n<|voice|>"

# Written only by the builder; "<|semantic:" covers the whole band.
_FORBIDDEN = (*STRUCTURAL, "<|semantic:")
SPEAKER_TAG = re.compile(r"<\|speaker:([0-9]+)\|>")
_SPEAKER_NAMES = frozenset(str(n) for n in range(NUM_SPEAKERS))  # "0".."15": no leading zeros
# Unicode White_Space (str.strip() without an argument would also strip U+001C..U+001F).
WHITE_SPACE = "".join(map(chr, [*range(0x9, 0xE), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                                0x2028, 0x2029, 0x202F, 0x205F, 0x3000]))
_WS_RUN = re.compile(f"[{re.escape(WHITE_SPACE)}]+")
_LINE_BREAKS = frozenset("\n\r\v\f\x85\u2028\u2029")


class PromptError(ValueError):
    """Caller text or codes that cannot go into a prompt; the message names the input and the problem."""


# ------------------------------------------------------------------------------------------------ text rules
def parse_turns(text: str, where: str = "text") -> list[tuple[int, str]]:
    """Validated speaker turns [(speaker, body)]: untagged leading text is speaker 0, line breaks in bodies become
    spaces, bodies are stripped, empty turns dropped. Raises PromptError on empty text, structural tokens or bad
    speaker tags."""
    if not isinstance(text, str):
        raise PromptError(f"{where}: expected a string, got {type(text).__name__}")
    if not text.strip(WHITE_SPACE):
        raise PromptError(f"{where}: text is empty")
    for token in _FORBIDDEN:
        if token in text:
            raise PromptError(f"{where}: {token} is written by the prompt builder and must not appear in caller text")
    for m in re.finditer(r"<\|speaker", text):
        tag = SPEAKER_TAG.match(text, m.start())
        if tag is None or tag.group(1) not in _SPEAKER_NAMES:
            bad = re.compile(r"<\|speaker[^|<>]{0,12}(\|>)?").match(text, m.start()).group()
            raise PromptError(f"{where}: bad speaker tag {bad!r}; speaker tags are <|speaker:0|>.."
                              f"<|speaker:{NUM_SPEAKERS - 1}|> without leading zeros")
    parts = SPEAKER_TAG.split(text)
    turns = [(0, parts[0])] + [(int(n), body) for n, body in zip(parts[1::2], parts[2::2])]
    turns = [(n, _flatten(body)) for n, body in turns]
    turns = [(n, body) for n, body in turns if body]
    if not turns:
        raise PromptError(f"{where}: text is empty (speaker tags without words)")
    return turns


def _flatten(body: str) -> str:
    def join(m: re.Match) -> str:
        return " " if any(c in _LINE_BREAKS for c in m.group()) else m.group()

    return _WS_RUN.sub(join, body).strip(WHITE_SPACE)


def _render_turns(turns: Sequence[tuple[int, str]]) -> str:
    return "\n".join(f"{speaker_token(n)} {body}" for n, body in turns)


def normalize_text(text: str, where: str = "text") -> str:
    """Canonical caller text: "<|speaker:N|> body" turns joined by "\\n" (idempotent)."""
    return _render_turns(parse_turns(text, where))


def check_codes(codes, cfg: Drama3Config, where: str) -> np.ndarray:
    """Validated codes as int32 [K, T]: T >= 1, c0 in [0, band_size), c1.. in [0, tower.vocab_size)."""
    if isinstance(codes, str):
        raise PromptError(f"{where}: expected codes [{cfg.num_codebooks}, T], got a string (swapped arguments?)")
    a = np.asarray(codes)
    if a.dtype.kind not in "iu":
        raise PromptError(f"{where}: codes must be integers, got dtype {a.dtype}")
    if a.ndim != 2 or a.shape[0] != cfg.num_codebooks:
        raise PromptError(f"{where}: codes must have shape [{cfg.num_codebooks}, T], got {list(a.shape)}")
    if a.shape[1] == 0:
        raise PromptError(f"{where}: codes have no frames")
    for name, part, size in (("c0", a[:1], cfg.band_size), ("c1..", a[1:], cfg.tower.vocab_size)):
        if part.size and (part.min() < 0 or part.max() >= size):
            raise PromptError(f"{where}: {name} codes must lie in [0, {size}), got range "
                              f"[{part.min()}, {part.max()}]")
    return a.astype(np.int32)


# ---------------------------------------------------------------------------------------------------- prompt
def prompt_segments(cfg: Drama3Config, text: str, references=(), previous_takes=()) -> list[str | np.ndarray]:
    """The prompt as literal strings (tokenised one by one) and validated int32 [K, T] code arrays."""
    target = normalize_text(text, "text")
    segs: list[str | np.ndarray] = [SYSTEM_START, REFERENCE_INSTRUCTION if references else TTS_INSTRUCTION]
    for n, ref in enumerate(references, 1):
        where = f"reference {n}"
        codes, transcript = _pair(ref, where, "(codes, transcript)")
        codes = check_codes(codes, cfg, where)
        segs += [f"\n\n[Reference {n}]\nText: {normalize_text(transcript, where)}\nSpeech: ", codes]
    segs.append(MESSAGE_END)
    for n, take in enumerate(previous_takes, 1):
        where = f"previous take {n}"
        take_text, codes = _pair(take, where, "(text, codes)")
        codes = check_codes(codes, cfg, where)
        segs += [USER_START, normalize_text(take_text, where), MESSAGE_END, VOICE_START, codes, MESSAGE_END]
    return segs + [USER_START, target, MESSAGE_END, VOICE_START]


def _pair(item, where: str, form: str):
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise PromptError(f"{where}: expected a pair {form}")
    return item


def build_prompt(tok: Drama3Tokenizer, cfg: Drama3Config, text: str, references=(), previous_takes=()) -> np.ndarray:
    """Frame rows int32 [T, 1+K] ending with the <|voice|> row.

    references: sequence of (codes int [K, T_ref], transcript); previous_takes: sequence of (text, codes int [K, T]).
    """
    rows = []
    for seg in prompt_segments(cfg, text, references, previous_takes):
        if isinstance(seg, str):
            ids = tok.encode(seg)
            block = np.zeros((len(ids), cfg.row_width), np.int32)
            block[:, 0] = ids
        else:
            block = np.concatenate([seg[:1] + tok.semantic_start, seg]).T
        rows.append(block)
    return np.ascontiguousarray(np.concatenate(rows), dtype=np.int32)


def render_rows(tok: Drama3Tokenizer, rows: np.ndarray) -> str:
    """Human-readable rows: decoded text runs, and `<audio xN>` for each run of N semantic rows."""
    out, i = [], 0
    main = np.asarray(rows)[:, 0]
    audio = (main >= tok.semantic_start) & (main <= tok.semantic_end)
    while i < len(main):
        j = i
        while j < len(main) and audio[j] == audio[i]:
            j += 1
        out.append(f"<audio x{j - i}>" if audio[i] else tok.decode(main[i:j]))
        i = j
    return "".join(out)


# ------------------------------------------------------------------------------------------- long-text chunks
# Cut marks (mlx-audio fish_drama3/chunking.py: sentence ends, then clause marks, then spaces). ASCII marks only count
# before white space, so "3.14", "3,000" and "12:30" stay whole; CJK marks need none.
_SENTENCE_ASCII, _SENTENCE_WIDE = ".!?;", "…。！？；"
_CLAUSE_ASCII, _CLAUSE_WIDE = ",:", "，：、"
_CLOSERS = "\"')»”’」』"
# Never cut inside: <|...|> tokens, paired tags <x ...>...</x>, lone tags <x>, </x>, and [cues].
_UNCUTTABLE = re.compile(r"<\|[^|>]*\|>|<([A-Za-z][\w-]*)\b[^<>]*>.*?</\1>|</?[A-Za-z][\w-]*[^<>]*>|\[[^\[\]]*\]")


def _cut_points(body: str) -> tuple[list[int], list[int], list[int], list[tuple[int, int]]]:
    """Sorted piece-end positions after sentence ends, after clause marks, before spaces; and uncuttable spans."""
    spans = [m.span() for m in _UNCUTTABLE.finditer(body)]
    inside = np.zeros(len(body) + 1, bool)
    for a, b in spans:
        inside[a + 1:b] = True
    sentence, clause, space = [], [], []
    for p in range(1, len(body)):
        if inside[p]:
            continue
        prev, nxt = body[p - 1], body[p]
        if nxt in WHITE_SPACE:
            if prev not in WHITE_SPACE:
                space.append(p)
        if nxt in _CLOSERS or nxt in _SENTENCE_ASCII + _SENTENCE_WIDE + _CLAUSE_ASCII + _CLAUSE_WIDE:
            continue  # cut after the whole run of marks and closing quotes
        q = p - 1
        while q > 0 and body[q] in _CLOSERS:
            q -= 1
        mark, spaced = body[q], nxt in WHITE_SPACE
        if mark in _SENTENCE_WIDE or (mark in _SENTENCE_ASCII and spaced):
            sentence.append(p)
        elif mark in _CLAUSE_WIDE or (mark in _CLAUSE_ASCII and spaced):
            clause.append(p)
    return sentence, clause, space, spans


class _Body:
    """One turn body with its cut points and UTF-8 byte offsets."""

    def __init__(self, body: str):
        self.text = body
        self.sentence, self.clause, self.space, self.spans = _cut_points(body)
        self.off = np.cumsum([0] + [len(c.encode()) for c in body]).tolist()

    def take(self, start: int, limit: int, levels: Sequence[int]) -> int | None:
        """End of the longest piece text[start:p] of <= limit bytes cut at the first level that has a cut
        (0 sentence, 1 clause, 2 space, 3 any character outside uncuttable spans); None if no level has one."""
        maxp = bisect.bisect_right(self.off, self.off[start] + limit) - 1
        if maxp >= len(self.text):
            return len(self.text)
        for level in levels:
            if level < 3:
                cuts = (self.sentence, self.clause, self.space)[level]
                j = bisect.bisect_right(cuts, maxp) - 1
                if j >= 0 and cuts[j] > start:
                    return cuts[j]
            else:
                p = next((a for a, b in self.spans if a < maxp < b), maxp)
                if p > start:
                    return p
        return None

    def unit_end(self, start: int) -> int:
        """End of the smallest unit at `start`: an uncuttable span, or one character."""
        return next((b for a, b in self.spans if a == start), start + 1)

    def skip_space(self, p: int) -> int:
        while p < len(self.text) and self.text[p] in WHITE_SPACE:
            p += 1
        return p


def split_long_text(text: str, max_bytes: int = 300, max_speakers: int = 3) -> list[str]:
    """Generation chunks of at most ~max_bytes UTF-8 bytes (tags and "\\n" included) with at most max_speakers
    distinct speakers, each in the canonical "<|speaker:N|> body" form that `build_prompt` keeps unchanged.

    Cuts prefer sentence ends, then clause marks, then spaces, then characters; never inside <|...|> tokens, paired
    tags or [cues]; an uncuttable unit longer than max_bytes becomes an oversized chunk of its own. A turn cut at a
    chunk boundary continues in the next chunk under its speaker tag. A new turn joins a non-empty chunk only whole
    or cut at a sentence end.
    """
    if max_bytes < 1 or max_speakers < 1:
        raise PromptError(f"max_bytes ({max_bytes}) and max_speakers ({max_speakers}) must be >= 1")
    chunks: list[list[tuple[int, str]]] = [[]]
    for speaker, body_text in parse_turns(text, "text"):
        body, start = _Body(body_text), 0
        tag_bytes = len(speaker_token(speaker).encode()) + 1
        chunk = chunks[-1]
        if chunk and (speaker in {n for n, _ in chunk} or len({n for n, _ in chunk}) < max_speakers):
            used = len(_render_turns(chunk).encode()) + 1  # + "\n"
            end = body.take(0, max_bytes - used - tag_bytes, (0,)) if max_bytes - used - tag_bytes > 0 else None
            if end is not None:
                chunk.append((speaker, body_text[:end].rstrip(WHITE_SPACE)))
                start = body.skip_space(end)
        while start < len(body_text):
            end = body.take(start, max_bytes - tag_bytes, (0, 1, 2, 3)) or body.unit_end(start)
            chunks.append([(speaker, body_text[start:end].rstrip(WHITE_SPACE))])
            start = body.skip_space(end)
    return [_render_turns(c) for c in chunks if c]


def history_for_chunk(i: int, takes: Sequence) -> list[tuple[str, np.ndarray]]:
    """Previous takes for chunk i (mlx-audio fish_drama3/drama3.py generate): the first chunk's take, plus the latest
    take if it is another one. takes[j] = (chunk text, codes [K, T]) produced for chunk j < i; an entry that is None
    or has no frames (the chunk gave no audio) is skipped."""
    done = [t for t in list(takes)[:i] if t is not None and np.asarray(t[1]).shape[-1] > 0]
    return done[:1] + done[-1:] if len(done) > 1 else done


# ----------------------------------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m drama3_jax.prompt", description="Build Drama 3 prompt frame rows.")
    p.add_argument("--checkpoint", required=True, type=Path, help="dir with config.json and tokenizer.json")
    p.add_argument("--text", required=True)
    p.add_argument("--reference", nargs=2, action="append", default=[], metavar=("CODES.npy", "TRANSCRIPT"))
    p.add_argument("--previous-take", nargs=2, action="append", default=[], metavar=("TEXT", "CODES.npy"))
    p.add_argument("--out", required=True, type=Path, help="int32 [T, 1+K] rows (.npy)")
    args = p.parse_args(argv)
    try:
        cfg = Drama3Config.from_json(args.checkpoint)
        tok = load_tokenizer(args.checkpoint, cfg)
        rows = build_prompt(tok, cfg, args.text,
                            references=[(np.load(c), t) for c, t in args.reference],
                            previous_takes=[(t, np.load(c)) for t, c in args.previous_take])
    except (ValueError, OSError) as e:  # PromptError, TokenizerError, ConfigError, unreadable files
        print(f"error: {e}", file=sys.stderr)
        return 2
    np.save(args.out, rows)
    print(render_rows(tok, rows))
    n_audio = int(((rows[:, 0] >= tok.semantic_start) & (rows[:, 0] <= tok.semantic_end)).sum())
    print(f"# {rows.shape[0]} rows x {rows.shape[1]} ({n_audio} audio) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
