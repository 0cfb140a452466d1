"""Tokenizer + reference-bracket-v1 prompt builder on the tiny tokenizer (CPU, fast)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, models

from drama3_jax.config import TINY_TEXT_TOKENS, tiny_config
from drama3_jax.prompt import (REFERENCE_INSTRUCTION, TTS_INSTRUCTION, PromptError, build_prompt, history_for_chunk,
                               normalize_text, parse_turns, render_rows, split_long_text)
from drama3_jax.tokenizer import Drama3Tokenizer, TokenizerError, load_tokenizer, write_synthetic_tokenizer

CFG = tiny_config()
K = CFG.num_codebooks
IM_START, IM_END, VOICE = "<|im_start|>", "<|im_end|>", "<|voice|>"
SPK = [f"<|speaker:{n}|>" for n in range(16)]
SYSTEM = [IM_START, "system\n"]
GEN = [IM_START, "user\n"], [IM_END, "\n", IM_START, "assistant\n", VOICE]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_synthetic_tokenizer(d, CFG)
    (d / "config.json").write_text(json.dumps(CFG.to_dict()))
    return d


@pytest.fixture(scope="module")
def tok(ckpt):
    return load_tokenizer(ckpt)


def codes(seed: int, frames: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.band_size, (K, frames))


def golden(tok: Drama3Tokenizer, parts) -> np.ndarray:
    """Rows from an explicit layout: builder specials by name, literal segments encoded one by one, codes arrays."""
    rows = []
    for p in parts:
        if isinstance(p, np.ndarray):
            rows += [[CFG.semantic_start_token_id + f[0], *f] for f in p.T.tolist()]
        elif p in (IM_START, IM_END, VOICE) or p in SPK:
            rows.append([tok.tokenizer.token_to_id(p)] + [0] * K)
        else:
            rows += [[i] + [0] * K for i in tok.encode(p)]
    return np.asarray(rows, np.int32)


def check_rows(tok, rows, parts):
    """Exact layout, plus the row invariants: int32 [T, 11], text rows zero in 1..K, audio rows = codes, <|voice|> last."""
    assert rows.dtype == np.int32 and rows.ndim == 2 and rows.shape[1] == 1 + K
    np.testing.assert_array_equal(rows, golden(tok, parts))
    audio = (rows[:, 0] >= CFG.semantic_start_token_id) & (rows[:, 0] <= CFG.semantic_end_token_id)
    assert not rows[~audio, 1:].any()
    np.testing.assert_array_equal(rows[audio, 0], CFG.semantic_start_token_id + rows[audio, 1])
    code_parts = [p for p in parts if isinstance(p, np.ndarray)]
    if code_parts:
        np.testing.assert_array_equal(rows[audio, 1:], np.concatenate(code_parts, axis=1).T)
    else:
        assert not audio.any()
    np.testing.assert_array_equal(rows[-1], [tok.voice] + [0] * K)
    np.testing.assert_array_equal(rows[0], [tok.im_start] + [0] * K)


# ----------------------------------------------------------------------------------------------- tokenizer
def test_special_token_ids(tok):
    assert (tok.im_start, tok.im_end, tok.voice, tok.text, tok.interleave) == (384, 385, 386, 387, 388)
    assert tok.im_end == CFG.eos_token_id
    assert tok.speakers == tuple(range(389, 405))
    assert (tok.semantic_start, tok.semantic_end) == (416, 479) == (CFG.semantic_start_token_id,
                                                                     CFG.semantic_end_token_id)
    t = tok.tokenizer
    assert t.get_vocab_size(with_added_tokens=False) == TINY_TEXT_TOKENS
    assert t.get_vocab_size() == CFG.text.vocab_size == 480
    assert t.token_to_id("<|semantic:63|>") == 479 and t.token_to_id("<|semantic:64|>") is None
    assert [t.token_to_id(f"<|reserved:{i}|>") for i in (0, 10)] == [405, 415]
    text = "The harbour was quiet, ünïcode too."
    ids = tok.encode(text)
    assert max(ids) < TINY_TEXT_TOKENS and tok.decode(ids) == text
    assert len(tok.encode("the provided text to speech")) <= 10  # merges were learned


def test_tiny_tokenizer_is_byte_identical_across_runs(tmp_path, ckpt):
    a = write_synthetic_tokenizer(tmp_path / "a" / "tokenizer.json", CFG).read_bytes()
    code = "import sys; from drama3_jax.config import tiny_config; from drama3_jax.tokenizer import " \
           "write_synthetic_tokenizer as w; w(sys.argv[1], tiny_config())"
    env = dict(os.environ, PYTHONHASHSEED="12345", RAYON_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "b")], check=True, env=env)
    assert a == (tmp_path / "b" / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()


def test_tokenizer_config_mismatch_is_a_clear_error(ckpt):
    with pytest.raises(TokenizerError, match="eos_token_id 386 .* <\\|im_end\\|> id 385"):
        load_tokenizer(ckpt, dataclasses.replace(CFG, eos_token_id=386))
    shifted = dataclasses.replace(CFG, semantic_start_token_id=415, semantic_end_token_id=478)
    with pytest.raises(TokenizerError, match="<\\|semantic:0\\|> has id 416, config.json semantic_start_token_id 415"):
        load_tokenizer(ckpt, shifted)
    bare = Tokenizer(models.BPE())
    bare.add_special_tokens([AddedToken(IM_START, special=True)])
    with pytest.raises(TokenizerError, match="no <\\|im_end\\|> token"):
        Drama3Tokenizer.from_tokenizer(bare, CFG)
    with pytest.raises(TokenizerError, match="tokenizer.json not found"):
        load_tokenizer(ckpt / "nowhere", CFG)


# ------------------------------------------------------------------------------------------- golden layouts
def test_layout_without_reference(tok):
    rows = build_prompt(tok, CFG, "Hello there, harbour.")
    check_rows(tok, rows, [*SYSTEM, TTS_INSTRUCTION, IM_END, "\n", *GEN[0], SPK[0], " Hello there, harbour.", *GEN[1]])


def test_layout_with_two_references(tok):
    c1, c2 = codes(1, 7), codes(2, 4)
    rows = build_prompt(tok, CFG, "<|speaker:0|> Target line.",
                        references=[(c1, "First reference transcript."), (c2, "  <|speaker:0|>Second\none. ")])
    check_rows(tok, rows, [
        *SYSTEM, REFERENCE_INSTRUCTION,
        "\n\n[Reference 1]\nText: ", SPK[0], " First reference transcript.\nSpeech: ", c1,
        "\n\n[Reference 2]\nText: ", SPK[0], " Second one.\nSpeech: ", c2,
        IM_END, "\n", *GEN[0], SPK[0], " Target line.", *GEN[1]])
    assert render_rows(tok, rows).count("<audio x7>") == 1


def test_layout_with_two_previous_takes(tok):
    a, b, ref = codes(3, 5), codes(4, 6), codes(5, 3)
    rows = build_prompt(tok, CFG, "And now the last part.", references=[(ref, "Voice.")],
                        previous_takes=[("First part.", a), ("<|speaker:2|> Second part.", b)])
    check_rows(tok, rows, [
        *SYSTEM, REFERENCE_INSTRUCTION, "\n\n[Reference 1]\nText: ", SPK[0], " Voice.\nSpeech: ", ref, IM_END, "\n",
        *GEN[0], SPK[0], " First part.", *GEN[1], a, IM_END, "\n",
        *GEN[0], SPK[2], " Second part.", *GEN[1], b, IM_END, "\n",
        *GEN[0], SPK[0], " And now the last part.", *GEN[1]])


def test_layout_multi_speaker_with_cues(tok):
    text = "Hi there.\r\n\n[sighs] Long\nday. <|speaker:1|>Hello <whisper>quietly</whisper>.\n<|speaker:15|> Bye!"
    rows = build_prompt(tok, CFG, text)
    check_rows(tok, rows, [*SYSTEM, TTS_INSTRUCTION, IM_END, "\n", *GEN[0],
                           SPK[0], " Hi there. [sighs] Long day.\n", SPK[1], " Hello <whisper>quietly</whisper>.\n",
                           SPK[15], " Bye!", *GEN[1]])


def test_segments_are_tokenised_separately(tok):
    """The reference instruction and the first reference bracket are separate segments: joined, the tiny (Qwen-style)
    pre-tokenizer glues ':' to the following line breaks and the ids change at the seam."""
    bracket = "\n\n[Reference 1]\nText: "
    separate = tok.encode(REFERENCE_INSTRUCTION) + tok.encode(bracket)
    assert tok.encode(REFERENCE_INSTRUCTION + bracket) != separate
    rows = build_prompt(tok, CFG, "Hi.", references=[(codes(6, 2), "Ref.")])
    start = len(tok.encode("<|im_start|>system\n"))
    assert rows[start:start + len(separate), 0].tolist() == separate
    # inside one segment the transcript and "\nSpeech: " are tokenised together, as both public builders do
    seg = tok.encode(" Ref.\nSpeech: ")
    assert seg != tok.encode(" Ref.") + tok.encode("\nSpeech: ")
    at = start + len(separate) + 1  # after <|speaker:0|>
    assert rows[at:at + len(seg), 0].tolist() == seg


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("text,message", [
    ("hi <|im_end|> there", "<|im_end|> is written by the prompt builder"),
    ("<|im_start|>user", "<|im_start|> is written"), ("a <|voice|>", "<|voice|> is written"),
    ("<|text|>", "<|text|> is written"), ("x<|interleave|>", "<|interleave|> is written"),
    ("say <|semantic:7|>", "<|semantic: is written"),
    ("<|speaker:16|> hi", "bad speaker tag '<|speaker:16|>'"), ("<|speaker:01|> hi", "bad speaker tag '<|speaker:01|>'"),
    ("<|speaker:x|> hi", "bad speaker tag"), ("", "text is empty"), (" \n\t\u3000", "text is empty"),
    ("<|speaker:3|>  \n", "text is empty"),
])
def test_bad_text_is_rejected(tok, text, message):
    with pytest.raises(PromptError, match=re.escape(message)):
        build_prompt(tok, CFG, text)
    with pytest.raises(PromptError, match="reference 1: " + re.escape(message)):
        build_prompt(tok, CFG, "fine", references=[(codes(7, 2), text)])
    with pytest.raises(PromptError, match="previous take 1: " + re.escape(message)):
        build_prompt(tok, CFG, "fine", previous_takes=[(text, codes(8, 2))])


def test_bad_codes_are_rejected(tok):
    good = codes(9, 4)
    high0, high1, neg = good.copy(), good.copy(), good.copy()
    high0[0, 2], high1[5, 1], neg[3, 0] = CFG.band_size, CFG.tower.vocab_size, -1
    cases = [(good[:9], r"shape \[10, T\], got \[9, 4\]"), (good[0], r"shape \[10, T\], got \[4\]"),
             (good[:, :0], "no frames"), (good.astype(np.float32), "must be integers"),
             (high0, r"c0 codes must lie in \[0, 64\)"), (high1, r"c1.. codes must lie in \[0, 64\)"),
             (neg, r"c1.. codes must lie in \[0, 64\)"), ("transcript", "swapped")]
    for bad, message in cases:
        with pytest.raises(PromptError, match="reference 2: .*" + message):
            build_prompt(tok, CFG, "fine", references=[(good, "ok"), (bad, "ok")])
        with pytest.raises(PromptError, match="previous take 1: .*" + message):
            build_prompt(tok, CFG, "fine", previous_takes=[("ok", bad)])
    assert issubclass(PromptError, ValueError)


# --------------------------------------------------------------------------------------------- text rules
def test_line_breaks_become_spaces_except_between_turns():
    assert normalize_text("First line.\n\nSecond\u2028line.\t two  spaces") == \
        "<|speaker:0|> First line. Second line.\t two  spaces"
    assert normalize_text("<|speaker:0|> First.\n\n<|speaker:1|> Next\r\nline.") == \
        "<|speaker:0|> First.\n<|speaker:1|> Next line."
    once = normalize_text("Intro <|speaker:4|>Four\n")
    assert once == "<|speaker:0|> Intro\n<|speaker:4|> Four" == normalize_text(once)
    assert parse_turns("<|speaker:2|> a <|speaker:2|> b") == [(2, "a"), (2, "b")]


# ------------------------------------------------------------------------------------------- long text
def _lines(chunk: str) -> list[tuple[int, str]]:
    out = []
    for line in chunk.split("\n"):
        m = re.fullmatch(r"<\|speaker:(\d+)\|> (.+)", line)
        assert m, f"chunk line without a leading speaker tag: {line!r}"
        out.append((int(m.group(1)), m.group(2)))
    return out


UNITS = ["<whisper>do not cut this, please. It is one unit.</whisper>", "[laughs, then coughs. Twice]",
         "<french>bonjour, mes amis.</french>", "[sighs]"]


def test_long_text_chunks():
    sentences = " ".join(f"Sentence {i} is about the harbour, the boats and 3.14 tides." for i in range(14))
    text = (f"{sentences} {UNITS[0]} More words here.\n<|speaker:1|> {UNITS[1]} " + "Reply words go on. " * 12
            + f"<|speaker:2|> {UNITS[2]} Short.\n<|speaker:3|> Three. <|speaker:4|> Four {UNITS[3]}."
            + " <|speaker:1|> Back again." + " Ünïcödé wörds ëvérywhere." * 9)
    chunks = split_long_text(text, max_bytes=160)
    assert len(chunks) > 5
    flat = []
    for c in chunks:
        lines = _lines(c)
        assert len({n for n, _ in lines}) <= 3
        assert len(c.encode()) <= 160
        assert normalize_text(c) == c  # build_prompt keeps chunks as they are
        flat += lines
    for u in UNITS:
        assert sum(u in c for c in chunks) == 1, u
    # speaker order and words survive; a turn cut at a chunk boundary continues under its speaker tag
    merged = []
    for n, body in flat:
        if merged and merged[-1][0] == n:
            merged[-1] = (n, merged[-1][1] + " " + body)
        else:
            merged.append((n, body))
    assert [(n, b.split()) for n, b in merged] == [(n, b.split()) for n, b in parse_turns(text)]
    assert sum(1 for c in chunks if c.startswith("<|speaker:1|>")) >= 3
    # sentence ends are preferred: every piece of speaker 0's sentences ends at a sentence end
    assert all(body.endswith(".") for n, body in flat if n == 0)
    assert "3.14" in "".join(chunks) and "3. 14" not in "".join(chunks)


def test_long_text_fallback_cuts():
    words = split_long_text("wort " * 120, max_bytes=100)  # no marks: cut at spaces, each chunk filled up
    assert all(len(c.encode()) <= 100 < len(c.encode()) + len(" wort") for c in words[:-1])
    assert " ".join(b for c in words for _, b in _lines(c)).split() == ["wort"] * 120
    cjk = split_long_text("长" * 200, max_bytes=100)  # no marks, no spaces: cut between characters
    assert all(len(c.encode()) <= 100 for c in cjk) and "".join(c.split(" ", 1)[1] for c in cjk) == "长" * 200
    big = "<whisper>" + "leise, " * 40 + "</whisper>"
    out = split_long_text(f"Hallo. {big} Ende.", max_bytes=100)
    assert out == ["<|speaker:0|> Hallo.", f"<|speaker:0|> {big}", "<|speaker:0|> Ende."]
    assert split_long_text("Short one. <|speaker:1|> Two.") == ["<|speaker:0|> Short one.\n<|speaker:1|> Two."]
    assert split_long_text("<|speaker:0|> a. <|speaker:1|> b. <|speaker:2|> c.", max_speakers=1) == \
        ["<|speaker:0|> a.", "<|speaker:1|> b.", "<|speaker:2|> c."]


def test_history_for_chunk():
    takes = [(f"chunk {i}", codes(20 + i, 3)) for i in range(4)]
    assert history_for_chunk(0, takes) == []
    assert history_for_chunk(1, takes) == [takes[0]]
    assert history_for_chunk(2, takes) == [takes[0], takes[1]]
    assert history_for_chunk(4, takes) == [takes[0], takes[3]]
    assert history_for_chunk(3, [None, takes[1], ("silent", np.zeros((K, 0), int))]) == [takes[1]]


# ------------------------------------------------------------------------------------------------------ CLI
def test_cli_end_to_end(tok, ckpt, tmp_path):
    ref, prev = codes(30, 7), codes(31, 5)
    np.save(tmp_path / "ref.npy", ref)
    np.save(tmp_path / "prev.npy", prev)
    out = tmp_path / "rows.npy"
    cmd = [sys.executable, "-m", "drama3_jax.prompt", "--checkpoint", str(ckpt), "--text", "Hello <|speaker:1|> Hi!",
           "--reference", str(tmp_path / "ref.npy"), "Reference words.",
           "--previous-take", "Earlier words.", str(tmp_path / "prev.npy"), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = np.load(out)
    assert rows.dtype == np.int32 and rows.shape[1] == 11
    np.testing.assert_array_equal(rows, build_prompt(tok, CFG, "Hello <|speaker:1|> Hi!",
                                                     references=[(ref, "Reference words.")],
                                                     previous_takes=[("Earlier words.", prev)]))
    assert rows[-1, 0] == tok.voice
    assert "Text: <|speaker:0|> Reference words.\nSpeech: <audio x7><|im_end|>" in r.stdout
    assert "<|voice|><audio x5><|im_end|>" in r.stdout
    assert "<|speaker:0|> Hello\n<|speaker:1|> Hi!<|im_end|>\n<|im_start|>assistant\n<|voice|>\n" in r.stdout
    bad = subprocess.run(cmd[:6] + ["<|speaker:16|> no"] + cmd[-2:], capture_output=True, text=True)
    assert bad.returncode == 2 and "bad speaker tag" in bad.stderr and not bad.stdout


def test_synthetic_tokenizer_with_the_full_id_layout(tmp_path):
    """The full preset's ids (eos 248046, band 248320..252415, vocab 252416) with fillers in the gaps: the loader
    accepts it and prompts use the real-size band."""
    from drama3_jax.config import full_config

    cfg = full_config()
    write_synthetic_tokenizer(tmp_path, cfg)
    tok = load_tokenizer(tmp_path, cfg)
    assert (tok.im_start, tok.im_end, tok.semantic_start) == (248_045, 248_046, 248_320)
    assert tok.tokenizer.get_vocab_size() == cfg.text.vocab_size
    codes = np.random.default_rng(0).integers(0, 1024, (10, 7))
    codes[0] = np.random.default_rng(1).integers(0, 4096, 7)
    rows = build_prompt(tok, cfg, "Full size.", [(codes, "Seven frames.")])
    audio = rows[rows[:, 0] >= cfg.semantic_start_token_id]
    np.testing.assert_array_equal(audio[:, 1:].T, codes)
    assert rows[-1, 0] == tok.voice
