"""A run that checkpoints with `flax.training.checkpoints` (as Flax's imagenet, wmt and lm1b
examples do) switches to jaxckpt in place: a new process opens the work directory Flax
wrote, resumes from its newest `checkpoint_<step>/` and goes on bitwise as the run would
have (tests/children/flax_run.py). The listing, inspect, verify, export and restore of such
steps are in tests/test_from_orbax.py (layouts "flax", "flax-multiprocess")."""

import re

from conftest import run_python

RUN = "tests/children/flax_run.py"


def run(workdir, *args):
    out = run_python(RUN, f"--workdir={workdir}", "--steps=20", *args).stdout
    losses = {int(s): bits for s, bits in re.findall(r"^LOSS (\d+) (\d+)$", out, re.M)}
    return out, losses, re.search(r"^FINAL (\d+)$", out, re.M)[1]


def test_a_flax_run_goes_on_under_jaxckpt_bitwise_in_a_new_process(tmp_path):
    _, straight, final = run(tmp_path / "straight", "--with=flax")
    workdir = tmp_path / "run"
    _, first, _ = run(workdir, "--with=flax", "--stop-at=10")
    flax_files = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    out, second, resumed_final = run(workdir, "--with=jaxckpt")
    assert "resumed from step 10" in out
    assert {**first, **second} == straight and sorted(second) == list(range(11, 21))
    assert resumed_final == final
    # Flax's steps are kept as they were, beside jaxckpt's, which resume the run next time.
    assert {p: p.read_bytes() for p in flax_files} == flax_files
    assert sorted(p.name for p in workdir.iterdir() if not p.name.startswith(".")) == [
        "15",
        "20",
        "checkpoint_10",
        "checkpoint_5",
    ]
    out, third, _ = run(workdir, "--with=jaxckpt")
    assert "resumed from step 20" in out and third == {}
