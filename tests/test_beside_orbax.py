"""jaxckpt changes nothing of another library that it does not own: a user's own plain Orbax
saves and restores in the same process (an eval checkpoint, a data iterator's) write and
read the same before jaxckpt is imported and beside open jaxckpt managers, on local disk,
gs:// and s3:// (where plain Orbax refuses the path both times). Each wrap of an Orbax
function acts only below a directory jaxckpt has open (`jaxckpt._internals.hold`; each wrap
falling through to Orbax's own function elsewhere: tests/test_orbax_boundary.py)."""

import json

from conftest import run_python


def test_plain_orbax_beside_jaxckpt_writes_and_reads_as_without_it(tmp_path, gcs_server, s3_server):
    # in a folder of its own: plain Orbax takes an s3:// path for a relative local one
    # and makes its temporary folders there (`s3:/...`) before it refuses it
    work = tmp_path / "cwd"
    work.mkdir()
    proc = run_python(
        "-m",
        "children.orbax_beside",
        str(tmp_path / "local"),
        f"{gcs_server.url}/beside-orbax",
        f"{s3_server.url}/beside-orbax",
        timeout=600,
        cwd=work,
    )
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    before, beside = found["before"], found["beside"]
    for store in ("local", "gs"):
        assert "error" not in before[store], before[store]
        metadata = before[store]["arrays"]["w"]["metadata"]
        assert "crc32c" not in json.dumps(metadata)  # (jaxckpt's own arrays carry one)
    assert "should be absolute" in before["s3"]["error"]  # plain Orbax writes no s3://
    assert beside == before
