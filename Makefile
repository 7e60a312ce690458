# Every target works on a fresh machine with only python3 and make: the
# virtual environment is created and filled on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tether-installed

.PHONY: venv lint typecheck pytest test demo serve bench wheel clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy

# pytest exits 5 when it collected no test: that is a failure here, as is any
# other non-zero code, so a run that tested nothing never passes.
pytest: venv
	$(PY) -m pytest

test: lint typecheck pytest

# The main job: the example servers under load, checked, summarised (under a minute:
# some twenty processes started in turn, each setting loaded for 2 s).
demo: venv
	$(PY) examples/demo.py

# One example server in the foreground (Ctrl-C stops it); SERVER=aiohttp for the other.
SERVER ?= starlette
PORT ?= 8000
serve: venv
	$(PY) examples/$(SERVER)_app.py --port $(PORT)

# Every benchmark (about 25 minutes on 2 cores; bench/README.md gives the last
# run's figure): the core microbenchmark, the JSON and streaming paths in process,
# issue 26's matrix (tether against the hand-off, every producer shape), batch,
# disconnect and memory with a py-spy profile of tether and the hand-off, the
# ZeroMQ link and resumable streams (a redis-server on PATH), then the charts.
# Servers and load clients are subprocesses on 127.0.0.1. Each step rewrites its
# block of bench/README.md or bench/RESULTS.md.
# py-spy is the benchmark's tool, not a dependency of tether: installed here.
bench: venv
	$(PY) -m pip install --quiet py-spy
	$(PY) -m bench.core --write
	$(PY) -m bench.json_path
	$(PY) -m bench.stream_path
	$(PY) -m bench.matrix
	$(PY) -m bench.run --profile
	$(PY) bench/zmq_relay.py
	$(PY) bench/zmq_liveness.py
	$(PY) -m bench.resume
	$(PY) -m bench.charts

wheel: venv
	$(PY) -m build --wheel --outdir dist .

clean:
	rm -rf $(VENV) dist build .mypy_cache .pytest_cache .ruff_cache
