"""tether's benchmarks, run by ``make bench``: see ``bench/README.md``."""
