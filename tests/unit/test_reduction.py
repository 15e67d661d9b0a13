"""The pairwise sum: its tree depends on the number of parts only (the reference: pairing level by level), it
holds O(log n) partial sums, and empty input is refused."""

from __future__ import annotations

import math

import pytest

from influence_core.reduction import pairwise_sum


def level_by_level(parts: list[str]) -> str:
    """Independent reference: pair neighbours level by level, an odd last part carried up; the top level's last
    two partial sums are then joined right to left, as a binary counter leaves them."""
    levels: list[list[str]] = [parts]
    while len(levels[-1]) > 1:
        level = levels[-1]
        levels.append([f"({level[i]}+{level[i + 1]})" for i in range(0, len(level) - 1, 2)])
    # the parts a complete pairing leaves out at each level: one per set bit of n, highest first
    leftovers = [level[-1] for level in levels if len(level) % 2 == 1]
    total = leftovers[0]
    for left in leftovers[1:]:
        total = f"({left}+{total})"
    return total


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 12, 13, 31, 32, 33, 100])
def test_the_tree_is_the_binary_counters_and_few_partial_sums_are_held(n):
    live, peak = 0, 0

    def parts():
        nonlocal live, peak
        for i in range(n):
            live += 1
            peak = max(peak, live)
            yield str(i)

    def add(a: str, b: str) -> str:
        nonlocal live
        live -= 1
        return f"({a}+{b})"

    total = pairwise_sum(parts(), add)
    assert total == level_by_level([str(i) for i in range(n)])
    assert sorted(int(t) for t in total.replace("(", " ").replace(")", " ").replace("+", " ").split()) == list(range(n))
    assert live == 1 and peak <= math.floor(math.log2(n)) + 2


def test_powers_of_two_give_a_balanced_tree():
    assert pairwise_sum(list("abcd"), lambda a, b: f"({a}+{b})") == "((a+b)+(c+d))"


def test_no_parts_is_refused():
    with pytest.raises(ValueError, match="no parts"):
        pairwise_sum([], lambda a, b: a + b)
