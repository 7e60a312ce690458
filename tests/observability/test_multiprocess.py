"""The multiprocess mode: worker processes each count their own registry into
``PROMETHEUS_MULTIPROC_DIR``, and one scrape of the directory adds them all up."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import prometheus_client
from prometheus_client import multiprocess

import tether
from tests._support.scrape import Scrape

WORKER = textwrap.dedent(
    """
    import asyncio, os, tether, tether_prometheus

    async def main():
        registry = tether.Registry()
        tether_prometheus.MultiprocessMetrics().add(registry, name="front")
        for _ in range(2):
            stream = registry.open()
            registry.deliver(stream.rid, "x", finished=True)
            assert await stream.result() == "x"
        aborted = registry.open()
        registry.abort(aborted.rid)
        failed = registry.open()
        registry.fail(failed.rid, RuntimeError("no"))
        registry.deliver(aborted.rid, "late")
        batch = registry.open_batch(2)
        registry.deliver(batch.rids[0], "y", finished=True)
        still_open = registry.open()
        print(registry.stats().late_outputs, flush=True)
        # exit with two requests in flight, as a killed worker does (no finaliser runs)
        os._exit(0)

    asyncio.run(main())
    """
)


def run_worker(directory: pathlib.Path) -> int:
    """Run one worker to its end; its pid."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    with subprocess.Popen(
        [sys.executable, "-c", WORKER],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as worker:
        out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    assert out.strip() == "1"  # one late output
    return worker.pid


def scrape(directory: pathlib.Path) -> Scrape:
    registry = prometheus_client.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(directory))
    return Scrape(prometheus_client.generate_latest(registry).decode())


def test_two_workers_add_up_in_one_scrape(tmp_path: pathlib.Path) -> None:
    pids = [run_worker(tmp_path) for _ in range(2)]
    got = scrape(tmp_path)
    label = {"registry": "front"}
    assert got.value("tether_requests_opened_total", **label) == 2 * 7
    assert got.value("tether_requests_finished_total", **label) == 2 * 3
    assert got.value("tether_requests_failed_total", **label) == 2 * 1
    for reason in tether.AbortReason:
        expected = 2 if reason == "server" else 0
        assert got.value("tether_requests_aborted_total", reason=str(reason), **label) == expected
    assert got.value("tether_late_outputs_total", **label) == 2
    # each worker left its batch's second sub-request and one single request open
    assert got.value("tether_requests_in_flight", **label) == 2 * 2
    assert got.value("tether_request_duration_seconds_count", **label) == 2 * 5
    assert got.value("tether_time_to_first_output_seconds_count", **label) == 2 * 3

    multiprocess.mark_process_dead(pids[0], path=str(tmp_path))
    got = scrape(tmp_path)
    assert got.value("tether_requests_in_flight", **label) == 2  # the live worker's only
    assert got.value("tether_requests_finished_total", **label) == 2 * 3  # counters stay
