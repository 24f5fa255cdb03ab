"""When to save (with an injected clock, never sleeping) and which steps to keep."""

import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxckpt
from jaxckpt import RetentionPolicy, SavePolicy


class FakeClock:
    """Seconds as a settable float."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


STATE = {"x": np.arange(4, dtype=np.float32)}


# ------------------------------------------------------------------------------- SavePolicy


def test_every_steps(ckpt_dir):
    clock = FakeClock()
    with jaxckpt.CheckpointManager(ckpt_dir, policy=SavePolicy(every_steps=5), clock=clock) as m:
        due = [step for step in range(1, 23) if m.should_save(step)]
        assert due == [5, 10, 15, 20]
        clock.now += 1e9  # time alone never makes a step-only policy due
        assert not m.should_save(7)
        assert m.should_save(25)


def test_every_steps_does_not_save_the_step_just_saved_twice(ckpt_dir):
    with jaxckpt.CheckpointManager(ckpt_dir, policy=SavePolicy(every_steps=5)) as m:
        assert m.should_save(5)
        assert m.should_save(5)  # asking does not change the answer
        m.save(5, state=STATE)
        assert not m.should_save(5)
        assert m.should_save(10)
        m.save(10, state=STATE)
        assert not m.should_save(10)
        m.wait()
        assert not m.should_save(10)
        assert m.all_steps() == [5, 10]


def test_every_seconds_with_a_fake_clock(ckpt_dir):
    clock = FakeClock(500.0)
    with jaxckpt.CheckpointManager(ckpt_dir, policy=SavePolicy(every_seconds=60), clock=clock) as m:
        # Counted from the manager's creation.
        assert not m.should_save(1)
        clock.now = 559.9
        assert not m.should_save(2)
        clock.now = 560.0
        assert m.should_save(3)
        assert m.should_save(4)  # still due: nothing was saved
        m.save(4, state=STATE)
        # Counted from the last save now.
        assert not m.should_save(4)
        assert not m.should_save(5)
        clock.now = 619.0
        assert not m.should_save(6)
        clock.now = 620.0
        assert m.should_save(7)
        clock.now = 10_000.0
        assert m.should_save(8)
        m.save(8, state=STATE)
        assert not m.should_save(8)  # the step just saved, however late it is
        assert not m.should_save(9)
        m.wait()
        assert m.all_steps() == [4, 8]


def test_steps_and_seconds_combined(ckpt_dir):
    clock = FakeClock(0.0)
    policy = SavePolicy(every_steps=10, every_seconds=30.0)
    with jaxckpt.CheckpointManager(ckpt_dir, policy=policy, clock=clock) as m:
        saved = []
        for step in range(1, 41):
            clock.now += 4.0  # one step takes 4 s
            if m.should_save(step):
                m.save(step, state=STATE)
                saved.append(step)
        # Time is due at 32 s after the last save (every 8 steps), steps at every 10th step.
        assert saved == [8, 10, 18, 20, 28, 30, 38, 40]
        m.wait()
        assert m.all_steps() == saved


def test_no_policy_never_says_save(ckpt_dir):
    clock = FakeClock()
    with jaxckpt.CheckpointManager(ckpt_dir, clock=clock) as m:
        clock.now += 1e12
        assert not any(m.should_save(step) for step in (0, 1, 10, 1000))


def test_save_policy_due_is_pure():
    policy = SavePolicy(every_steps=3, every_seconds=10)
    assert policy.due(step=3, seconds_since_last_save=0.0)
    assert policy.due(step=4, seconds_since_last_save=10.0)
    assert not policy.due(step=4, seconds_since_last_save=9.99)
    assert SavePolicy(every_steps=3).due(step=0, seconds_since_last_save=0.0)
    assert not SavePolicy().due(step=3, seconds_since_last_save=1e9)


# ------------------------------------------------------------------------------- RetentionPolicy


@pytest.mark.parametrize(
    ("policy", "committed", "deleted"),
    [
        (RetentionPolicy(), [1, 2, 3, 4, 5], []),
        (RetentionPolicy(keep_every=2), [1, 2, 3, 4, 5], []),  # keep_last=None keeps all
        (RetentionPolicy(keep_last=2), [1, 2, 3, 4, 5], [1, 2, 3]),
        (RetentionPolicy(keep_last=2), [5, 1, 4, 2, 3], [1, 2, 3]),  # any order in
        (RetentionPolicy(keep_last=1), [7], []),
        (RetentionPolicy(keep_last=3), [1, 2], []),
        (RetentionPolicy(keep_last=1), [], []),
        (RetentionPolicy(keep_last=2, keep_every=4), list(range(1, 11)), [1, 2, 3, 5, 6, 7]),
        (RetentionPolicy(keep_last=2, keep_every=4), [4, 8, 9, 10, 11], [9]),
        (RetentionPolicy(keep_last=1, keep_every=1000), [500, 1000, 1500, 2000, 2100], [500, 1500]),
        (RetentionPolicy(keep_last=2, keep_every=5), [0, 3, 5, 7], [3]),  # 0 % 5 == 0: kept
    ],
)
def test_steps_to_delete(policy, committed, deleted):
    original = list(committed)
    assert policy.steps_to_delete(committed) == deleted
    assert committed == original  # the caller's list is not mutated
    assert policy.steps_to_delete(iter(committed)) == deleted  # any iterable


def test_steps_to_delete_never_deletes_the_newest():
    for keep_last in (1, 2, 5):
        for keep_every in (None, 3):
            policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every)
            for n in range(1, 12):
                steps = list(range(n))
                deleted = policy.steps_to_delete(steps)
                assert steps[-1] not in deleted
                assert set(deleted) <= set(steps)
                kept = [s for s in steps if s not in deleted]
                assert kept[-keep_last:] == steps[-keep_last:]


# ------------------------------------------------------------------------------- applied


def test_retention_applied_by_the_manager(ckpt_dir):
    retention = RetentionPolicy(keep_last=2, keep_every=4)
    with jaxckpt.CheckpointManager(ckpt_dir, retention=retention) as m:
        for step in range(1, 11):
            m.save(step, state={"x": np.full(3, step, np.int32)}, meta={"step": step})
        m.wait()
        assert m.all_steps() == [4, 8, 9, 10]
        assert m.latest_step() == 10
        for step in m.all_steps():
            restored = m.restore(step, state={"x": np.zeros(3, np.int32)})
            np.testing.assert_array_equal(restored.state["x"], np.full(3, step, np.int32))
            assert restored.meta == {"step": step}
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [
        ".jaxckpt-writer.lock",
        "10",
        "4",
        "8",
        "9",
    ]
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        assert m.all_steps() == [4, 8, 9, 10]


def test_retention_is_applied_on_close(ckpt_dir):
    with jaxckpt.CheckpointManager(ckpt_dir, retention=RetentionPolicy(keep_last=1)) as m:
        m.save(1, state=STATE)
        m.save(2, state=STATE)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [".jaxckpt-writer.lock", "2"]


def test_retention_spans_managers(ckpt_dir):
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        for step in (1, 2, 3):
            m.save(step, state=STATE)
    with jaxckpt.CheckpointManager(ckpt_dir, retention=RetentionPolicy(keep_last=2)) as m:
        m.save(4, state=STATE)
        m.wait()
        assert m.all_steps() == [3, 4]


def _tree(directory):
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def test_folders_jaxckpt_did_not_write_are_never_deleted(ckpt_dir):
    # Steps plain Orbax wrote are listed and restored, never deleted; other folders are
    # neither listed nor touched.
    ckpt_dir.mkdir(parents=True)
    # A folder named like a step, made by hand.
    (ckpt_dir / "7").mkdir()
    (ckpt_dir / "7" / "keep.txt").write_text("mine")
    # A random folder and a stray file.
    (ckpt_dir / "notes").mkdir()
    (ckpt_dir / "notes" / "todo.md").write_text("x")
    (ckpt_dir / "README").write_text("hello")
    # Checkpoints written by plain Orbax, below and above jaxckpt's steps.
    with ocp.CheckpointManager(ckpt_dir, item_names=("state",)) as orbax:
        for step in (3, 50):
            orbax.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave({"a": np.ones(2)})),
                force=True,
            )
    foreign = {name: _tree(ckpt_dir / name) for name in ("7", "notes", "3", "50")}
    assert foreign["3"] and foreign["50"]  # Orbax did write them

    retention = RetentionPolicy(keep_last=2, keep_every=4)
    with jaxckpt.CheckpointManager(ckpt_dir, retention=retention) as m:
        assert m.all_steps() == [3, 50] and m.latest_step() == 50
        for step in (1, 2, 4, 5, 6, 8, 9, 10, 11):
            m.save(step, state={"x": np.full(2, step)})
        m.wait()
        assert m.all_steps() == [3, 4, 8, 10, 11, 50]
        with pytest.raises(jaxckpt.errors.StepNotFoundError, match=r"step 7 .*3, 4, 8, 10, 11, 50"):
            m.restore(7)
        np.testing.assert_array_equal(m.restore(50).state["a"], np.ones(2))
        np.testing.assert_array_equal(m.restore(11).state["x"], np.full(2, 11))

    names = sorted(p.name for p in ckpt_dir.iterdir())
    assert names == sorted(
        [".jaxckpt-writer.lock", "3", "4", "7", "8", "10", "11", "50", "README", "notes"]
    )
    for name, files in foreign.items():
        assert _tree(ckpt_dir / name) == files, name
    assert (ckpt_dir / "7" / "keep.txt").read_text() == "mine"
    assert (ckpt_dir / "README").read_text() == "hello"

    # Reopening (which cleans up Orbax's temporary folders) leaves them alone as well.
    with jaxckpt.CheckpointManager(ckpt_dir, retention=RetentionPolicy(keep_last=1)) as m:
        assert m.all_steps() == [3, 4, 8, 10, 11, 50]
        m.save(12, state={"x": np.zeros(2)})
        m.wait()
        assert m.all_steps() == [3, 12, 50]
    names = sorted(p.name for p in ckpt_dir.iterdir())
    assert names == sorted([".jaxckpt-writer.lock", "3", "7", "12", "50", "README", "notes"])
    for name, files in foreign.items():
        assert _tree(ckpt_dir / name) == files, name


def test_retention_deletes_in_the_background_and_finishes_leftovers(ckpt_dir):
    """A deleted step leaves the listing at once (renamed), its files go in a worker thread;
    a deletion a killed run left half done is finished by the next manager."""
    big = {"x": np.zeros((256, 1024), np.float32)}
    with jaxckpt.CheckpointManager(ckpt_dir, retention=RetentionPolicy(keep_last=1)) as m:
        m.save(1, state=big)
        m.save(2, state=big)  # step 1 is committed now: deleted when step 2 is
        m.wait()
        assert m.all_steps() == [2]
        assert not (ckpt_dir / "1").exists()
        m.save(3, state=big)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [".jaxckpt-writer.lock", "3"]

    # What a kill during a deletion leaves behind: a renamed, partly removed step.
    leftover = ckpt_dir / "2.jaxckpt-deleting"
    (leftover / "state").mkdir(parents=True)
    (leftover / "state" / "d").write_bytes(b"x" * 100)
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        assert m.all_steps() == [3]
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [".jaxckpt-writer.lock", "3"]
    # A reader never deletes anything.
    leftover.mkdir()
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True) as m:
        assert m.all_steps() == [3]
    assert leftover.exists()
