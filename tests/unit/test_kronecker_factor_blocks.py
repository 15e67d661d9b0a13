"""K-FAC factor blocks: contiguous row ranges covering every row once, as few as FACTOR_ROWS allows, of equal size."""

from __future__ import annotations

import math

import pytest
import torch

from influence_core.pipeline.stages.preconditioner import FACTOR_POSITIONS, FACTOR_ROWS, factor_blocks


@pytest.mark.parametrize("n", [1, 7, FACTOR_ROWS, FACTOR_ROWS + 1, 5_000, 2 * FACTOR_ROWS + 1, 1_000_000])
def test_factor_blocks_cover_the_rows_in_equal_blocks(n):
    blocks = factor_blocks(n)
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(hi == lo for (_, hi), (lo, _) in zip(blocks, blocks[1:]))  # contiguous, in order
    assert len(blocks) == math.ceil(n / FACTOR_ROWS)
    sizes = [hi - lo for lo, hi in blocks]
    assert max(sizes) <= FACTOR_ROWS and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("n", "positions", "expected"), [(2_000, 64, [(0, 1_000), (1_000, 2_000)]), (3, FACTOR_POSITIONS + 1, [(0, 1), (1, 2), (2, 3)]),
                                                          (FACTOR_ROWS, 16, [(0, FACTOR_ROWS)])])
def test_factor_blocks_hold_at_most_factor_positions_loss_positions(n, positions, expected):
    """Windows of tokens: W4's 2,000 × 64 positions in two blocks; a row longer than the budget is a block alone."""
    assert factor_blocks(n, positions) == expected


def test_block_sums_added_on_the_cluster_equal_those_added_here(tmp_path, dask_address, monkeypatch):
    """EK-FAC's factor and correction passes over 10 blocks (FACTOR_ROWS = 64 for 600 rows), added as merge tasks
    on a real LocalCluster and one by one here: the same pairwise tree, so the same bits; and close to the
    library's single pass over all rows (another order of additions). Each counts the backward rows its two passes
    took, 2 × 600, as the stage's work."""
    from distributed import Client

    from influence_core.pipeline.stages import prepare, preconditioner, training
    from influence_core.pipeline.store.loading import load_model, train_batches
    from tests.helpers import small_params

    monkeypatch.setattr(preconditioner, "FACTOR_ROWS", 64)
    params = small_params(str(tmp_path / "run"), dataset={"n_train": 600, "n_test": 8, "chunk_rows": 128}, method={"name": "ekfac", "regularization": 1e-3, "fisher": "sampled"})
    store = params.store()
    data = prepare.run(prepare.PrepareInput(params.dataset, store))
    model = training.run(training.TrainingInput(params.model, params.training, data, store, 1))
    assert len(preconditioner.factor_blocks(data.n_train)) == 10
    job = preconditioner.FactorJob(params.method, model, data, store.options)
    ims = [job.influence_model(), job.influence_model(), params.method.build(load_model(model, store.options), "cross_entropy")]
    here = preconditioner.kronecker_factors(ims[0], job, None)
    with Client(dask_address) as client:
        there = preconditioner.kronecker_factors(ims[1], job, client)
    library = ims[2].fit_factors(train_batches(data, store.options, params.method.batch_size))
    assert [im.work.gradient_rows for im in ims] == [2 * 600] * 3
    assert here.keys() == there.keys() == library.keys() and len(here) == 2
    for block, values in here.items():
        for key, value in values.items():
            assert value.dtype == torch.float64 and torch.equal(value, there[block][key]), f"{block}/{key}"
        torch.testing.assert_close(values["eigenvalues"], library[block]["eigenvalues"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize(("name", "passes"), [("kfac", 1), ("ekfac", 2)])
def test_the_factor_passes_count_their_backward_rows(name, passes):
    """K-FAC's one pass and EK-FAC's two each take one backward row per example and sampled target: 3 samples
    over 50 examples count 150 rows a pass in the work (fit_preconditioner's summary), none when nothing is fitted."""
    from influence_core import EkfacInfluence, KfacInfluence

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    x, y = torch.randn(50, 5), torch.randint(0, 3, (50,))
    im = (EkfacInfluence if name == "ekfac" else KfacInfluence)(model, "cross_entropy", 1e-2, fisher="sampled", fisher_samples=3, batch_size=16)
    assert im.work.gradient_rows == 0
    im.fit((x, y))
    assert im.work.gradient_rows == passes * 3 * 50
