"""The built-in tasks and the Fisher targets against independent references in float64: per-example gradients
from an explicit backward loop over hand-written losses, output Hessians from torch.func.hessian, an explicit
Gauss-Newton matrix for the language-modelling task's scores."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev

from influence_core import CgInfluence, DirectInfluence, EkfacInfluence
from influence_core.contraction import GradientSplit, gradient_batch, materialise
from influence_core.errors import ConfigError
from influence_core.layers import capture, fisher_cotangents, select_layers
from influence_core.noise import ExampleNoise
from influence_core.objective import Objective
from influence_core.task import IGNORE_INDEX, Classification, LanguageModelling, LossTask, Regression, mask_prompt
from influence_core.task.base import lanczos_sqrt
from influence_core.work import Work

VOCAB, LENGTH = 6, 4


class TinyCausalLM(nn.Module):
    """Embedding, LayerNorm, a causal mean over earlier positions, two Linear layers: (B, T) ids → (B, T, V)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 5, hidden: int = 7, transpose: bool = False) -> None:
        super().__init__()
        self.embed, self.norm = nn.Embedding(vocab, dim), nn.LayerNorm(dim)
        self.mix, self.head = nn.Linear(dim, hidden), nn.Linear(hidden, vocab)
        self.transpose = transpose

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(ids))
        h = h.cumsum(1) / torch.arange(1, ids.shape[1] + 1, dtype=h.dtype)[:, None]
        logits = self.head(torch.tanh(self.mix(h)))
        return logits.transpose(1, 2) if self.transpose else logits


def tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and their labels, the last one or two tokens of some sequences padded (IGNORE_INDEX)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    labels = ids.clone()
    labels[::3, -1] = IGNORE_INDEX
    labels[1::4, -2:] = IGNORE_INDEX
    return ids, labels


# -- hand-written per-example losses, the independent references ---------------------------------------------------
def ce(logits: torch.Tensor, label: int) -> torch.Tensor:
    return -torch.log_softmax(logits, -1)[label]


def lm_loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Σ_t −log p(y_{t+1} | f_t) over the scored labels of one sequence."""
    return sum((ce(out[t], int(labels[t + 1])) for t in range(len(labels) - 1) if labels[t + 1] != IGNORE_INDEX), 0 * out.sum())


def token_ce(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean over scored positions of −log p(y_t | f_t) (token classification)."""
    scored = [t for t in range(len(labels)) if labels[t] != IGNORE_INDEX]
    return sum((ce(out[t], int(labels[t])) for t in scored), 0 * out.sum()) / max(1, len(scored))


def negative_margin(out: torch.Tensor, label: int) -> torch.Tensor:
    others = torch.stack([out[c] for c in range(len(out)) if c != label])
    return -(out[label] - torch.logsumexp(others, 0))


def squared(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out.reshape(-1) - target.reshape(-1)) ** 2).mean()


def loop_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, per_example) -> torch.Tensor:  # type: ignore[no-untyped-def]
    rows = []
    for i in range(len(x)):
        params = [p for p in model.parameters() if p.requires_grad]
        value = per_example(model(x[i : i + 1])[0], y[i])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(value, params)]))
    return torch.stack(rows)


def mlp(outputs: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, outputs)).double()


class TokenTagger(nn.Module):
    """(B, T, 4) features → (B, T, C) logits, for token classification."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def cases() -> list:
    torch.manual_seed(2)
    x = torch.randn(7, 4, dtype=torch.float64)
    labels = torch.randint(0, 3, (7,))
    seq = torch.randn(7, 3, 4, dtype=torch.float64)
    tags = torch.randint(0, 3, (7, 3))
    tags[::2, 0] = IGNORE_INDEX
    ids, lm_labels = tokens(7, 0)
    return [
        ("classification", mlp(3), Classification(), x, labels, lambda o, t: ce(o, int(t)), False),
        ("margin", mlp(3), Classification("margin"), x, labels, lambda o, t: negative_margin(o, int(t)), True),
        ("token classification", TokenTagger().double(), Classification(), seq, tags, token_ce, False),
        ("regression", mlp(2), Regression(), x, torch.randn(7, 2, dtype=torch.float64), squared, False),
        ("language modelling", TinyCausalLM().double(), LanguageModelling(), ids, lm_labels, lm_loss, False),
        ("completion", TinyCausalLM().double(), LanguageModelling(), ids, mask_prompt(lm_labels, torch.tensor([1, 2, 3, 2, 1, 2, 3])), lm_loss, True),
    ]


@pytest.mark.parametrize("case", cases(), ids=lambda c: c[0])
def test_task_gradients_match_explicit_per_example_gradients(case):
    """Captured (Linear) and vmap (Embedding, LayerNorm) gradients of the loss, or of the measurement for queries,
    equal a backward loop over hand-written per-example losses (rtol 1e-10)."""
    _, model, task, x, y, reference, measured = case
    expected = loop_gradients(model, x, y, reference)
    objective = Objective(model, task)
    split = GradientSplit(objective, (x, y))
    assert split.cuts, "the Linear layers are contracted"
    batch = gradient_batch(split, x, y, Work(), measure=measured)
    contracted = materialise(batch, split, "parameters", objective.space.dim)
    torch.testing.assert_close(contracted, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(objective.per_sample_grads(x, y, measure=measured), expected, rtol=1e-10, atol=1e-12)


def output_hessians(outputs: torch.Tensor, y: torch.Tensor, per_example) -> torch.Tensor:  # type: ignore[no-untyped-def]
    c = outputs[0].numel()
    return torch.stack([hessian(lambda o: per_example(o.reshape(outputs.shape[1:]), y[i]))(outputs[i].reshape(-1)).reshape(c, c) for i in range(len(outputs))])


def outer_sums(columns: list[torch.Tensor]) -> torch.Tensor:
    flat = torch.stack([c.reshape(len(c), -1) for c in columns], 1)  # (B, columns, c)
    return torch.einsum("bki,bkj->bij", flat, flat)


@pytest.mark.parametrize("case", [c for c in cases() if not c[-1]], ids=lambda c: c[0])
def test_exact_fisher_columns_square_to_the_output_hessian(case):
    """Σ_k L_k L_kᵀ equals torch.func.hessian of the hand-written per-example loss, for the built-ins' closed forms
    and for the same loss given as a callable (the generic eigen square root)."""
    _, model, task, x, y, reference, _ = case
    with torch.no_grad():
        out = task.output(model(x))
    expected = output_hessians(out, y, reference)
    torch.testing.assert_close(outer_sums(task.exact_fisher(out, y)), expected, rtol=1e-10, atol=1e-12)
    generic = LossTask(lambda o, t: task.mean_loss(o, t))
    torch.testing.assert_close(outer_sums(generic.exact_fisher(out, y)), expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("case", [c for c in cases() if not c[-1]], ids=lambda c: c[0])
def test_sampled_fisher_averages_to_the_output_hessian(case):
    """The mean of v vᵀ over 5,000 draws per example is the output Hessian, within Monte Carlo error (measured: at
    most 0.046 of its largest entry; a wrong sampler is off by O(1)); the built-ins' closed-form samplers and the
    Lanczos sampler of a callable loss alike."""
    _, model, task, x, y, reference, _ = case
    with torch.no_grad():
        out = task.output(model(x[:3]))
    expected = output_hessians(out, y[:3], reference)
    for sampler in (task, LossTask(lambda o, t: task.mean_loss(o, t))):
        estimate = outer_sums(sampler.sampled_fisher(out, y[:3], ExampleNoise(0), 0, 5000))
        scale = expected.abs().amax(dim=(1, 2), keepdim=True)
        assert float(((estimate - expected).abs() / scale).max()) < 0.08
        assert float(((estimate - expected).abs() / scale).max()) > 0  # a Monte Carlo estimate, not the closed form


def test_sampled_fisher_draws_per_example_and_position_whatever_the_batching():
    """Identical sequences get different draws at every position (no example reuses another's), and an example's
    draws are the same in any batch (noise tied to its index)."""
    task, ids = LanguageModelling(), torch.zeros(4, 9, dtype=torch.long)
    out = torch.zeros(4, 9, 50, dtype=torch.float64)  # uniform predictions: the draw is the uniform's inverse CDF
    whole = task.sampled_fisher(out, ids, ExampleNoise(3), 0, 1)[0]
    drawn = (whole < 0).to(torch.int64).argmax(-1)[:, :-1]  # the label drawn: its cotangent p − 1 is negative
    assert len({tuple(row.tolist()) for row in drawn}) == 4 and all(len(set(row.tolist())) > 1 for row in drawn)
    assert torch.equal(task.sampled_fisher(out[2:], ids[2:], ExampleNoise(3), 2, 1)[0], whole[2:])


def test_lanczos_square_root_is_exact_within_its_steps():
    """H^(1/2) z by Lanczos equals the eigendecomposition's once the steps reach the dimension (float64)."""
    torch.manual_seed(4)
    factors = torch.randn(5, 12, 12, dtype=torch.float64)
    h = factors @ factors.transpose(1, 2) + 0.1 * torch.eye(12, dtype=torch.float64)
    z = torch.randn(5, 12, dtype=torch.float64)
    values, vectors = torch.linalg.eigh(h)
    expected = torch.einsum("bij,bj->bi", vectors * values.clamp_min(0).sqrt()[:, None, :], torch.einsum("bji,bj->bi", vectors, z))
    got = lanczos_sqrt(lambda v: torch.einsum("bij,bj->bi", h, v), z, 12)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_auto_fisher_samples_past_the_pass_bound_for_callable_losses_too():
    """'auto' takes one backward pass per draw once the exact Fisher would take > 64 per example: the built-in LM
    task at (T-1)·V = 3·50 and the same loss as a callable; below the bound, one pass per column."""
    big = TinyCausalLM(vocab=50).double()
    ids = torch.randint(0, 50, (3, LENGTH))
    layers = select_layers(big)
    for task in (LanguageModelling(), LossTask(lambda o, t: LanguageModelling().mean_loss(o, t))):
        cap = capture(big, layers, task, ids, ids, "auto", ExampleNoise(0), 0, 2)
        assert len(cap.g["head"]) == 2
    small, ids = TinyCausalLM().double(), tokens(3, 1)[0]
    cap = capture(small, select_layers(small), LanguageModelling(), ids, ids, "auto", ExampleNoise(0), 0, 2)
    assert len(cap.g["head"]) == (LENGTH - 1) * VOCAB


@pytest.mark.parametrize("task", [LanguageModelling(), Classification()], ids=["language_modelling", "classification"])
def test_vocabulary_in_dimension_one_is_refused(task):
    """(B, V, T) logits, which F.cross_entropy would accept, are refused naming the layout, before any work."""
    model = TinyCausalLM(transpose=True).double()
    ids, labels = tokens(8, 0)
    with pytest.raises(ConfigError, match=r"^model: model outputs of shape \(8, 6, 4\) put the (vocabulary|classes) in dimension 1.*Fix: emit"):
        EkfacInfluence(model, task, 1e-3).fit((ids, labels))
    with torch.no_grad():
        out = model(ids)
    with pytest.raises(ConfigError, match="dimension 1"):
        fisher_cotangents(task, out, labels, "sampled", ExampleNoise(0), 0, 1)


class BatchLoss(LanguageModelling):
    """The batch's mean loss (or, with `of="measurement"`, measurement) where the Task promises one per example."""

    def __init__(self, of: str) -> None:
        super().__init__()
        self.of = of

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        per_example = super().loss(outputs, targets)
        return per_example.mean() if self.of == "loss" else per_example

    def measurement(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        per_example = super().measurement(outputs, targets)
        return per_example.mean() if self.of == "measurement" else per_example


@pytest.mark.parametrize("of", ["loss", "measurement"])
def test_a_task_with_one_value_per_batch_is_refused(of):
    """Issue 35, item 2: a loss or measurement of (,) for a batch, which would scale the scores by 1/n, is refused on
    the probe batch before any work, naming the task."""
    ids, labels = tokens(8, 0)
    with pytest.raises(ConfigError, match=rf"^task: its {of} returned shape \(\) for a batch of 8 examples, not one value per example \(8,\)\. Fix: return the per-example {of}s"):
        DirectInfluence(TinyCausalLM().double(), BatchLoss(of), 1e-3).fit((ids, labels))
    DirectInfluence(TinyCausalLM().double(), LanguageModelling(), 1e-3).fit((ids, labels))  # one value per example: fitted


def explicit_scores(model: nn.Module, train: tuple, queries: tuple, lam: float) -> torch.Tensor:
    """∇m(query)ᵀ (G + λI)⁻¹ ∇ℓ(train) with G = (1/n) Σ_i J_iᵀ ∇²ℓ_i J_i formed from explicit Jacobians and Hessians."""
    names = [n for n, p in model.named_parameters()]
    params = {n: p.detach() for n, p in model.named_parameters()}
    x, y = train
    gauss_newton = 0
    for i in range(len(x)):
        def out_of(p: dict) -> torch.Tensor:
            return functional_call(model, p, (x[i : i + 1],))[0]
        jac = jacrev(out_of)(params)
        jac = torch.cat([jac[n].reshape(LENGTH * VOCAB, -1) for n in names], 1)
        out = out_of(params)
        h = hessian(lambda o: lm_loss(o.reshape(LENGTH, VOCAB), y[i]))(out.reshape(-1))
        gauss_newton = gauss_newton + jac.T @ h @ jac / len(x)
    train_grads = loop_gradients(model, x, y, lm_loss)
    query_grads = loop_gradients(model, *queries, lm_loss)
    system = gauss_newton + lam * torch.eye(len(gauss_newton), dtype=torch.float64)
    return query_grads @ torch.linalg.solve(system, train_grads.T)


def test_language_model_scores_equal_explicit_gauss_newton_reference():
    """Direct (Gauss-Newton) and CG scores of completions (prompt masked) on a tiny causal LM equal the explicit
    float64 reference; EK-FAC with the exact Fisher and with the same loss as a callable agree with each other."""
    torch.manual_seed(5)
    model = TinyCausalLM().double()
    train = tokens(10, 1)
    ids, labels = tokens(3, 2)
    queries = (ids, mask_prompt(labels, torch.tensor([2, 1, 2])))
    expected = explicit_scores(model, train, queries, 0.1)
    direct = DirectInfluence(model, "language_modelling", 0.1, second_order_mode="gauss_newton").fit(train)
    torch.testing.assert_close(direct.influences(*queries, *train), expected, rtol=1e-9, atol=1e-12)
    cg = CgInfluence(model, LanguageModelling(), 0.1, second_order_mode="gauss_newton", rtol=1e-12).fit(train)
    torch.testing.assert_close(cg.influences(*queries, *train), expected, rtol=1e-6, atol=1e-9)
    builtin = EkfacInfluence(model, LanguageModelling(), 0.1, fisher="exact").fit(train).influences(*queries, *train)
    callable_loss = EkfacInfluence(model, lambda o, t: LanguageModelling().mean_loss(o, t), 0.1, fisher="exact").fit(train)
    torch.testing.assert_close(callable_loss.influences(*queries, *train), builtin, rtol=1e-8, atol=1e-11)
