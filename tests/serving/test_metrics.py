"""Process-level serving metrics."""

from __future__ import annotations


def test_gc_pause_monitor_times_collections_and_warns(caplog):
    import gc

    from prometheus_client import CollectorRegistry, Histogram

    from serving.metrics import GcPauseMonitor

    hist = Histogram("gc_pause_test", "test", registry=CollectorRegistry())
    mon = GcPauseMonitor(hist, warn_s=1e-9).install()
    try:
        with caplog.at_level("WARNING", logger="serving.metrics"):
            gc.collect()
    finally:
        mon.uninstall()
    assert mon not in gc.callbacks
    assert sum(x.value for m in hist.collect() for x in m.samples if x.name.endswith("_count")) >= 1
    assert "garbage collection of generation 2" in caplog.text
