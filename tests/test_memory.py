"""What a restore does to the process's allocator (`jaxckpt._memory`): the staging it frees
goes back to the system, and the allocator's rule is glibc's own again afterwards. And
what a compressed save holds (`jaxckpt._codec`): a few blocks, not the encoded state.

Each case runs in a fresh interpreter (glibc's threshold is process-wide, and once set
stays set) on memory the child touches and frees itself; what it reports is the kernel's
count of its resident pages (/proc/self/statm), not a timing.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from conftest import run_python
from jaxckpt import _memory

pytestmark = pytest.mark.skipif(
    _memory._glibc() is None, reason="glibc's allocator only: elsewhere the module does nothing"
)

CHILD = textwrap.dedent(
    """
    import json, os, sys
    from jaxckpt import _memory

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def churn():
        # 16 slices of 8 MiB staged and freed below a block that stays: what the heap
        # keeps of them cannot be trimmed from its top
        staged = [bytearray(os.urandom(1)) * (8 << 20) for _ in range(16)]
        kept.append(bytearray(1 << 20))
        del staged[:]

    kept = []
    warm = bytearray(16 << 20)  # a freed large block: glibc's threshold rises past 8 MiB
    del warm
    base = rss()
    case = sys.argv[1]
    if case == "plain":
        churn()
    elif case == "inside":
        with _memory.returning_freed(on_host=True):
            churn()
            held = rss() - base
    elif case == "nested":
        with _memory.returning_freed(on_host=True):
            with _memory.returning_freed(on_host=True):
                pass
            churn()
            held = rss() - base
    elif case == "after":
        with _memory.returning_freed(on_host=True):
            pass
        churn()
    elif case == "accelerators":  # staging reused from the heap, trimmed on leaving
        with _memory.returning_freed(on_host=False):
            churn()
            held = rss() - base
    elif case == "accelerators-after":
        with _memory.returning_freed(on_host=False):
            churn()
    if case in ("plain", "after", "accelerators-after"):
        held = rss() - base
    print(json.dumps(held / 2**20))
    """
)


def held_mib(case: str) -> float:
    """MiB the child still holds after staging and freeing 128 MiB (`case`: how)."""
    return json.loads(run_python("-c", CHILD, case).stdout.splitlines()[-1])


def test_staging_freed_inside_a_restore_goes_back_to_the_system():
    assert held_mib("plain") > 100  # glibc's own rule: the heap keeps what was freed
    assert held_mib("inside") < 16  # each slice was pages of its own, unmapped when freed


def test_on_accelerators_staging_is_reused_from_the_heap_and_handed_back_after():
    """Where devices have memory of their own, only staging is on the host: the heap's
    reuse keeps it warm (mapped pages would be faulted in anew for every byte), and what
    it holds when the restore ends goes back."""
    assert held_mib("accelerators") > 100  # the heap's, as glibc's rule has it
    assert held_mib("accelerators-after") < 16  # trimmed once nothing uses it


def test_the_rule_is_glibcs_own_again_once_the_last_restore_ends():
    assert held_mib("nested") < 16  # an inner restore ending leaves the outer's rule
    assert held_mib("after") > 100  # below 32 MiB, blocks come from the heap again


SAVE_CHILD = textwrap.dedent(
    """
    import json, tempfile
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import jaxckpt
    from jax.sharding import NamedSharding, PartitionSpec as P

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(r.split()[1]) * 1024 for r in f if r.startswith(key))

    sharding = NamedSharding(jax.make_mesh((4, 2), ("data", "model")), P("data", "model"))
    rng = np.random.default_rng(0)
    state = {  # 256 MiB of float32 that zstd shrinks by ~7%
        f"w{i}": jax.device_put(rng.standard_normal((1024, 4096), np.float32), sharding)
        for i in range(16)
    }
    with jaxckpt.CheckpointManager(tempfile.mkdtemp(), compression="zstd") as m:  # warm-up
        m.save(0, state={"w": jax.device_put(np.ones((64, 64), np.float32), sharding)})
    with open("/proc/self/clear_refs", "w") as f:  # the kernel's high-water mark from here
        f.write("5")
    base = status("VmRSS")
    with jaxckpt.CheckpointManager(tempfile.mkdtemp(), compression="zstd") as m:
        m.save(1, state=state)
        m.wait()
    print(json.dumps((status("VmHWM") - base) / 2**20))
    """
)


def test_a_compressed_save_holds_a_few_blocks_not_the_encoded_state():
    # each piece compressed 1 MiB at a time as it is written: ~20 MiB above the state
    # whatever its size (tensorstore's zstd, `incremental=False`, held ~230 MiB of this 256
    # MiB state until its commit); the kernel's high-water mark, not a sample
    held = json.loads(run_python("-c", SAVE_CHILD).stdout.splitlines()[-1])
    assert held < 64, held
