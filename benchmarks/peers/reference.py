"""Exact float64 influence for the agreement columns, written with torch.func alone (independent of influence_core).

    .venv/bin/python benchmarks/peers/reference.py --workload DIR --matrix hessian --solver direct --queries 359 --out R.npy

Scores +∇ℓ_testᵀ (C + λI)⁻¹ ∇ℓ_train for the first `--queries` queries against every training example, with C
the curvature of the mean training cross-entropy at the trained parameters (W4: of the mean over windows of the
summed next-token cross-entropy, restricted to the parameters of the nn.Linear layers, which EK-FAC tracks on both
sides; the embeddings and norms are held fixed):
- `hessian`: the Hessian; `ggn`: the generalised Gauss-Newton Jᵀ H_ℓ J (softmax Hessian H_ℓ = diag(π) − ππᵀ);
  `ef`: the empirical Fisher (1/n) Σ ∇ℓ_i ∇ℓ_iᵀ with the true labels (pyDVL 0.10's "gauss_newton").
- `direct`: C formed explicitly (p Hessian columns, or Jacobian products) and solved by Cholesky (p ≲ 5,000);
  `cg`: matrix-free vectorised CG in float64 to `--rtol` (default 1e-10) on every right-hand side;
  `woodbury` (ef only): (GᵀG/n + λI)⁻¹ g = (g − Gᵀ (nλI + GGᵀ)⁻¹ G g) / λ with the n×n kernel, exact.
- `block-cg` (W4, where plain CG would take hours): this project's block CG with a Nyström preconditioner
  (`influence_core.CgInfluence`, float64, on `--device`), so not independent of the code under test; its answer is
  then checked here: the relative residual ‖(C + λI)x − g‖/‖g‖ is computed with this file's own C product.
Prints one JSON line (seconds, iterations, worst relative residual) and saves the (queries, n_train) scores.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.func import functional_call, grad, jvp, vjp, vmap

from common import Workload, example_losses, is_language_model, load_workload


def tracked_names(w: Workload) -> list[str]:
    """The parameters solved for: every one, or (W4) those of the nn.Linear layers, as EK-FAC tracks them."""
    if not is_language_model(w.spec):
        return [n for n, _ in w.model.named_parameters()]
    return [f"{m}.{p}" for m, module in w.model.named_modules() if isinstance(module, torch.nn.Linear) for p, _ in module.named_parameters()]


class Flat:
    """The model as a function of one flat float64 vector of its tracked parameters (the others held fixed)."""

    def __init__(self, w: Workload, device: str, chunk: int | None = None) -> None:
        self.spec = w.spec
        self.chunk = chunk or (50 if is_language_model(w.spec) else 1000)  # training rows per curvature product or gradient block
        self.model = w.model.double().to(device)
        tracked = set(tracked_names(w))
        named = dict(self.model.named_parameters())
        self.fixed = {n: p.detach() for n, p in named.items() if n not in tracked}
        self.names = [n for n in named if n in tracked]
        self.shapes = [named[n].shape for n in self.names]
        self.theta = torch.cat([named[n].detach().reshape(-1) for n in self.names])
        self.x, self.y = self.inputs(w.x_train), w.y_train.to(device)
        self.n = len(self.y)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Features in float64 (token ids stay integers), on the model's device."""
        return (x if is_language_model(self.spec) else x.double()).to(self.theta.device)

    def params(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        sizes = [int(np.prod(s)) for s in self.shapes]
        return {**self.fixed, **{k: t.reshape(s) for k, t, s in zip(self.names, torch.split(theta, sizes), self.shapes)}}

    def logits(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, self.params(theta), (x,))

    def mean_loss(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return example_losses(self.spec, self.logits(theta, x), y).mean()

    def grads(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-example gradients (n, p) of each example's own loss."""
        one = vmap(grad(lambda t, xi, yi: self.mean_loss(t, xi[None], yi[None])), in_dims=(None, 0, 0))
        return torch.cat([one(self.theta, x[lo : lo + self.chunk], y[lo : lo + self.chunk]) for lo in range(0, len(y), self.chunk)])

    def chunks(self):  # type: ignore[no-untyped-def]
        for lo in range(0, self.n, self.chunk):
            yield self.x[lo : lo + self.chunk], self.y[lo : lo + self.chunk]

    def hessian_matmat(self, v: torch.Tensor) -> torch.Tensor:
        """Rows of v times the Hessian of the mean loss (reverse over reverse, chunks weighted by size)."""
        out = torch.zeros_like(v)
        for x, y in self.chunks():
            _, pull = vjp(lambda t: grad(self.mean_loss)(t, x, y), self.theta)
            out += len(y) / self.n * vmap(lambda u: pull(u)[0])(v)
        return out

    def ggn_matmat(self, v: torch.Tensor) -> torch.Tensor:
        """Rows of v times Jᵀ H_ℓ J / n, H_ℓ the softmax cross-entropy Hessian of each example (W4: of each position
        that predicts a token; the last position predicts none)."""
        out = torch.zeros_like(v)
        for x, y in self.chunks():
            f = lambda t: self.logits(t, x)  # noqa: E731
            logits, pull = vjp(f, self.theta)
            prob = torch.softmax(logits.detach(), dim=-1)
            if is_language_model(self.spec):
                prob[:, -1] = 0.0

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


def cg(matmat: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, rtol: float, maxiter: int, seconds: float) -> tuple[torch.Tensor, int, float]:
    """Plain vectorised CG, one independent run per row of b, until every ‖r‖ ≤ rtol·‖b‖ (or maxiter iterations,
    or `seconds` have passed: the worst relative residual reached is reported either way)."""
    deadline = time.perf_counter() + seconds
    x = torch.zeros_like(b)
    r = b.clone()
    d = r.clone()
    rr = (r * r).sum(1)
    target = rtol * b.norm(dim=1)
    it = 0
    while bool((r.norm(dim=1) > target).any()) and it < maxiter and time.perf_counter() < deadline:
        it += 1
        ad = matmat(d)
        alpha = rr / (d * ad).sum(1)
        x += alpha[:, None] * d
        r -= alpha[:, None] * ad
        rr_new = (r * r).sum(1)
        d = r + (rr_new / rr)[:, None] * d
        rr = rr_new
    return x, it, float((r.norm(dim=1) / b.norm(dim=1)).max())


def solve(flat: Flat, matrix: str, solver: str, lam: float, g_test: torch.Tensor, rtol: float, maxiter: int, seconds: float) -> tuple[torch.Tensor, dict]:
    """(C + λI)⁻¹ g for each row of g_test, and what the solve did."""
    matmat = {"hessian": flat.hessian_matmat, "ggn": flat.ggn_matmat, "ef": flat.ef_matmat}[matrix]
    p = flat.theta.numel()
    if solver == "direct":
        eye = torch.eye(p, dtype=torch.float64, device=g_test.device)
        c = matmat(eye)
        c = (c + c.T) / 2 + lam * eye
        smallest = float(torch.linalg.eigvalsh(c)[0])
        factor = torch.linalg.cholesky(c)
        return torch.cholesky_solve(g_test.T, factor).T, {"smallest_eigenvalue_with_lambda": smallest}
    if solver == "woodbury":
        if matrix != "ef":
            raise SystemExit("woodbury is exact for the empirical Fisher only")
        g = flat.grads(flat.x, flat.y)
        kernel = g @ g.T + flat.n * lam * torch.eye(flat.n, dtype=torch.float64, device=g.device)
        inner = torch.linalg.solve(kernel, g @ g_test.T)
        return (g_test - (g.T @ inner).T) / lam, {}
    x, it, residual = cg(lambda v: matmat(v) + lam * v, g_test, rtol, maxiter, seconds)
    return x, {"iterations": it, "max_relative_residual": residual, "rtol": rtol}


def library_block_cg(flat: Flat, xq: torch.Tensor, yq: torch.Tensor, g_test: torch.Tensor, lam: float, rtol: float) -> tuple[torch.Tensor, dict]:
    """(C + λI)⁻¹ g_test (GGN) by influence_core's block CG, Nyström-preconditioned (rank 200), on the tracked
    parameters, and the worst relative residual of its answer under this file's independent product."""
    from influence_core import CgInfluence

    modules = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in flat.names))  # the model's order: the library's columns are then this file's
    task = "language_modelling" if is_language_model(flat.spec) else "cross_entropy"
    im = CgInfluence(flat.model, task, lam, second_order_mode="gauss_newton", modules=modules, rtol=rtol, preconditioner="nystroem",
                     preconditioner_rank=200, batch_size=flat.chunk, maxiter=5000)
    im.fit((flat.x, flat.y))
    factors = im.influence_factors(xq, yq)
    residual = (flat.ggn_matmat(factors) + lam * factors - g_test).norm(dim=1) / g_test.norm(dim=1)
    last = next(iter(im.solvers.values())).last_solve
    return factors, {"iterations": last.iterations, "library_relative_residual": last.max_relative_residual, "max_relative_residual": float(residual.max()), "rtol": rtol}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True)
    p.add_argument("--matrix", choices=["hessian", "ggn", "ef"], required=True)
    p.add_argument("--solver", choices=["direct", "cg", "woodbury", "block-cg"], required=True)
    p.add_argument("--queries", type=int, required=True, help="score the first this many queries")
    p.add_argument("--regularization", type=float, required=True, help="λ")
    p.add_argument("--rtol", type=float, default=1e-10)
    p.add_argument("--maxiter", type=int, default=5000)
    p.add_argument("--max-seconds", type=float, default=float("inf"), help="stop CG after this long, reporting the residual reached")
    p.add_argument("--chunk", type=int, default=None, help="training rows per product (default 1000; W4 50)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="where to compute (cuda: W4's reference on a GPU)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    w = load_workload(a.workload)
    lam = a.regularization
    start = time.perf_counter()
    flat = Flat(w, a.device, a.chunk)
    xq, yq = flat.inputs(w.x_test[: a.queries]), w.y_test[: a.queries].to(a.device)
    g_test = flat.grads(xq, yq)
    if a.solver == "block-cg":
        factors, info = library_block_cg(flat, xq, yq, g_test, lam, a.rtol)
    else:
        factors, info = solve(flat, a.matrix, a.solver, lam, g_test, a.rtol, a.maxiter, a.max_seconds)
    scores = torch.cat([factors @ flat.grads(x, y).T for x, y in flat.chunks()], dim=1)
    np.save(a.out, scores.cpu().numpy())
    print(json.dumps({"matrix": a.matrix, "solver": a.solver, "queries": a.queries, "regularization": lam, "seconds": time.perf_counter() - start,
                      "parameters": flat.theta.numel(), "device": a.device, **info}))


if __name__ == "__main__":
    main()
