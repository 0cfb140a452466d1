"""Launcher options that depend on the model size."""
from serving.launch import FULL_SIZE_DECODE_SIZES, build_parser, resolve_decode_sizes


def test_decode_sizes_default_by_model_size_and_explicit_values_win():
    parse = lambda *a: build_parser().parse_args(list(a)).decode_sizes
    assert parse() is None and parse("--decode-sizes") == [] and parse("--decode-sizes", "8", "24") == [8, 24]
    assert resolve_decode_sizes(None, 128, full_size=True) == FULL_SIZE_DECODE_SIZES == (1, 16, 32, 64)
    assert resolve_decode_sizes(None, 64, full_size=True) == (1, 16, 32)   # sizes at or above the pool are dropped
    assert resolve_decode_sizes(None, 128, full_size=False) == ()       # the tiny model: whole-pool steps only
    assert resolve_decode_sizes([], 128, full_size=True) == ()          # `--decode-sizes` alone: whole pool
    assert resolve_decode_sizes([8, 24], 128, full_size=False) == (8, 24)


def test_the_launcher_defaults_are_the_engine_defaults():
    """serving.launch spells its defaults out (it imports no JAX before setting XLA_FLAGS), so a default changed in
    EngineConfig must change there too: every option named after an EngineConfig field has the field's default."""
    import dataclasses

    from serving.engine import EngineConfig

    args, engine = vars(build_parser().parse_args([])), EngineConfig()
    shared = [f.name for f in dataclasses.fields(EngineConfig) if f.name in args and f.name != "decode_sizes"]
    assert len(shared) > 20
    for name in shared:
        value = args[name]
        assert (tuple(value) if isinstance(value, list) else value) == getattr(engine, name), name


def test_a_gpu_memory_fraction_outside_0_1_is_a_usage_error(capsys):
    import pytest

    from serving.launch import main

    with pytest.raises(SystemExit) as e:
        main(["--gpu-memory-fraction", "1.5"])
    assert e.value.code == 2 and "GPU memory fraction must be a number in (0, 1], got '1.5'" in capsys.readouterr().err
