"""The Drama 3 tokenizer: every special id resolved from `tokenizer.json` itself and checked against config.json.

Tokens the prompt builder needs (drama3-architecture.md 3.4): `<|im_start|>`, `<|im_end|>` (= eos), `<|voice|>`,
`<|text|>`, `<|interleave|>`, `<|speaker:0|>`..`<|speaker:15|>` and the contiguous semantic band
`<|semantic:0|>`..`<|semantic:{band-1}|>` = `semantic_start_token_id`..`semantic_end_token_id`.

`write_synthetic_tokenizer` writes a real byte-level BPE with the special tokens at a config's ids (random checkpoints).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from drama3_jax.config import TINY_TEXT_TOKENS, Drama3Config

NUM_SPEAKERS = 16
IM_START, IM_END, VOICE, TEXT, INTERLEAVE = "<|im_start|>", "<|im_end|>", "<|voice|>", "<|text|>", "<|interleave|>"
STRUCTURAL = (IM_START, IM_END, VOICE, TEXT, INTERLEAVE)


def speaker_token(n: int) -> str:
    return f"<|speaker:{n}|>"


def semantic_token(c: int) -> str:
    return f"<|semantic:{c}|>"


class TokenizerError(ValueError):
    """tokenizer.json lacks a token the prompt needs, or disagrees with config.json."""


@dataclasses.dataclass(frozen=True)
class Drama3Tokenizer:
    """A `tokenizers.Tokenizer` plus the special ids the prompt builder writes."""

    tokenizer: Tokenizer
    im_start: int
    im_end: int
    voice: int
    text: int
    interleave: int
    speakers: tuple[int, ...]  # <|speaker:0|>..<|speaker:15|>
    semantic_start: int
    semantic_end: int

    def encode(self, text: str) -> list[int]:
        """Token ids of one literal prompt segment; added tokens inside it are split out by the tokenizer, and no
        post-processor tokens (BOS, ...) are added: the prompt builder writes all structure itself."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """Text of ids with special tokens spelled out."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, cfg: Drama3Config) -> "Drama3Tokenizer":
        """Resolve every special id by name and cross-check it against `cfg`; raises TokenizerError."""

        def need(token: str) -> int:
            i = tokenizer.token_to_id(token)
            if i is None:
                raise TokenizerError(f"tokenizer.json has no {token} token")
            if not 0 <= i < cfg.text.vocab_size:
                raise TokenizerError(f"{token} has id {i}, outside text_config.vocab_size {cfg.text.vocab_size}")
            return i

        ids = {t: need(t) for t in STRUCTURAL}
        speakers = tuple(need(speaker_token(n)) for n in range(NUM_SPEAKERS))
        for t, i in [*ids.items(), *((speaker_token(n), s) for n, s in enumerate(speakers))]:
            got = tokenizer.encode(t, add_special_tokens=False).ids
            if got != [i]:  # prompt segments spell these out, so the tokenizer must split them out as one id
                raise TokenizerError(f"tokenizer encodes {t} as {got}, not as its added-token id [{i}]")
        band = cfg.band_size
        for c in range(band):  # the builder writes semantic_start + c0, so the band must be contiguous
            got = need(semantic_token(c))
            if got != cfg.semantic_start_token_id + c:
                raise TokenizerError(
                    f"tokenizer {semantic_token(c)} has id {got}, config.json semantic_start_token_id "
                    f"{cfg.semantic_start_token_id} + {c} = {cfg.semantic_start_token_id + c}")
        if ids[IM_END] != cfg.eos_token_id:
            raise TokenizerError(f"config.json eos_token_id {cfg.eos_token_id} is not the tokenizer's {IM_END} "
                                 f"id {ids[IM_END]}")
        return cls(tokenizer=tokenizer, im_start=ids[IM_START], im_end=ids[IM_END], voice=ids[VOICE],
                   text=ids[TEXT], interleave=ids[INTERLEAVE], speakers=speakers,
                   semantic_start=cfg.semantic_start_token_id, semantic_end=cfg.semantic_start_token_id + band - 1)


def load_tokenizer(checkpoint_dir: str | Path, cfg: Drama3Config | None = None) -> Drama3Tokenizer:
    """`DIR/tokenizer.json`, validated against `cfg` (default: `DIR/config.json`)."""
    checkpoint_dir = Path(checkpoint_dir)
    path = checkpoint_dir / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"{path} not found (a checkpoint dir must hold config.json and tokenizer.json)")
    if cfg is None:
        cfg = Drama3Config.from_json(checkpoint_dir)
    return Drama3Tokenizer.from_tokenizer(Tokenizer.from_file(str(path)), cfg)


# ------------------------------------------------------------------------------------------ tiny tokenizer
# Qwen2-family pre-tokenizer split (Qwen/Qwen2.5 tokenizer.json "Split" pattern): punctuation absorbs following line
# breaks, so seams between prompt segments matter the way they do for the real Qwen3.5-derived tokenizer.
_QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

_TINY_CORPUS = """\
convert the provided text to speech
convert the provided text to speech reference to the following:

[Reference 1]
Text: The lighthouse keeper climbed the stairs every evening at dusk.
Speech: 

A quiet morning settled over the harbour. The fishing boats rocked gently against the pier, their ropes creaking
as the tide came in. Somewhere behind the market a dog barked twice, then gave up and went back to sleep.
Nobody was in a hurry today, and that suited everyone just fine.

Notes for the reader:
Speak slowly when the sentence is long, and pause at every comma.
Raise your voice a little for questions. Is that clear? Good.
Whisper the secret parts, and laugh when something is funny!

She opened the letter, read it once, and folded it again. "I don't think we should go," she said. "Not tonight,
not after what happened last week." He nodded, though he wasn't sure he agreed. The rain kept falling on the roof,
steady and patient, as if it had all the time in the world.

The recipe was simple:
two cups of flour, one egg, a pinch of salt, and enough milk to make the batter smooth.
Mix it well. Let it rest for ten minutes. Then heat the pan and pour in a thin layer.

Welcome back to the show! Today we are talking about trains, tickets and timetables. Our first caller says the
evening train is always late. Our second caller says it is always early. They can't both be right, can they?
"""


def write_synthetic_tokenizer(path: str | Path, cfg: Drama3Config) -> Path:
    """A real byte-level BPE of TINY_TEXT_TOKENS text tokens trained on an embedded corpus, with the special tokens at
    the ids `cfg` names: <|im_start|> = eos - 1, <|im_end|> = eos, then <|voice|>, <|text|>, <|interleave|> and the 16
    speakers, the semantic band at `semantic_start_token_id`, and `<|reserved:i|>` fillers in every gap up to
    `vocab_size`. For the tiny preset that is exactly the tiny layout (no filler before <|im_start|>); for the full
    preset it gives a tokenizer with the full id layout for random-weight speed tests. `path`: a tokenizer.json path,
    or a directory to write it into. Byte-identical across runs. Returns the written file."""
    path = Path(path)
    if path.suffix != ".json":
        path = path / "tokenizer.json"
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_TEXT_TOKENS, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TINY_CORPUS], trainer=trainer)
    if tok.get_vocab_size() != TINY_TEXT_TOKENS:
        raise TokenizerError(f"tiny BPE training gave {tok.get_vocab_size()} text tokens, expected {TINY_TEXT_TOKENS}")

    named = [IM_START, IM_END, VOICE, TEXT, INTERLEAVE] + [speaker_token(n) for n in range(NUM_SPEAKERS)]
    start = cfg.eos_token_id - 1
    band = range(cfg.semantic_start_token_id, cfg.semantic_end_token_id + 1)
    if start < TINY_TEXT_TOKENS or (start < band.stop and band.start < start + len(named)):
        raise TokenizerError(f"config {cfg.name!r}: the special tokens (<|im_start|> at eos - 1 = {start} and the "
                             f"{len(named) - 1} after it) must lie above the {TINY_TEXT_TOKENS} text tokens and "
                             "outside the semantic band")
    by_id = {start + i: t for i, t in enumerate(named)}
    by_id.update({band.start + c: semantic_token(c) for c in range(len(band))})
    n_reserved = 0
    specials = []
    for i in range(TINY_TEXT_TOKENS, cfg.text.vocab_size):
        if i in by_id:
            specials.append(by_id[i])
        else:
            specials.append(f"<|reserved:{n_reserved}|>")
            n_reserved += 1
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    for want in (start, cfg.eos_token_id, band.start, band.stop - 1, cfg.text.vocab_size - 1):
        if tok.token_to_id(specials[want - TINY_TEXT_TOKENS]) != want:
            raise TokenizerError(f"synthetic tokenizer: {specials[want - TINY_TEXT_TOKENS]} did not get id {want}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path), pretty=True)
    Drama3Tokenizer.from_tokenizer(Tokenizer.from_file(str(path)), cfg)  # the written file must pass the loader
    return path
