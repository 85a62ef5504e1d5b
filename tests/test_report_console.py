"""console helpers: table alignment and human units."""

from __future__ import annotations

from geotrain.console import format_table, human_bytes, human_rate, human_seconds, progress


def test_format_table_aligns_columns():
    out = format_table(["kind", "time", "util"], [["gpipe", 1.234567, "12.5%"], ["interleaved", 10, "3.0%"]])
    lines = out.splitlines()
    assert len(lines) == 4 and set(lines[1].replace(" ", "")) == {"-"}
    # numbers right-aligned: the last characters of each numeric column line up
    assert lines[2].index("1.235") + len("1.235") == lines[3].index("10") + len("10")
    assert lines[2].endswith("12.5%") and lines[3].endswith(" 3.0%")
    assert lines[3].startswith("interleaved")


def test_human_units():
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 2**30) == "3 GiB"
    assert human_seconds(0.00456) == "4.56 ms"
    assert human_seconds(12e-6) == "12 us"
    assert human_seconds(125) == "2m05s"
    assert human_seconds(3725) == "1h02m"
    assert human_rate(3.2e14, "FLOP/s") == "320 TFLOP/s"
    assert human_rate(12345, "tok/s") == "12.3 ktok/s"


def test_progress_is_transparent_when_disabled():
    items = [1, 2, 3]
    assert progress(items, enable=False) is items
    assert list(progress(iter(items), total=3, enable=True)) == items
