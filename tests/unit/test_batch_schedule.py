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


def test_a_linear_decay_trains_as_torchs_own_scheduler() -> None:
    """`decay: linear` is lr·(1 − t/T) at step t of T: the same weights, bit for bit, as torch.optim.Adam stepped by
    torch's LambdaLR over the same batches; and not those of the constant step size."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 3, generator=g), torch.randint(0, 2, (30,), generator=g)
    recipe = AdamRecipe(epochs=3, batch_size=8, learning_rate=1e-2, weight_decay=1e-3, seed=2, block_rows=16, decay="linear")
    total = recipe.steps(30)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))

    decayed, constant, reference = model(), model(), model()
    train(decayed, Classification(), recipe, x, y)
    train(constant, Classification(), AdamRecipe(3, 8, 1e-2, 1e-3, 2, block_rows=16), x, y)
    optimiser = torch.optim.Adam(reference.parameters(), lr=1e-2, weight_decay=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda t: 1 - t / total)
    for rows in recipe.schedule(30).steps(recipe.epochs):
        optimiser.zero_grad()
        Classification().mean_loss(reference(x[rows]), y[rows]).backward()
        optimiser.step()
        scheduler.step()
    assert total == 3 * 4  # blocks of 16 and 14 rows: batches of 8, 8 and 8, 6 in each of the 3 epochs
    assert all(torch.equal(a, b) for a, b in zip(decayed.state_dict().values(), reference.state_dict().values()))
    assert not torch.equal(decayed.state_dict()["2.weight"], constant.state_dict()["2.weight"])
