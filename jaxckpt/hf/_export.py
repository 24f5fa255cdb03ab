"""Export a checkpoint's step to Hugging Face safetensors (`export_safetensors`).

The step is read in batches of leaves (through Orbax, as host NumPy arrays, with no devices
involved; the next batch is read while the current one is written) and each tensor is
streamed into its file: peak memory is about two batches of `READ_BATCH_BYTES` (or the
largest leaf).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxckpt import _layout, _reader
from jaxckpt._match import uniform_requests
from jaxckpt._plan import read_batches
from jaxckpt._tree import KEY, LeafSpec
from jaxckpt.hf import _files
from jaxckpt.hf._names import NameMap, place_all

log = logging.getLogger("jaxckpt")

READ_BATCH_BYTES = 128 * 2**20  # export reads about this many bytes per Orbax call


def export_safetensors(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    names: NameMap | str | os.PathLike[str] | Mapping[str, Any] | None = None,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    skip_unsupported: bool = True,
    progress: Callable[[int, int], None] | None = None,
    item: str | None = None,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
) -> _files.ExportResult:
    """Exports a checkpoint's state to Hugging Face-style sharded safetensors.

    The step is verified against its manifest first (`CorruptCheckpointError` if it does
    not match), so corrupt weights are never shipped. A step plain Orbax wrote has none:
    it is exported unverified.

    >>> import jax.numpy as jnp, safetensors.numpy, tempfile, jaxckpt
    >>> directory, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> with jaxckpt.CheckpointManager(directory) as mngr:
    ...     mngr.save(1, state={"model": {"w": jnp.ones((4, 4))}})
    >>> result = jaxckpt.export_safetensors(directory, out, dtype="bfloat16")
    >>> result.files, safetensors.numpy.load_file(f"{out}/model.safetensors")["model.w"].shape
    (('model.safetensors',), (4, 4))

    Args:
      checkpoint_dir: a jaxckpt checkpoint directory, or one plain Orbax wrote (only read;
        no lock needed).
      out_dir: the output directory; must not exist or be empty, unless `overwrite`.
      step: the step to export; None for the latest committed one.
      names: a name map (YAML path, mapping or NameMap; see `jaxckpt._names`) from leaf
        names to HF tensor names, with transposes, layer splits and drops.
      dtype: cast floating-point tensors to "float32", "bfloat16" or "float16".
      max_shard_size: per-file limit, decimal units (5GB = 5e9 bytes) or binary (GiB).
      metadata: string-to-string `__metadata__` for every file (`format: pt` by default).
      overwrite: replace a non-empty `out_dir`.
      skip_unsupported: leaves safetensors cannot hold (PRNG keys, and dtypes it has no
        code for: int4, complex128, ...) are skipped with a log note naming each, and listed
        in the result's `skipped`; False makes them an error.
      progress: called with (bytes written, bytes to write) after each tensor.
      item: of a step plain Orbax wrote, its pytree item to export (None: its only one).
      include: a regex, or several, searched in each leaf's name (`params.w`): only the
        leaves one matches are exported (before the name map, which then needs no rule for
        the others). ConfigError for a pattern that matches no leaf.
      exclude: likewise, the leaves any of these matches are left out.
    """
    out_dir, cast, meta = _files.check_output(out_dir, overwrite, dtype, metadata)
    limit = _files.parse_size(max_shard_size)
    name_map = NameMap.load(names)

    with _reader.open_reader(checkpoint_dir) as ckpt:
        step = ckpt.resolve(step)
        # The files are hashed while the tensors are written to a temporary directory,
        # which is published only if they match: corrupt weights are never shipped.
        with ckpt.verified(step) as check:
            info, _ = ckpt.describe(step, item)
            by_name = _files.select({s.name: s for s in info.state}, include, exclude)
            placements = place_all(name_map, {n: s.shape for n, s in by_name.items()})
            keys = [p.leaf for p in placements if by_name[p.leaf].kind == KEY]
            unsupported = _files.cannot_hold(placements, by_name, keys, cast)
            written = [by_name[p.leaf] for p in placements if p.leaf not in unsupported]
            reader = _LeafReader(ckpt, info, written)
            try:
                files, skipped = _files.plan(
                    placements,
                    by_name,
                    unsupported,
                    cast,
                    limit,
                    skip_unsupported,
                    reader.get,
                    progress,
                )
                _files.write(out_dir, files, meta, overwrite, before_publish=check)
            finally:
                reader.close()
    done = _files.exported(out_dir, step, files, skipped)
    log.info(
        "exported step %d to %s: %d tensors in %d file(s)", step, out_dir, done.tensors, len(files)
    )
    return done


class _LeafReader:
    """Reads leaves to the host in the order an export asks for them: in batches of at
    most `READ_BATCH_BYTES` (or one larger leaf), the next batch read in a worker thread while
    the current one is written. At most two batches are held."""

    def __init__(self, ckpt: _reader.Reader, info: _layout.StepInfo, specs: list[LeafSpec]):
        requests = uniform_requests([s for s in specs if s.kind != KEY], None)  # never exported
        self._read = lambda names: ckpt.read_arrays(
            info, _layout.STATE, {n: requests[n] for n in names}
        )
        self._batches = read_batches(requests, READ_BATCH_BYTES)
        self._batch_of = {n: i for i, batch in enumerate(self._batches) for n in batch}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "jaxckpt-export-read")
        # each batch read, as NumPy arrays (the requests place nothing on devices)
        self._reads: dict[int, concurrent.futures.Future[dict[str, np.ndarray]]] = {}

    def get(self, name: str) -> np.ndarray:
        i = self._batch_of[name]
        for j in [j for j in self._reads if j < i]:
            del self._reads[j]  # consumed: leaves are asked for in order
        for j in (i, i + 1):
            if j < len(self._batches) and j not in self._reads:
                self._reads[j] = self._pool.submit(self._read, self._batches[j])
        return self._reads[i].result()[name]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._reads.clear()
