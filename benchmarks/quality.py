"""Counterfactual quality of every curvature method: agreement with Direct, leave-one-out retraining, mislabel detection.

    make quality            (writes benchmarks/results/quality.md and quality.png)

Problems: L2 logistic regression and an MLP on scikit-learn's digits, float64, trained with L-BFGS to a gradient
norm near 1e-10 on the objective mean CE + (wd/2)‖θ‖². λ = wd throughout, so Direct inverts that objective's
Gauss-Newton curvature (for logistic regression, its exact Hessian).

- Agreement: Pearson and Spearman of each method's scores with Direct's.
- Leave-one-out: for 60 training points (the 30 with the largest |score| for the first query, then 30 at random),
  retrain without the point from the optimum to the same tolerance, and correlate the actual change of each query's
  loss with the predicted score/(n−1). Reported: mean Pearson over the queries.
- Mislabels: flip 10% of the training labels, retrain, rank examples by self-influence; ROC AUC of that ranking
  for the flipped ones, and the share of them in the top 10%.
- Small damping (issue 12): EK-FAC and K-FAC at λ = 1e-2 and 1e-3 absolute on Adam-trained models not at an optimum
  (digits 600/40, an MLP 64-32-10 and a small CNN, tanh, float64), against exact Gauss-Newton influence (Direct) on
  the layer-wise matrix that EK-FAC approximates and on the full one. Sampled-Fisher rows: mean (min) over 5 seeds.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import roc_auc_score
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from influence_core import (  # noqa: E402
    ArnoldiInfluence,
    CgInfluence,
    DataInfInfluence,
    DirectInfluence,
    EkfacInfluence,
    IdentityInfluence,
    KfacInfluence,
    LissaInfluence,
    NystroemSketchInfluence,
)
from tests.problems import adam_cnn, adam_mlp, digits, minimise  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WEIGHT_DECAY = 1e-2
N_TRAIN, N_TEST, N_LOO, N_QUERIES = 500, 100, 60, 10


@dataclass
class Setup:
    name: str
    make_model: callable


SETUPS = [
    Setup("logistic regression", lambda: nn.Linear(64, 10).double()),
    Setup("MLP 64-16-10 (tanh)", lambda: nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)).double()),
]


def methods(model: nn.Module, lam: float, top_eigenvalue: float) -> dict[str, object]:
    common = {"second_order_mode": "gauss_newton"}
    return {
        "direct": DirectInfluence(model, "cross_entropy", lam, **common),
        "cg": CgInfluence(model, "cross_entropy", lam, rtol=1e-6, **common),
        "cg + nystroem(50)": CgInfluence(model, "cross_entropy", lam, rtol=1e-6, preconditioner="nystroem", preconditioner_rank=50, **common),
        "lissa (J=1000, B=100)": LissaInfluence(model, "cross_entropy", lam, depth=1000, lissa_batch_size=100, scale=1.2 * (top_eigenvalue + lam), **common),
        "arnoldi (r=50)": ArnoldiInfluence(model, "cross_entropy", lam, rank=50, krylov_dim=100, **common),
        "nystroem (r=50)": NystroemSketchInfluence(model, "cross_entropy", lam, rank=50, **common),
        "datainf (layer-wise)": DataInfInfluence(model, "cross_entropy", lam, block_structure="layer_wise"),
        "identity": IdentityInfluence(model, "cross_entropy"),
    }


def train(setup: Setup, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    torch.manual_seed(0)
    model = setup.make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(200):  # a good start for the non-convex case; L-BFGS then converges tightly
        opt.zero_grad()
        (F.cross_entropy(model(x), y) + 0.5 * WEIGHT_DECAY * sum((p * p).sum() for p in model.parameters())).backward()
        opt.step()
    minimise(model, "cross_entropy", x, y, WEIGHT_DECAY, steps=2000)
    return model


def query_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return F.cross_entropy(model(x), y, reduction="none").numpy()


def leave_one_out(model: nn.Module, x: torch.Tensor, y: torch.Tensor, xq: torch.Tensor, yq: torch.Tensor, removed: np.ndarray) -> np.ndarray:
    """Actual change of each query's loss when each removed point is left out: (len(removed), n_queries)."""
    base = query_losses(model, xq, yq)
    keep = np.ones(len(y), dtype=bool)
    out = []
    for i in removed:
        keep[i] = False
        retrained = copy.deepcopy(model)
        minimise(retrained, "cross_entropy", x[keep], y[keep], WEIGHT_DECAY, steps=2000)
        out.append(query_losses(retrained, xq, yq) - base)
        keep[i] = True
    return np.array(out)


def flip_labels(y: torch.Tensor, share: float, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    flipped = rng.choice(len(y), int(share * len(y)), replace=False)
    noisy = y.clone()
    noisy[flipped] = torch.tensor((y[flipped].numpy() + rng.integers(1, 10, len(flipped))) % 10)
    return noisy, flipped


def top_eigenvalue(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    im = ArnoldiInfluence(model, "cross_entropy", WEIGHT_DECAY, second_order_mode="gauss_newton", rank=1, krylov_dim=30).fit((x, y))
    return float(im.solvers["all"].values[0])


def evaluate(setup: Setup) -> list[dict[str, object]]:
    x, y, xt, yt = digits(N_TRAIN, N_TEST)
    model = train(setup, x, y)
    top = top_eigenvalue(model, x, y)
    xq, yq = xt[:N_QUERIES], yt[:N_QUERIES]

    scores, timings = {}, {}
    for name, im in methods(model, WEIGHT_DECAY, top).items():
        start = time.perf_counter()
        im.fit((x, y))
        fitted = time.perf_counter()
        scores[name] = im.influences(xt, yt, x, y).numpy()
        timings[name] = (fitted - start, time.perf_counter() - fitted)

    rng = np.random.default_rng(0)
    strongest = np.argsort(-np.abs(scores["direct"][0]))[: N_LOO // 2]
    rest = np.setdiff1d(np.arange(N_TRAIN), strongest)
    removed = np.concatenate([strongest, rng.choice(rest, N_LOO - len(strongest), replace=False)])
    actual = leave_one_out(model, x, y, xq, yq, removed)  # (N_LOO, N_QUERIES)
    np.save(RESULTS / f"loo_{setup.name.split()[0].lower()}.npy", np.stack([actual, scores["direct"][:N_QUERIES, removed].T / (N_TRAIN - 1)]))

    noisy, flipped = flip_labels(y, 0.1, seed=1)
    noisy_model = train(setup, x, noisy)
    is_flipped = np.zeros(N_TRAIN, dtype=bool)
    is_flipped[flipped] = True
    rows = []
    for name, im in methods(noisy_model, WEIGHT_DECAY, top_eigenvalue(noisy_model, x, noisy)).items():
        self_inf = im.fit((x, noisy)).self_influences(x, noisy).numpy()
        top10 = np.argsort(-self_inf)[: N_TRAIN // 10]
        predicted = scores[name][:N_QUERIES, removed].T / (N_TRAIN - 1)
        loo = [pearsonr(predicted[:, q], actual[:, q])[0] for q in range(N_QUERIES)]
        rows.append(
            {
                "problem": setup.name,
                "method": name,
                "pearson": pearsonr(scores[name].ravel(), scores["direct"].ravel())[0],
                "spearman": spearmanr(scores[name].ravel(), scores["direct"].ravel())[0],
                "loo": float(np.mean(loo)),
                "auc": roc_auc_score(is_flipped, self_inf),
                "top10": float(is_flipped[top10].mean() * len(top10) / len(flipped)),
                "fit_s": timings[name][0],
                "score_s": timings[name][1],
            }
        )
        print(rows[-1], flush=True)
    return rows


SMALL_DAMPING = {
    "ekfac (default: exact Fisher)": (EkfacInfluence, {}),
    "ekfac, sampled Fisher": (EkfacInfluence, {"fisher": "sampled"}),
    "ekfac, sampled Fisher, 16 samples": (EkfacInfluence, {"fisher": "sampled", "fisher_samples": 16}),
    "kfac (default: exact Fisher)": (KfacInfluence, {}),
    "kfac, sampled Fisher": (KfacInfluence, {"fisher": "sampled"}),
}


def small_damping() -> list[dict[str, object]]:
    """EK-FAC/K-FAC against exact layer-wise and full Gauss-Newton influence at λ = 1e-2 and 1e-3."""
    rows = []
    for problem in (adam_mlp(), adam_cnn()):
        x, y = problem.train
        for lam in (1e-2, 1e-3):
            refs = {blocks: DirectInfluence(problem.model, "cross_entropy", lam, second_order_mode="gauss_newton", block_structure=blocks).fit((x, y)).influences(problem.x_test, problem.y_test, x, y).numpy() for blocks in ("layer_wise", "full")}
            for name, (cls, options) in SMALL_DAMPING.items():
                seeds = range(5) if options.get("fisher") == "sampled" else range(1)
                got, start = {"layer_wise": [], "full": []}, time.perf_counter()
                for seed in seeds:
                    s = cls(problem.model, "cross_entropy", lam, seed=seed, **options).fit((x, y)).influences(problem.x_test, problem.y_test, x, y).numpy()
                    for blocks, ref in refs.items():
                        got[blocks].append(pearsonr(s.ravel(), ref.ravel())[0])
                rows.append({"problem": problem.name, "lam": lam, "method": name, "layer_wise": got["layer_wise"], "full": got["full"], "seconds": (time.perf_counter() - start) / len(seeds)})
                print(rows[-1], flush=True)
    return rows


def small_damping_markdown(rows: list[dict[str, object]]) -> str:
    def cell(values: list[float]) -> str:
        return f"{np.mean(values):.3f}" + (f" ({np.min(values):.3f})" if len(values) > 1 else "")

    lines = ["| problem | λ | method | Pearson vs layer-wise GN | Pearson vs full GN | fit + score s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['problem']} | {r['lam']:g} | {r['method']} | {cell(r['layer_wise'])} | {cell(r['full'])} | {r['seconds']:.1f} |" for r in rows]
    return "\n".join(lines)


def markdown(rows: list[dict[str, object]]) -> str:
    lines = [
        "| problem | method | Pearson vs Direct | Spearman vs Direct | LOO Pearson | mislabel AUC | flipped in top 10% | fit s | score s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['problem']} | {r['method']} | {r['pearson']:.4f} | {r['spearman']:.4f} | {r['loo']:.3f} | {r['auc']:.3f} | {r['top10']:.0%} | {r['fit_s']:.2f} | {r['score_s']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, object]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, setup in zip(axes[:2], SETUPS):
        actual, predicted = np.load(RESULTS / f"loo_{setup.name.split()[0].lower()}.npy")
        ax.scatter(predicted.ravel(), actual.ravel(), s=6, alpha=0.6)
        lim = np.abs(np.concatenate([actual.ravel(), predicted.ravel()])).max() * 1.05
        ax.plot([-lim, lim], [-lim, lim], "k--", linewidth=0.7)
        ax.set_title(f"{setup.name}: Direct vs leave-one-out", fontsize=9)
        ax.set_xlabel("predicted Δ query loss (score / (n−1))")
        ax.set_ylabel("actual Δ query loss after retraining")
    names = [r["method"] for r in rows if r["problem"] == SETUPS[0].name]
    width = 0.38
    for j, setup in enumerate(SETUPS):
        values = [r["loo"] for r in rows if r["problem"] == setup.name]
        axes[2].bar(np.arange(len(names)) + (j - 0.5) * width, values, width, label=setup.name)
    axes[2].set_xticks(np.arange(len(names)), names, rotation=60, ha="right", fontsize=7)
    axes[2].set_ylabel("mean LOO Pearson over queries")
    axes[2].axhline(0.95, color="k", linewidth=0.7, linestyle="--")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "quality.png", dpi=110)


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    torch.set_default_dtype(torch.float64)
    rows = [row for setup in SETUPS for row in evaluate(setup)]
    table, damping = markdown(rows), small_damping_markdown(small_damping())
    header = (__doc__ or "").split("\n\n", 2)[2]
    (RESULTS / "quality.md").write_text(
        f"# Influence quality\n\n{header}\n\nn_train={N_TRAIN}, n_test={N_TEST}, {N_LOO} leave-one-out retrainings, {N_QUERIES} queries, λ = weight decay = {WEIGHT_DECAY}.\n\n{table}\n\n"
        f"![quality](quality.png)\n\n## EK-FAC and K-FAC at small damping\n\n{damping}\n"
    )
    plot(rows)
    print(table, damping, sep="\n\n")


if __name__ == "__main__":
    main()
