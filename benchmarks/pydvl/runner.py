"""pyDVL 0.10 ``DaskInfluenceCalculator`` baseline for the scaling benchmark.

Runs INSIDE the pyDVL virtualenv (see ``setup_env.sh``), not the project's.
Loads a dataset (``.npz``) and the state_dict of an MLP
``nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, c))``, fits pyDVL's
``DirectInfluence`` (exact Hessian of the mean cross-entropy loss plus
``regularization * I``) on the training set, and computes the n_test x n_train
"up" influence matrix with ``DaskInfluenceCalculator`` on a local Dask
cluster of ``--workers`` single-threaded worker processes.

Prints exactly one JSON line on stdout; all logging goes to stderr.

pyDVL 0.10 semantics (read from the released wheel, pydvl/influence/...):
  * ``DirectInfluence(model, loss, regularization=λ)`` -- the keyword is
    ``regularization`` in 0.10 (older releases called it
    ``hessian_regularization``).
  * fit: torch/functional.py ``hessian()`` averages per-batch Hessians of the
    (mean-reduced) batch loss weighted by batch size, i.e. the Hessian of the
    mean training loss; torch/operator.py ``DirectSolveOperator`` adds λ to its
    diagonal and solves with ``torch.linalg.solve``.
  * "up" influence = + ∇ℓ_testᵀ (H + λI)⁻¹ ∇ℓ_train, no minus sign
    (types.py ``OperatorGradientComposition.interactions`` ->
    ``BilinearForm.grads_inner_prod``; torch/base.py ``OperatorBilinearForm``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import warnings


def _log(msg: str) -> None:
    print(f"[pydvl-runner] {msg}", file=sys.stderr, flush=True)


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True,
                   help=".npz with x_train, y_train, x_test, y_test")
    p.add_argument("--state", required=True, help="torch state_dict (.pt) of the MLP")
    p.add_argument("--hidden", type=int, required=True, help="hidden width h")
    p.add_argument("--classes", type=int, required=True, help="number of classes c")
    p.add_argument("--regularization", type=float, required=True,
                   help="λ added to the diagonal of the mean-loss Hessian")
    p.add_argument("--workers", type=int, default=1,
                   help="Dask LocalCluster n_workers (threads_per_worker=1)")
    p.add_argument("--train-chunk", type=int, required=True,
                   help="rows per chunk of the training dask arrays")
    p.add_argument("--test-chunk", type=int, required=True,
                   help="rows per chunk of the test dask arrays")
    p.add_argument("--fit-batch-size", type=int, default=1024,
                   help="DataLoader batch size for the Hessian in fit() "
                        "(the result does not depend on it)")
    p.add_argument("--fit-threads", type=int, default=None,
                   help="torch.set_num_threads for fit() in the driver process "
                        "(default: torch's default)")
    p.add_argument("--no-warmup", action="store_true",
                   help="do not import torch/pydvl in the workers before timing")
    return p.parse_args(argv)


def _check_chunks(n: int, chunk: int, name: str) -> None:
    if chunk < 1:
        raise SystemExit(f"{name} must be >= 1")
    # pyDVL 0.10 calls .squeeze() on each label chunk; a trailing chunk with a
    # single row would become 0-d and break the per-chunk computation.
    if n % chunk == 1 and n > 1:
        raise SystemExit(
            f"{name}={chunk} leaves a trailing chunk of 1 row (n={n}); pyDVL 0.10 "
            "cannot handle single-row chunks, choose another chunk size"
        )


def _warmup_worker() -> str:
    import torch  # noqa: F401
    import pydvl.influence.torch  # noqa: F401

    return f"torch threads={torch.get_num_threads()}"


def main(argv=None) -> int:
    args = _parse_args(argv)
    real_stdout = sys.stdout
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    # Worker processes are spawned and inherit the environment, not the
    # warnings filters: keep pyDeprecate's FutureWarnings out of the log.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")

    with contextlib.redirect_stdout(sys.stderr):
        result = _run(args)
    real_stdout.write(json.dumps(result) + "\n")
    real_stdout.flush()
    return 0


def _run(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import dask.array as da
    from distributed import Client, LocalCluster

    import pydvl
    from pydvl.influence import DaskInfluenceCalculator, InfluenceMode
    from pydvl.influence.torch import DirectInfluence
    from pydvl.influence.torch.util import TorchNumpyConverter

    # distributed sets explicit INFO levels on its sub-loggers at import.
    for name in list(logging.root.manager.loggerDict):
        if name == "distributed" or name.startswith("distributed."):
            logging.getLogger(name).setLevel(logging.WARNING)

    data = np.load(args.data)
    x_train = np.ascontiguousarray(data["x_train"], dtype=np.float32)
    y_train = np.ascontiguousarray(data["y_train"], dtype=np.int64)
    x_test = np.ascontiguousarray(data["x_test"], dtype=np.float32)
    y_test = np.ascontiguousarray(data["y_test"], dtype=np.int64)
    n_train, d = x_train.shape
    n_test = x_test.shape[0]
    _check_chunks(n_train, args.train_chunk, "--train-chunk")
    _check_chunks(n_test, args.test_chunk, "--test-chunk")

    model = nn.Sequential(
        nn.Linear(d, args.hidden), nn.Tanh(), nn.Linear(args.hidden, args.classes)
    )
    model.load_state_dict(torch.load(args.state, map_location="cpu", weights_only=True))
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    _log(f"n_train={n_train} n_test={n_test} d={d} h={args.hidden} "
         f"c={args.classes} params={n_params} λ={args.regularization} "
         f"workers={args.workers} train_chunk={args.train_chunk} "
         f"test_chunk={args.test_chunk} pydvl={pydvl.__version__}")

    # ---- (a) fit: exact Hessian of the mean loss, + λI, kept for solves ----
    if args.fit_threads is not None:
        torch.set_num_threads(args.fit_threads)
    loader = DataLoader(
        TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
        batch_size=args.fit_batch_size, shuffle=False,
    )
    infl_model = DirectInfluence(
        model,
        loss=torch.nn.functional.cross_entropy,
        regularization=float(args.regularization),
    )
    t0 = time.perf_counter()
    infl_model = infl_model.fit(loader)
    fit_seconds = time.perf_counter() - t0
    _log(f"fit: {fit_seconds:.3f}s (driver torch threads={torch.get_num_threads()})")

    # ---- Dask cluster (start-up is not timed) ----
    t0 = time.perf_counter()
    cluster = LocalCluster(
        n_workers=args.workers, threads_per_worker=1, processes=True,
        host="127.0.0.1", dashboard_address="127.0.0.1:0",
        silence_logs=logging.WARNING,
    )
    client = Client(cluster)
    try:
        if not args.no_warmup:
            # Import torch/pyDVL in every worker so the timed section measures
            # the influence work, not interpreter start-up.
            info = client.run(_warmup_worker)
            _log(f"workers warmed up: {info}")
        cluster_seconds = time.perf_counter() - t0

        da_x_train = da.from_array(x_train, chunks=(args.train_chunk, d))
        da_y_train = da.from_array(y_train, chunks=(args.train_chunk,))
        da_x_test = da.from_array(x_test, chunks=(args.test_chunk, d))
        da_y_test = da.from_array(y_test, chunks=(args.test_chunk,))

        # ---- (b) Dask influence computation: scatter model, build, compute ----
        t0 = time.perf_counter()
        calc = DaskInfluenceCalculator(
            infl_model, TorchNumpyConverter(device=torch.device("cpu")), client
        )
        da_scores = calc.influences(
            da_x_test, da_y_test, da_x_train, da_y_train, mode=InfluenceMode.Up
        )
        scores = da_scores.compute()
        influence_seconds = time.perf_counter() - t0
    finally:
        client.close()
        cluster.close()

    scores = np.asarray(scores)
    assert scores.shape == (n_test, n_train), scores.shape
    _log(f"influences: {influence_seconds:.3f}s shape={scores.shape} "
         f"dtype={scores.dtype} chunks={da_scores.numblocks}")

    return {
        "fit_seconds": fit_seconds,
        "influence_seconds": influence_seconds,
        "n_train": int(n_train),
        "n_test": int(n_test),
        "workers": int(args.workers),
        "pydvl_version": pydvl.__version__,
        "scores_sum": float(scores.sum(dtype=np.float64)),
        "scores_first": [float(v) for v in scores[0, :5]],
        # extra context (not required by callers)
        "n_params": int(n_params),
        "train_chunk": int(args.train_chunk),
        "test_chunk": int(args.test_chunk),
        "regularization": float(args.regularization),
        "cluster_seconds": cluster_seconds,
        "dtype": str(scores.dtype),
    }


if __name__ == "__main__":
    sys.exit(main())
