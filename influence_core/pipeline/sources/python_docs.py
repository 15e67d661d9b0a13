"""A text corpus that ships with Python: the docstrings of a fixed list of standard-library modules, cut into byte
windows for a byte-level language model (token id = byte value, so no tokenizer is needed)."""

from __future__ import annotations

import importlib
import inspect

import numpy as np

from ...task.builtin import IGNORE_INDEX

MODULES = (
    "argparse", "bisect", "calendar", "collections", "csv", "datetime", "decimal", "difflib", "fractions", "functools",
    "glob", "heapq", "inspect", "json", "logging", "os", "pathlib", "random", "re", "shutil", "statistics", "string",
    "subprocess", "tempfile", "textwrap", "threading", "unittest", "urllib.parse", "uuid", "zipfile",
)
PAD = ord(" ")  # queries shorter than the window are padded with spaces, never scored


def corpus() -> bytes:
    """The docstrings of MODULES and of their public classes, functions and methods, in a fixed order."""
    texts: list[str] = []
    for name in MODULES:
        module = importlib.import_module(name)
        texts.append(inspect.getdoc(module) or "")
        for attr in sorted(dir(module)):
            member = getattr(module, attr)
            if attr.startswith("_") or getattr(member, "__module__", None) != module.__name__:
                continue
            texts.append(inspect.getdoc(member) or "")
            if inspect.isclass(member):
                texts += [inspect.getdoc(m) or "" for n, m in sorted(vars(member).items()) if not n.startswith("_") and callable(m)]
    return "\n\n".join(t for t in texts if t).encode("utf-8")


def windows(text: bytes, width: int) -> np.ndarray:
    """Non-overlapping windows of `width` bytes, (n, width) int64."""
    n = len(text) // width
    return np.frombuffer(text[: n * width], dtype=np.uint8).reshape(n, width).astype(np.int64)


def query_rows(queries: list[str], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and labels of 'prompt|completion' queries: the text padded to `width`; labels scored on the completion
    only (the prompt and the padding are IGNORE_INDEX), so the measurement is -log p(completion | prompt)."""
    x = np.full((len(queries), width), PAD, dtype=np.int64)
    y = np.full((len(queries), width), IGNORE_INDEX, dtype=np.int64)
    for row, text in enumerate(queries):
        prompt, completion = (part.encode("utf-8") for part in text.split("|"))
        ids = np.frombuffer(prompt + completion, dtype=np.uint8)
        x[row, : len(ids)] = ids
        y[row, len(prompt) : len(ids)] = ids[len(prompt) :]
    return x, y
