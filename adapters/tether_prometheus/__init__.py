"""Prometheus metrics for tether: ``pip install -e '.[prometheus]'`` from a checkout.

One process::

    collector = tether_prometheus.RegistryCollector()
    collector.add(registry, name="engine")
    prometheus_client.REGISTRY.register(collector)

Several worker processes (``PROMETHEUS_MULTIPROC_DIR`` set): one
:class:`MultiprocessMetrics` per worker, ``add`` the worker's registry, and serve
``/metrics`` from a ``CollectorRegistry`` holding a ``MultiProcessCollector``.

Both expose the same metrics, each labelled ``registry``: ``tether_requests_in_flight``,
``tether_requests_opened_total``, ``tether_requests_finished_total``,
``tether_requests_failed_total``, ``tether_requests_aborted_total`` (with ``reason``),
``tether_late_outputs_total``, and the histograms
``tether_time_to_first_output_seconds`` and ``tether_request_duration_seconds``.
"""

from __future__ import annotations

from ._collector import DURATION_BUCKETS, TTFO_BUCKETS, RegistryCollector
from ._multiprocess import MultiprocessMetrics

__all__ = ["DURATION_BUCKETS", "TTFO_BUCKETS", "MultiprocessMetrics", "RegistryCollector"]
