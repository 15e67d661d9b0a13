# Two commands on a fresh clone: `make demo` and `make test`. Everything else is optional.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo demo-text test test-e2e quality bench bench-quick bench-scaling bench-big bench-soak bench-fastif bench-bergson serve clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build on this machine, never a multi-GB CUDA build pulled in by a dependency
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/influence-pipeline demo

# A byte-level GPT on the standard library's docstrings: which passages made it continue each prompt?
demo-text: $(STAMP)
	$(BIN)/influence-pipeline run --config configs/text-demo.yaml

# `make test`: everything but the end-to-end cases (a Prefect server, a worker and a browser) and the slow
# whole-process ones (signals, S3 outages, concurrent runs, SIGKILL, lost workers, every cluster kind, reproducibility);
# `make test-e2e` runs those, and .ci/run runs both. Exit code 5 (no test selected) is not a failure.
# test-e2e runs two test files at a time (pytest-xdist, one file per worker): its tests spend much of their time
# waiting on servers, workers and subprocesses (676 s in one process on CI, 543 s on two here). The browser test runs
# after them, alone: beside another file's runs, the UI's form once did not submit within 60 s. `make test` runs two
# files at a time as well: many of its tests also wait on a Prefect API, a Dask cluster or a moto server. Each worker's
# torch takes its share of the cores (tests/conftest.py): two workers of 2 threads on 2 cores took 764 s, of 1, 501 s.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not e2e and not slow" --durations=15 || [ $$? -eq 5 ]

test-e2e: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "e2e or slow" --ignore=tests/e2e/test_ui.py --durations=15 || [ $$? -eq 5 ]
	$(BIN)/python -m pytest -q -m "e2e or slow" tests/e2e/test_ui.py --durations=5 || [ $$? -eq 5 ]

serve: $(STAMP)
	infra/serve.sh

# Agreement, leave-one-out and mislabels (quality.py), then the LDS of every method and the peers' (lds.py: retrained
# subset models cached under benchmarks/.scratch/lds/, the peers' venvs built on first use under benchmarks/.venvs/), the
# compressed training index against the exact one on those problems and, through the pipeline, on the wide digits MLP
# where compression bites (index_quality.py: LDS uncompressed, side 64, auto, auto + re-ranking), re-ranking's recall
# and cost on W3 and over a 1,000,000-row index (index_rerank.py), then per-token scores on a
# planted fact (planted_fact.py: the text demo's corpus with one unique sentence, two models), then MAGIC beside Direct,
# EK-FAC and TRAK on the digits MLP and CNN through the pipeline's own validate stage, on the default recipe, a smooth
# one and a decayed one (magic_lds.py, ~40 min), and what those recipes cost in held-out accuracy (recipe_accuracy.py)
quality: $(STAMP)
	$(BIN)/python benchmarks/quality.py
	$(BIN)/python benchmarks/lds.py
	$(BIN)/python benchmarks/index_quality.py
	$(BIN)/python benchmarks/index_rerank.py w3
	$(BIN)/python benchmarks/index_rerank.py scale
	$(BIN)/python benchmarks/planted_fact.py
	$(BIN)/python benchmarks/magic_lds.py
	$(BIN)/python benchmarks/recipe_accuracy.py

# Side by side with pyDVL 0.10 and Kronfluence 1.0.1 (their venvs are built on first use under benchmarks/.venvs/)
bench: $(STAMP)
	$(BIN)/python benchmarks/peers.py
	$(BIN)/python benchmarks/long_sequences.py
	$(BIN)/python benchmarks/index_rerun.py

bench-quick: $(STAMP)
	$(BIN)/python benchmarks/peers.py --quick

bench-scaling: $(STAMP)
	$(BIN)/python benchmarks/scaling.py

bench-big: $(STAMP)
	$(BIN)/python benchmarks/big_model.py

bench-soak: $(STAMP)
	$(BIN)/python benchmarks/soak.py

bench-fastif: $(STAMP)
	$(BIN)/python benchmarks/fastif.py

# Side by side with EleutherAI's bergson 2.5.1 (its venv built on first use under benchmarks/.venvs/bergson)
bench-bergson: $(STAMP)
	benchmarks/peers/setup_bergson.sh >/dev/null
	$(BIN)/python benchmarks/bergson_side_by_side.py --rounds 2
	$(BIN)/python benchmarks/bergson_magic.py

clean:
	rm -rf runs .pytest_cache
