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
- `block-cg` (W4, where plain CG would take hours): this project's block CG (`influence_core.solvers`) on this
  file's product, with `--preconditioner nystroem` influence_core's Nyström preconditioner sketched from it, and
  `--product-dtype float32` (4× faster on W4, relative error 4e-7); so the solver is not independent of the code under
  test, but its answer is judged here: ‖(C + λI)x − g‖/‖g‖ with this file's float64 product, for cg and block-cg alike.
  On the quick W4 (p = 33,600), float32 products, rtol 1e-6: no preconditioner 919 iterations, Nyström rank 200 428;
  EK-FAC as the preconditioner took 935 (tried and dropped; on the full W4 its quotients gᵀCg on a query gradient, per
  layer, are 2× (head) to 45× (second block) below the GGN's).
Prints one JSON line (seconds, iterations, worst relative residual) and saves the (queries, n_train) scores.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace

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
    """The model as a function of one flat vector of its tracked parameters (the others held fixed), in `dtype`:
    float64, or float32 for block CG's products."""

    def __init__(self, w: Workload, device: str, chunk: int | None = None, dtype: torch.dtype = torch.float64) -> None:
        self.spec = w.spec
        self.chunk = chunk or (50 if is_language_model(w.spec) else 1000)  # training rows per curvature product or gradient block
        self.model = copy.deepcopy(w.model).to(device, dtype)
        tracked = set(tracked_names(w))
        named = dict(self.model.named_parameters())
        self.fixed = {n: p.detach() for n, p in named.items() if n not in tracked}
        self.names = [n for n in named if n in tracked]
        self.shapes = [named[n].shape for n in self.names]
        self.theta = torch.cat([named[n].detach().reshape(-1) for n in self.names])
        self.x, self.y = self.inputs(w.x_train), w.y_train.to(device)
        self.n = len(self.y)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Features in the model's dtype (token ids stay integers), on its device."""
        return (x if is_language_model(self.spec) else x.to(self.theta.dtype)).to(self.theta.device)

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

    def product(self, matrix: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """Rows times `matrix` (hessian, ggn or ef)."""
        return {"hessian": self.hessian_matmat, "ggn": self.ggn_matmat, "ef": self.ef_matmat}[matrix]

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


def cg(matmat: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, rtol: float, maxiter: int, seconds: float,
       preconditioner: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, int, float]:
    """Vectorised (P)CG, one independent run per row of b, until every ‖r‖ ≤ rtol·‖b‖ (or maxiter iterations, or
    `seconds` have passed: the worst relative residual reached is reported either way). The preconditioner changes
    only how many iterations that takes: the answer is judged by its own residual."""
    precond = preconditioner or (lambda r: r)
    deadline = time.perf_counter() + seconds
    x = torch.zeros_like(b)
    r = b.clone()
    z = precond(r)
    d = z.clone()
    rz = (r * z).sum(1)
    target = rtol * b.norm(dim=1)
    it = 0
    while bool((r.norm(dim=1) > target).any()) and it < maxiter and time.perf_counter() < deadline:
        it += 1
        ad = matmat(d)
        alpha = rz / (d * ad).sum(1)
        x += alpha[:, None] * d
        r -= alpha[:, None] * ad
        z = precond(r)
        rz_new = (r * z).sum(1)
        d = z + (rz_new / rz)[:, None] * d
        rz = rz_new
    return x, it, float((r.norm(dim=1) / b.norm(dim=1)).max())


def solve(flat: Flat, low: Flat, matrix: str, solver: str, lam: float, g_test: torch.Tensor, a: argparse.Namespace,
          preconditioner: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, dict]:
    """(C + λI)⁻¹ g for each row of g_test, and what the solve did. CG's products are `low`'s (`--product-dtype`);
    every iterative answer's relative residual is then measured with `flat`'s float64 product."""
    matmat = flat.product(matrix)
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
    dtype = low.theta.dtype
    low_matmat = low.product(matrix)
    damped = lambda v: low_matmat(v.to(dtype)).to(v.dtype) + lam * v  # noqa: E731
    if solver == "block-cg":
        x, info = library_block_cg(damped, g_test, a.rtol, a.maxiter, preconditioner)
    else:
        x, it, residual = cg(damped, g_test, a.rtol, a.maxiter, a.max_seconds, preconditioner)
        info = {"iterations": it, "solver_relative_residual": residual, "rtol": a.rtol}
    residual = (matmat(x) + lam * x - g_test).norm(dim=1) / g_test.norm(dim=1)
    return x, {**info, "max_relative_residual": float(residual.max()), "product_dtype": a.product_dtype}


def nystroem_preconditioner(low: Flat, matrix: str, lam: float, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """influence_core's rank-`rank` Nyström preconditioner, sketched from this file's product (in `low`'s dtype)."""
    from influence_core.methods.preconditioners import NystroemPreconditioner

    curvature = SimpleNamespace(matmat=low.product(matrix), dim=low.theta.numel(), dtype=low.theta.dtype, device=low.theta.device)
    preconditioner = NystroemPreconditioner(lam, rank, 0, 0)
    preconditioner.fit(curvature)  # type: ignore[arg-type]
    return lambda r: preconditioner.apply(r.to(low.theta.dtype)).to(r.dtype)


def library_block_cg(matmat: Callable[[torch.Tensor], torch.Tensor], g_test: torch.Tensor, rtol: float, maxiter: int,
                     preconditioner: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple[torch.Tensor, dict]:
    """(C + λI)⁻¹ g_test by influence_core's block (P)CG on this file's product `matmat` (W4, where independent CG on
    each row takes too many passes); its answer is judged by the float64 residual `main` computes afterwards."""
    from influence_core.solvers import block_conjugate_gradient

    x, info = block_conjugate_gradient(matmat, g_test, rtol=rtol, maxiter=maxiter, preconditioner=preconditioner)
    return x, {"iterations": info.iterations, "products": info.products, "library_relative_residual": info.max_relative_residual, "rtol": rtol}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True)
    p.add_argument("--matrix", choices=["hessian", "ggn", "ef"], required=True)
    p.add_argument("--solver", choices=["direct", "cg", "woodbury", "block-cg"], required=True)
    p.add_argument("--queries", type=int, required=True, help="score the first this many queries")
    p.add_argument("--regularization", type=float, required=True, help="λ")
    p.add_argument("--rtol", type=float, default=1e-10)
    p.add_argument("--preconditioner", choices=["none", "nystroem"], default="none", help="cg, block-cg: influence_core's Nyström preconditioner on this file's product")
    p.add_argument("--preconditioner-rank", type=int, default=200, help="nystroem: the sketch's rank")
    p.add_argument("--product-dtype", choices=["float64", "float32"], default="float64", help="cg, block-cg: the dtype of the curvature products")
    p.add_argument("--maxiter", type=int, default=5000)
    p.add_argument("--max-seconds", type=float, default=float("inf"), help="stop CG after this long, reporting the residual reached")
    p.add_argument("--chunk", type=int, default=None, help="training rows per product (default 1000; W4 50)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="where to compute (cuda: W4's reference on a GPU)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")  # the iterative solves' progress
    w = load_workload(a.workload)
    lam = a.regularization
    start = time.perf_counter()
    flat = Flat(w, a.device, a.chunk)
    xq, yq = flat.inputs(w.x_test[: a.queries]), w.y_test[: a.queries].to(a.device)
    g_test = flat.grads(xq, yq)
    low = flat if a.product_dtype == "float64" else Flat(w, a.device, a.chunk, getattr(torch, a.product_dtype))
    preconditioner = nystroem_preconditioner(low, a.matrix, lam, a.preconditioner_rank) if a.preconditioner == "nystroem" else None
    factors, info = solve(flat, low, a.matrix, a.solver, lam, g_test, a, preconditioner)
    scores = torch.cat([factors @ flat.grads(x, y).T for x, y in flat.chunks()], dim=1)
    np.save(a.out, scores.cpu().numpy())
    print(json.dumps({"matrix": a.matrix, "solver": a.solver, "queries": a.queries, "regularization": lam, "seconds": time.perf_counter() - start,
                      "parameters": flat.theta.numel(), "device": a.device, **info}))


if __name__ == "__main__":
    main()
