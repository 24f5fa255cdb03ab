"""A store that sheds load, resets connections, is down for a while or is slow, as pods meet
them every day: real moto and fake-gcs-server behind reliability.proxy's fault proxy, and
jaxckpt in real child processes (one, and a job of two) pointed at it. Every save commits,
every kept step restores bitwise, and none is called corrupt."""

import os

import pytest
from children import flaky_store
from multihost import one_job_at_a_time, run_job

from conftest import prefix_on
from reliability import gcs, s3
from reliability.proxy import FaultProxy, Faults

pytestmark = one_job_at_a_time

POINT_AT = {"gs": gcs.point_at, "s3": s3.point_at}
UPSTREAM = {"gs": "STORAGE_EMULATOR_HOST", "s3": "AWS_ENDPOINT_URL"}


def _proxied(bucket, request, monkeypatch):
    """A fault proxy in front of this store's server, the children's clients pointed at it;
    yields the proxy and a fresh directory."""
    store = bucket.url.partition("://")[0]
    with FaultProxy(os.environ[UPSTREAM[store]], seed=0) as proxy:
        for key, value in POINT_AT[store](proxy.url).items():
            monkeypatch.setenv(key, value)
        yield proxy, prefix_on(bucket, request)


@pytest.fixture
def proxied(bucket, request, monkeypatch):
    """Each store in turn behind a fault proxy (`_proxied`)."""
    yield from _proxied(bucket, request, monkeypatch)


@pytest.fixture
def proxied_s3(s3_server, request, monkeypatch):
    yield from _proxied(s3_server, request, monkeypatch)


def _loses_nothing(proxy: FaultProxy, directory: str, processes: int, devices: int) -> None:
    """Saves through 10% of requests answered 503 and 10% reset: every save commits,
    every kept step restores bitwise, none is called corrupt."""
    proxy.set(Faults(busy=0.1, resets=0.1))
    results = run_job(
        flaky_store.saves_through_faults,
        processes=processes,
        devices=devices,
        args={"dir": directory, "saves": 4, "keep_last": 2},
        timeout=400,
    )
    counts = proxy.counts()
    assert counts.get("busy", 0) > 0 and counts.get("reset", 0) > 0, counts  # (faults met)
    for r in results:
        report = r.report()
        assert report["kept"] == [3, 4], report
        assert report["errors"] == [] and report["corrupt"] == [], report
        assert report["wrong"] == [] and report["unverified"] == [], report


# Before: 3 attempts a request (503 three times failed a save), and a 503 met while a
# restore hashed a file made a healthy step "corrupt".
def test_a_store_shedding_load_and_resetting_loses_no_save_and_calls_no_step_corrupt(proxied):
    _loses_nothing(*proxied, processes=1, devices=8)


def test_a_job_of_two_on_a_store_shedding_load_loses_no_save(proxied_s3):
    _loses_nothing(*proxied_s3, processes=2, devices=4)


def test_a_store_down_for_a_while_is_waited_out(proxied):
    proxy, directory = proxied
    proxy.outage(6)  # the first six requests of the run answered 503, as a store down
    results = run_job(
        flaky_store.saves_through_faults,
        processes=1,
        devices=8,
        args={"dir": directory, "saves": 2},
        timeout=300,
    )
    assert proxy.counts()["outage"] == 6
    report = results[0].report()
    assert report["kept"] == [1, 2] and report["errors"] == [], report


def test_a_save_slower_than_timeout_s_at_the_stores_speed_commits(proxied):
    # Before: timeout_s bounded the whole background save, this process's own writes
    # included (Orbax's AsyncOptions): SaveError (TimeoutError) at timeout_s while the
    # writes still moved.
    proxy, directory = proxied
    proxy.set(Faults(bytes_per_s=1_000_000))  # ~2.3 MB to write: slower than timeout_s
    timeout_s = 1.0
    results = run_job(
        flaky_store.slow_save,
        processes=1,
        devices=8,
        args={"dir": directory, "timeout_s": timeout_s},
        timeout=300,
    )
    report = results[0].report()
    assert report["took_s"] > timeout_s, report  # (the case: writes longer than it)
    assert report["steps"] == [1] and report["same"], report
