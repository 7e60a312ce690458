"""tether's benchmarks: ``bench/core.py`` (a script) and the HTTP ones (``-m bench.run``)."""
