"""What the report and the top-k table show of an example: text for token ids (byte-level), 'prompt|completion' for
a prompted query, the values of a table row."""

from __future__ import annotations

import numpy as np

from influence_core.pipeline.report.report import TEXT_CHARS, decode_bytes, example_view, image_of, prompted_text, row_text, topk_rows


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


def test_images_are_drawn_as_images_whatever_their_source():
    """(C, H, W) and (H, W) examples are images even without the source's image_shape; flat rows are not; named
    fields show pixel_values (or the field shaped like images) rather than the first field."""
    gray, rgb = np.arange(64.0).reshape(1, 8, 8), np.stack([np.full((4, 4), v) for v in (0.0, 5.0, 10.0)])
    np.testing.assert_array_equal(image_of(gray, None), gray[0])
    assert image_of(rgb, None).shape == (4, 4, 3) and image_of(rgb, None).min() == 0.0 and image_of(rgb, None).max() == 1.0
    np.testing.assert_array_equal(image_of(np.arange(64.0), (8, 8)), np.arange(64.0).reshape(8, 8))
    assert image_of(np.arange(64.0), None) is None and image_of(np.zeros((5, 8, 8)), None) is None
    fields = {"mask": np.ones((2, 7)), "pixel_values": np.zeros((2, 3, 4, 4))}
    assert example_view(fields) is fields["pixel_values"]
    assert example_view({"ids": np.ones((2, 7)), "image": np.zeros((2, 1, 8, 8))})[0].shape == (1, 8, 8)


def test_token_text_comes_from_the_task_decoder():
    """A task over a tokenizer's vocabulary decodes its own ids (here: a word per id) in the table's prompt|completion
    labels and cells; the default reads bytes, showing control characters as �."""
    words = {0: "the", 1: "cat", 2: "sat", 300: "mat"}

    def decode(ids: list[int]) -> str:
        return " ".join(words[i] for i in ids)

    ids, labels = np.array([0, 1, 2, 300]), np.array([-100, -100, 2, 300])
    assert prompted_text(ids, labels, decode) == "the cat|sat mat"
    assert decode_bytes(np.array([0, 300, -100]), decode=decode) == "the mat"
    assert decode_bytes(np.array([104, 105, 7, 10])) == "hi\ufffd⏎"
    group = {"topk_helpful_indices": np.array([[1]]), "topk_helpful_scores": np.array([[2.0]]), "topk_harmful_indices": np.array([[0]]), "topk_harmful_scores": np.array([[-1.0]])}
    y_train = np.array([[0, 1, 2], [2, 300, 1]])
    rows = topk_rows(group, y_train, labels[None, :], 1, 1, ids[None, :], decode)
    assert rows[0].label == "the cat|sat mat" and rows[0].helpful[0].label == "sat mat cat" and rows[0].harmful[0].label == "the cat sat"
