"""Storage traffic that does not grow with the replicas, counted on real processes
(jax.distributed, gloo, 127.0.0.1, 2 CPU devices each): every process's bytes through
read(2) around a verified restore (`jaxckpt._spread`), summed over the job, and through
write(2) and read(2) around a save (each process hashing the files it wrote), against the
state's bytes; what was restored compared bitwise; a damaged file still caught by the
process that read it, every process falling back alike; a restore's collectives the same
at any process count."""

import pytest
from children import spread
from multihost import one_job_at_a_time, run_job

pytestmark = one_job_at_a_time  # every test here runs a multi-process job


def _run(tmp_path, processes, **args):
    results = run_job(
        spread.restore_counted,
        processes=processes,
        devices=2,
        args={"dir": str(tmp_path)} | args,
        timeout=300,
    )
    return [r.report() for r in results]


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """A job's reports by layout and process count, each job run once for the module."""
    done = {}

    def reports(layout, processes, incremental=None):
        key = layout, processes, incremental
        if key not in done:
            where = tmp_path_factory.mktemp(f"{layout}-{processes}") / "ckpt"
            # The replicated jobs go on to restore a copy with a damaged file (the damage is
            # to a copy of its own): a packed file's, or with incremental=False (format 2)
            # an Orbax array's.
            damaged = []
            if layout == "replicated":
                damaged = ["packed"] if incremental is None else ["state"]
            done[key] = _run(
                where, processes, layout=layout, damaged=damaged, incremental=incremental
            )
        return done[key]

    return reports


@pytest.mark.parametrize(
    "layout, processes",
    [("replicated", 2), ("replicated", 4), ("mixed", 2), ("mixed", 4), ("fsdp", 2)],
)
def test_a_restore_reads_each_byte_once_and_the_writes_are_spread(counted, layout, processes):
    reports = counted(layout, processes)
    assert all(r["bitwise"] and r["step"] == 2 for r in reports), reports
    size = reports[0]["state_bytes"]
    total = sum(r["read"] for r in reports)
    assert size <= total <= 1.1 * size, [r["read"] / size for r in reports]
    # the busiest process writes about its share, whichever layout (replicas write parts)
    wrote = [r["wrote"] / size for r in reports]
    assert max(wrote) <= 1.25 / processes and sum(wrote) >= 1.0, wrote
    # and hashes (for the step's manifest) what it wrote, not the state: process 0 too
    hashed = [r["read_saving"] / size for r in reports]
    assert max(hashed) <= 1.25 / processes and sum(hashed) <= 1.1, hashed


@pytest.mark.parametrize("layout", ["replicated", "mixed"])
def test_a_restores_collectives_do_not_grow_with_the_processes(counted, layout):
    """Counted per process (`_internals.count_collectives`): the same collectives on 4
    processes as on 2 (one agreement per stage: a barrier of the coordination service,
    which times out, and a read of its keys; one all-gather per read batch), the same on
    every process, and no barrier that cannot time out."""
    two, four = ([r["collectives"] for r in counted(layout, n)] for n in (2, 4))
    assert all(c == two[0] for c in two + four), (two, four)
    assert two[0]["wait_at_barrier"] == two[0]["key_value_dir_get"], two
    assert "sync_global_devices" not in two[0], two


@pytest.mark.parametrize("layout", ["replicated", "mixed"])
def test_each_process_reads_one_packed_index_whatever_the_processes(counted, layout):
    """Process 0 merges every process's index at the commit: a process reads that one file,
    not each process's (O(N) requests on each, O(N^2) in the job, on object storage), and
    of the data files only those holding pieces it reads."""
    for processes in (2, 4):
        for r in counted(layout, processes):
            data = [f for f in r["packed_opened"] if f != "index.json"]
            assert "index.json" in r["packed_opened"], r
            assert all(f.endswith(f"-of-{processes}.bin") for f in data), r


@pytest.mark.parametrize("processes", [2, 4])
@pytest.mark.parametrize("where", ["state", "packed"])
def test_a_damaged_file_is_caught_and_every_process_falls_back(counted, where, processes):
    incremental = None if where == "packed" else False  # (an Orbax array: format 2)
    reports = [r["damaged"][where] for r in counted("replicated", processes, incremental)]
    victim = reports[0]["victim"]
    # the process that read the damaged part names the file; the others name that process
    assert any(f"{victim}: contents changed" in r["error"] for r in reports), reports
    for r in reports:
        assert "step 2" in r["error"] and "is corrupt" in r["error"], r
        assert r["step"] == 1 and r["bitwise"], r
