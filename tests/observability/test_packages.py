"""The observability packages' public names are pinned, sorted and documented, and
the core imports neither prometheus_client nor opentelemetry."""

from __future__ import annotations

import subprocess
import sys

import tether_otel
import tether_prometheus


def ruff_order(name: str) -> tuple[int, str]:
    """Constants, then classes, then functions: the order ruff's RUF022 keeps."""
    kind = 0 if name.isupper() else 1 if name[0].isupper() else 2
    return kind, name


def test_each_package_exports_a_sorted_documented_list() -> None:
    expected = {
        tether_prometheus: {
            "DURATION_BUCKETS",
            "TTFO_BUCKETS",
            "MultiprocessMetrics",
            "RegistryCollector",
        },
        tether_otel: {"instrument"},
    }
    for package, names in expected.items():
        assert set(package.__all__) == names
        assert package.__all__ == sorted(package.__all__, key=ruff_order)
        for name in package.__all__:
            assert getattr(package, name).__doc__ or name.isupper(), name


def test_importing_tether_loads_no_metrics_or_tracing_library() -> None:
    probe = (
        "import sys, tether, tether.http; "
        "print(sorted({m.split('.')[0] for m in sys.modules} "
        "& {'prometheus_client', 'opentelemetry'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
