"""Sums of many parts in one fixed pairwise tree: ((0+1)+(2+3))+… in the order the parts come.

The tree depends only on the number of parts, so a sum taken here and one taken as Dask tasks (`add` submitting
a task on two futures) add in the same order and give the same bits; its rounding error grows with log n, not n;
and it holds O(log n) partial sums at a time, so neither this process nor the driver of a cluster ever holds every
part at once (K-FAC block sums, LiSSA repeat terms).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from distributed import Client

T = TypeVar("T")


def pairwise_sum(parts: Iterable[T], add: Callable[[T, T], T]) -> T:
    """add(...) over `parts` as a binary counter: two partial sums of equal height are added as soon as both exist,
    and at the end the remaining ones from the right, e.g. 7 parts as ((0+1)+(2+3)) + ((4+5)+6)."""
    stack: list[tuple[int, T]] = []
    for part in parts:
        height, value = 0, part
        while stack and stack[-1][0] == height:
            value, height = add(stack.pop()[1], value), height + 1
        stack.append((height, value))
    if not stack:
        raise ValueError("pairwise_sum of no parts")
    total = stack.pop()[1]
    while stack:
        total = add(stack.pop()[1], total)
    return total


def summed_tasks(client: Client | None, fn: Callable[..., T], calls: list[tuple[Any, ...]], add: Callable[[T, T], T], shared: dict[str, Any] | None = None) -> T:
    """fn(*call, **shared) for every call, added in the pairwise tree: here one call at a time, or as Dask tasks
    whose additions are tasks too (retried twice on a lost worker), the driver receiving only the total."""
    if client is None:
        return pairwise_sum((fn(*call, **(shared or {})) for call in calls), add)
    futures = client.map(fn, *zip(*calls), pure=False, retries=2, **(shared or {}))
    return pairwise_sum(futures, lambda a, b: client.submit(add, a, b, pure=False, retries=2)).result()
