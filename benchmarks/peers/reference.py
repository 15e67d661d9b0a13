"""Exact float64 influence for the agreement columns, written with torch.func alone (independent of influence_core).

    .venv/bin/python benchmarks/peers/reference.py --workload DIR --matrix hessian --solver direct --queries 359 --out R.npy

Scores +∇ℓ_testᵀ (C + λI)⁻¹ ∇ℓ_train for the first `--queries` queries against every training example, with C
the curvature of the mean training cross-entropy at the trained parameters:
- `hessian`: the Hessian; `ggn`: the generalised Gauss-Newton Jᵀ H_ℓ J (softmax Hessian H_ℓ = diag(π) − ππᵀ);
  `ef`: the empirical Fisher (1/n) Σ ∇ℓ_i ∇ℓ_iᵀ with the true labels (pyDVL 0.10's "gauss_newton").
- `direct`: C formed explicitly (p Hessian columns, or Jacobian products) and solved by Cholesky (p ≲ 5,000);
  `cg`: matrix-free vectorised CG in float64 to `--rtol` (default 1e-10) on every right-hand side;
  `woodbury` (ef only): (GᵀG/n + λI)⁻¹ g = (g − Gᵀ (nλI + GGᵀ)⁻¹ G g) / λ with the n×n kernel, exact.
Prints one JSON line (seconds, iterations, worst relative residual) and saves the (queries, n_train) scores.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, jvp, vjp, vmap

from common import Workload, load_workload

CHUNK = 1000  # training rows per curvature product or gradient block


class Flat:
    """The model as a function of one flat float64 parameter vector."""

    def __init__(self, w: Workload) -> None:
        self.model = w.model.double()
        self.names = [n for n, _ in self.model.named_parameters()]
        self.shapes = [p.shape for _, p in self.model.named_parameters()]
        self.theta = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        self.x, self.y = w.x_train.double(), w.y_train
        self.n = len(self.y)

    def params(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        sizes = [int(np.prod(s)) for s in self.shapes]
        return {k: t.reshape(s) for k, t, s in zip(self.names, torch.split(theta, sizes), self.shapes)}

    def logits(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, self.params(theta), (x,))

    def mean_loss(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(theta, x), y)

    def grads(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-example gradients (n, p) of each example's own loss."""
        one = vmap(grad(lambda t, xi, yi: self.mean_loss(t, xi[None], yi[None])), in_dims=(None, 0, 0))
        return torch.cat([one(self.theta, x[lo : lo + CHUNK], y[lo : lo + CHUNK]) for lo in range(0, len(y), CHUNK)])

    def chunks(self):  # type: ignore[no-untyped-def]
        for lo in range(0, self.n, CHUNK):
            yield self.x[lo : lo + CHUNK], self.y[lo : lo + CHUNK]

    def hessian_matmat(self, v: torch.Tensor) -> torch.Tensor:
        """Rows of v times the Hessian of the mean loss (reverse over reverse, chunks weighted by size)."""
        out = torch.zeros_like(v)
        for x, y in self.chunks():
            _, pull = vjp(lambda t: grad(self.mean_loss)(t, x, y), self.theta)
            out += len(y) / self.n * vmap(lambda u: pull(u)[0])(v)
        return out

    def ggn_matmat(self, v: torch.Tensor) -> torch.Tensor:
        """Rows of v times Jᵀ H_ℓ J / n, H_ℓ the softmax cross-entropy Hessian of each example."""
        out = torch.zeros_like(v)
        for x, y in self.chunks():
            f = lambda t: self.logits(t, x)  # noqa: E731
            logits, pull = vjp(f, self.theta)
            prob = torch.softmax(logits.detach(), dim=-1)

            def single(u: torch.Tensor) -> torch.Tensor:
                ju = jvp(f, (self.theta,), (u,))[1]
                hju = prob * ju - prob * (prob * ju).sum(-1, keepdim=True)
                return pull(hju)[0]

            out += vmap(single)(v) / self.n
        return out

    def ef_matmat(self, v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(v)
        for x, y in self.chunks():
            g = self.grads(x, y)
            out += (v @ g.T) @ g / self.n
        return out


def cg(matmat: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, rtol: float, maxiter: int) -> tuple[torch.Tensor, int, float]:
    """Plain vectorised CG, one independent run per row of b, until every ‖r‖ ≤ rtol·‖b‖."""
    x = torch.zeros_like(b)
    r = b.clone()
    d = r.clone()
    rr = (r * r).sum(1)
    target = rtol * b.norm(dim=1)
    it = 0
    while bool((r.norm(dim=1) > target).any()) and it < maxiter:
        it += 1
        ad = matmat(d)
        alpha = rr / (d * ad).sum(1)
        x += alpha[:, None] * d
        r -= alpha[:, None] * ad
        rr_new = (r * r).sum(1)
        d = r + (rr_new / rr)[:, None] * d
        rr = rr_new
    return x, it, float((r.norm(dim=1) / b.norm(dim=1)).max())


def solve(flat: Flat, matrix: str, solver: str, lam: float, g_test: torch.Tensor, rtol: float, maxiter: int) -> tuple[torch.Tensor, dict]:
    """(C + λI)⁻¹ g for each row of g_test, and what the solve did."""
    matmat = {"hessian": flat.hessian_matmat, "ggn": flat.ggn_matmat, "ef": flat.ef_matmat}[matrix]
    p = flat.theta.numel()
    if solver == "direct":
        c = matmat(torch.eye(p, dtype=torch.float64))
        c = (c + c.T) / 2 + lam * torch.eye(p, dtype=torch.float64)
        smallest = float(torch.linalg.eigvalsh(c)[0])
        factor = torch.linalg.cholesky(c)
        return torch.cholesky_solve(g_test.T, factor).T, {"smallest_eigenvalue_with_lambda": smallest}
    if solver == "woodbury":
        if matrix != "ef":
            raise SystemExit("woodbury is exact for the empirical Fisher only")
        g = flat.grads(flat.x, flat.y)
        kernel = g @ g.T + flat.n * lam * torch.eye(flat.n, dtype=torch.float64)
        inner = torch.linalg.solve(kernel, g @ g_test.T)
        return (g_test - (g.T @ inner).T) / lam, {}
    x, it, residual = cg(lambda v: matmat(v) + lam * v, g_test, rtol, maxiter)
    return x, {"iterations": it, "max_relative_residual": residual, "rtol": rtol}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True)
    p.add_argument("--matrix", choices=["hessian", "ggn", "ef"], required=True)
    p.add_argument("--solver", choices=["direct", "cg", "woodbury"], required=True)
    p.add_argument("--queries", type=int, required=True, help="score the first this many queries")
    p.add_argument("--regularization", type=float, required=True, help="λ")
    p.add_argument("--rtol", type=float, default=1e-10)
    p.add_argument("--maxiter", type=int, default=5000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    w = load_workload(a.workload)
    lam = a.regularization
    start = time.perf_counter()
    flat = Flat(w)
    xq, yq = w.x_test[: a.queries].double(), w.y_test[: a.queries]
    g_test = flat.grads(xq, yq)
    factors, info = solve(flat, a.matrix, a.solver, lam, g_test, a.rtol, a.maxiter)
    scores = torch.cat([factors @ flat.grads(x, y).T for x, y in flat.chunks()], dim=1)
    np.save(a.out, scores.numpy())
    print(json.dumps({"matrix": a.matrix, "solver": a.solver, "queries": a.queries, "regularization": lam, "seconds": time.perf_counter() - start, **info}))


if __name__ == "__main__":
    main()
