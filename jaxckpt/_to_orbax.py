"""Export a step as a plain Orbax checkpoint (`export_orbax`): a run that leaves jaxckpt
keeps its state in the layout Orbax itself writes."""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from etils import epath

from jaxckpt import _layout, _orbax_steps, _reader
from jaxckpt._escape import escape
from jaxckpt._read_step import Wanted
from jaxckpt._storage import absolute, is_remote
from jaxckpt.errors import ConfigError, OutputExistsError, UnsupportedValueError

log = logging.getLogger("jaxckpt")


def export_orbax(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    state: Any = None,
    overwrite: bool = False,
    item: str | None = None,
) -> int:
    """Writes a step's state tree as the plain Orbax checkpoint
    [`ocp.StandardCheckpointer`][orbax.checkpoint.StandardCheckpointer] writes, which
    `ocp.StandardCheckpointer().restore(out_dir, target)` reads; returns the step exported.
    The step is restored first (verified against its manifest), so the whole state passes
    through this process's memory: on the host without `state`, on the target's devices with
    it. The checkpoint is written beside `out_dir` and renamed into place: a failed export
    leaves `out_dir` as it was.

    >>> import jax.numpy as jnp, orbax.checkpoint as ocp, tempfile, jaxckpt
    >>> directory, out = tempfile.mkdtemp(), tempfile.mkdtemp() + "/orbax"
    >>> with jaxckpt.CheckpointManager(directory) as mngr:
    ...     mngr.save(1, state={"w": jnp.arange(3.0)})
    >>> jaxckpt.export_orbax(directory, out)  # the step exported
    1
    >>> ocp.StandardCheckpointer().restore(out)["w"].tolist()  # plain Orbax reads it
    [0.0, 1.0, 2.0]

    Args:
      checkpoint_dir: a jaxckpt checkpoint directory, or one plain Orbax wrote (only read).
      out_dir: the Orbax checkpoint to write; must not exist or be empty, unless `overwrite`.
      step: the step to export; None for the latest committed one.
      state: a restore target, as for `CheckpointManager.restore`: the tree is written with
        its node types (optax states, NNX State), so a target of those types restores it.
        None: nested dicts and lists of NumPy arrays, its empty nodes (optax's EmptyState,
        `{}`, None) written as plain Orbax writes them, so that plain Orbax restores it onto
        the live state, or without a target as it restores a checkpoint it wrote itself. (A
        step saved before jaxckpt recorded empty nodes has none: logged.)
      overwrite: replace a non-empty `out_dir`.
      item: of a step plain Orbax wrote, its pytree item (None: its only one).
    """
    out, source = epath.Path(absolute(out_dir)), epath.Path(absolute(checkpoint_dir))
    if out == source or source in out.parents or out in source.parents:
        raise ConfigError(
            f"the output {out} overlaps the checkpoint directory {source}; export elsewhere"
        )
    if is_remote(out):
        raise ConfigError(f"export_orbax writes to a local directory, not {out}")
    if os.path.islink(out) or (out.exists() and not out.is_dir()):
        raise OutputExistsError(f"{out} is not a directory; choose another output")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(
            f"{out} exists and is not empty; choose another directory or pass overwrite=True"
        )
    with _reader.open_reader(checkpoint_dir) as ckpt:
        info, tree = ckpt.describe(step, item)
        specs = info.state if info.orbax else info.leaves(tree)
        if empty := [f"{escape(s.name)} {s.shape}" for s in specs if math.prod(s.shape) == 0]:
            raise UnsupportedValueError(
                f"step {info.step} of {checkpoint_dir} holds leaves with no elements "
                f"({', '.join(empty)}), which plain Orbax cannot save (it refuses zero-size "
                "arrays): export it to safetensors, or restore it and save the tree without them"
            )
        restored = ckpt.read(info.step, Wanted(state=state, item=item), fallback=False)
        if state is None and ckpt.info(restored.step, item).empty is None:
            log.warning(
                "step %d of %s was saved before jaxckpt recorded a tree's empty nodes "
                "(optax's EmptyState, {}, None): the export has none, so plain Orbax restores "
                "it only onto a target without them. To write them, export with a target: "
                "jaxckpt.export_orbax(..., state=target)",
                restored.step,
                checkpoint_dir,
            )
    new, old = (out.parent / f".{out.name}.jaxckpt-{what}" for what in ("new", "old"))
    orbax_tmp = new.parent / f"{new.name}{_layout.TMP_SUFFIX}"  # (Orbax's, until it commits)
    for leftover in (new, old, orbax_tmp):
        if leftover.exists():
            leftover.rmtree()
    try:
        _orbax_steps.write_plain(new, restored.state)
    except BaseException:
        for leftover in (new, orbax_tmp):
            if leftover.exists():
                leftover.rmtree()
        raise
    if out.exists():
        out.rename(old)
    new.rename(out)
    if old.exists():
        old.rmtree()
    log.info(
        "exported step %d of %s to the Orbax checkpoint %s", restored.step, checkpoint_dir, out
    )
    return restored.step
