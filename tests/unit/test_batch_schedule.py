"""The batch schedule is a pure function of (seed, epoch): each epoch visits every row once, in batches drawn from
the seed alone, and training with it is bit-reproducible."""

from __future__ import annotations

import torch

from influence_core.task import Classification
from influence_core.training import AdamRecipe, BatchSchedule, train


def test_epoch_is_a_function_of_seed_and_epoch() -> None:
    schedule = BatchSchedule(seed=5, n_rows=23, batch_size=4, block_rows=10)
    epochs = list(schedule.epochs(4))
    for index, blocks in enumerate(epochs):
        replayed = BatchSchedule(5, 23, 4, 10).epoch(index)
        assert [b.start for b in replayed] == [b.start for b in blocks]
        assert all(torch.equal(p, q) for a, b in zip(replayed, blocks) for p, q in zip(a.rows(), b.rows()))
        rows = torch.cat(list(r for b in blocks for r in b.rows()))
        assert sorted(rows.tolist()) == list(range(23))  # every row once per epoch
        assert sum(len(b.batches) for b in blocks) == schedule.steps_per_epoch() == 3 + 3 + 1  # blocks of 10, 10, 3 rows in batches of 4
    assert not torch.equal(torch.cat(list(schedule.steps(1))), torch.cat(list(BatchSchedule(6, 23, 4, 10).steps(1))))


def test_training_is_bit_reproducible_from_its_seed() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 3, generator=g), torch.randint(0, 2, (30,), generator=g)
    recipe = AdamRecipe(epochs=3, batch_size=8, learning_rate=1e-2, weight_decay=1e-3, seed=2, block_rows=16)
    states = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        train(model, Classification(), recipe, x, y)
        states.append(model.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
