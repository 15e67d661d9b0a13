"""What the report and the top-k table show of an example: text for token ids (byte-level), 'prompt|completion' for
a prompted query, the values of a table row."""

from __future__ import annotations

import numpy as np

from influence_core.pipeline.report import TEXT_CHARS, decode_bytes, prompted_text, row_text


def test_token_ids_read_as_bytes_with_line_breaks_marked_and_long_texts_cut():
    ids = np.frombuffer(b"def f():\n\treturn 1", dtype=np.uint8).astype(np.int64)
    assert decode_bytes(ids) == "def f():⏎ return 1"
    assert decode_bytes(np.append(ids, -100)) == "def f():⏎ return 1"  # an unscored label is no byte
    long = decode_bytes(np.full(200, ord("a")))
    assert len(long) == TEXT_CHARS and long.endswith("…")


def test_a_prompted_query_reads_prompt_bar_completion():
    ids = np.frombuffer(b"Return the absolute value   ", dtype=np.uint8).astype(np.int64)
    labels = np.full(len(ids), -100)
    labels[10:25] = ids[10:25]
    assert prompted_text(ids, labels) == "Return the| absolute value"
    assert prompted_text(ids, ids) == decode_bytes(ids)  # every label scored: a training window, the whole text


def test_a_table_row_shows_each_value():
    assert row_text(np.array([0.5, -1.25, 3.0], dtype=np.float32)).splitlines() == ["x0  0.5", "x1  -1.25", "x2  3"]
