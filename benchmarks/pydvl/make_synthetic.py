"""Small synthetic inputs for runner.py, plus a dense reference to check it.

Run with any python that has torch and numpy (e.g. the pydvl venv):

  make_synthetic.py make --out DIR [--n-train 2000 --n-test 50 --d 20
                                    --hidden 16 --classes 2 --epochs 5]
      writes DIR/data.npz (x_train, y_train, x_test, y_test) and DIR/state.pt
  make_synthetic.py reference --out DIR --hidden 16 --classes 2 --regularization λ
      prints JSON with scores_sum / scores_first of the reference
      score = +∇ℓ_testᵀ (H + λI)⁻¹ ∇ℓ_train, H = Hessian of the MEAN training
      cross-entropy, computed in float64 with torch.func (independent of pyDVL).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
from torch import nn


def _mlp(d: int, h: int, c: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, c))


def make(a: argparse.Namespace) -> None:
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    n = a.n_train + a.n_test
    x = rng.standard_normal((n, a.d)).astype(np.float32)
    w = rng.standard_normal((a.d, a.classes)).astype(np.float32)
    logits = x @ w + 0.5 * rng.standard_normal((n, a.classes)).astype(np.float32)
    y = logits.argmax(1).astype(np.int64)
    np.savez(
        os.path.join(a.out, "data.npz"),
        x_train=x[: a.n_train], y_train=y[: a.n_train],
        x_test=x[a.n_train:], y_test=y[a.n_train:],
    )
    torch.manual_seed(a.seed)
    model = _mlp(a.d, a.hidden, a.classes)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    xt, yt = torch.from_numpy(x[: a.n_train]), torch.from_numpy(y[: a.n_train])
    for _ in range(a.epochs):
        for i in range(0, a.n_train, 128):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xt[i:i + 128]), yt[i:i + 128])
            loss.backward()
            opt.step()
    with torch.no_grad():
        acc = (model(xt).argmax(1) == yt).float().mean().item()
    torch.save(model.state_dict(), os.path.join(a.out, "state.pt"))
    print(json.dumps({"out": a.out, "train_acc": acc}))


def reference(a: argparse.Namespace) -> None:
    data = np.load(os.path.join(a.out, "data.npz"))
    xtr = torch.from_numpy(data["x_train"]).double()
    ytr = torch.from_numpy(data["y_train"])
    xte = torch.from_numpy(data["x_test"]).double()
    yte = torch.from_numpy(data["y_test"])
    d = xtr.shape[1]
    model = _mlp(d, a.hidden, a.classes)
    model.load_state_dict(torch.load(os.path.join(a.out, "state.pt"),
                                     weights_only=True))
    model = model.double()
    names = [k for k, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def unflatten(v):
        return {k: t.reshape(s) for k, t, s in zip(names, torch.split(v, sizes), shapes)}

    def mean_loss(v, x, y):
        out = torch.func.functional_call(model, unflatten(v), (x,))
        return nn.functional.cross_entropy(out, y)

    def sample_loss(v, x, y):
        return mean_loss(v, x.unsqueeze(0), y.unsqueeze(0))

    hess = torch.func.hessian(mean_loss)(flat, xtr, ytr)
    hess = hess + a.regularization * torch.eye(flat.numel(), dtype=hess.dtype)
    per_sample = torch.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0))
    g_tr = per_sample(flat, xtr, ytr)
    g_te = per_sample(flat, xte, yte)
    scores = torch.linalg.solve(hess, g_te.T).T @ g_tr.T  # +g_teᵀ(H+λI)⁻¹g_tr
    print(json.dumps({
        "reference": "+grad_test^T (H_mean + lambda I)^-1 grad_train, float64",
        "scores_sum": float(scores.sum()),
        "scores_first": [float(v) for v in scores[0, :5]],
    }))


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--n-train", type=int, default=2000)
    m.add_argument("--n-test", type=int, default=50)
    m.add_argument("--d", type=int, default=20)
    m.add_argument("--hidden", type=int, default=16)
    m.add_argument("--classes", type=int, default=2)
    m.add_argument("--epochs", type=int, default=5)
    m.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("reference")
    r.add_argument("--out", required=True)
    r.add_argument("--hidden", type=int, required=True)
    r.add_argument("--classes", type=int, required=True)
    r.add_argument("--regularization", type=float, required=True)
    a = p.parse_args()
    (make if a.cmd == "make" else reference)(a)


if __name__ == "__main__":
    main()
