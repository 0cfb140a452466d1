"""experiments/xla_flags_ab.py: the report's table and its token-digest comparison (pure functions; no children)."""

from experiments.xla_flags_ab import digest_note, last_line, parse_set, table

ROWS = [
    {"set": "base", "figures": {"decode 128 slots": 17.0}, "digests": {"decode 128 slots": "aa"}},
    {"set": "pdl", "figures": {"decode 128 slots": 16.0}, "digests": {"decode 128 slots": "aa"}},
    {"set": "fusion", "figures": {"decode 128 slots": 18.7}, "digests": {"decode 128 slots": "bb"}},
    {"set": "base", "figures": {"decode 128 slots": 17.2}, "digests": {"decode 128 slots": "aa"}},
]


def test_parse_set_keeps_empty_flags_and_rejects_missing_name():
    assert parse_set("base=") == ("base", "")
    assert parse_set("pdl=--xla_gpu_enable_pdl=true") == ("pdl", "--xla_gpu_enable_pdl=true")
    for bad in ("base", "=--x"):
        try:
            parse_set(bad)
        except Exception as e:  # argparse.ArgumentTypeError
            assert "NAME=FLAGS" in str(e)
        else:
            raise AssertionError(bad)


def test_table_is_the_median_per_set_against_the_first():
    t = table(ROWS, ["base", "pdl", "fusion"])
    assert "| decode 128 slots | 17.200 | 16.000 (-7.0%) | 18.700 (+8.7%) |" in t


def test_digest_note_names_the_sets_that_sampled_other_tokens():
    note = digest_note(ROWS, "base")
    assert "the same for pdl (decode 128 slots)" in note
    assert "different for fusion (decode 128 slots)" in note


def test_digest_note_is_empty_without_decode_digests():
    assert digest_note([{"set": "base", "figures": {"codec 8x4": 5.0}},
                        {"set": "conv", "figures": {}}], "base") == ""


def test_last_line_of_a_failed_child_log(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("compiling\nXlaRuntimeError: INTERNAL: bad flag\n\n")
    assert last_line(str(log)) == "XlaRuntimeError: INTERNAL: bad flag"
    assert last_line(str(tmp_path / "missing.txt")) == ""
