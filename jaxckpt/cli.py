"""The `jaxckpt` command line: what is in a checkpoint, on any machine.

    jaxckpt ls DIR [--verify]                       steps, times, sizes, status
    jaxckpt inspect DIR [--step N] [--filter RE]     leaves: shape, dtype, saved sharding
    jaxckpt inspect DIR --data                       each process's data-iterator state
    jaxckpt diff DIR STEP_A STEP_B [--values]        or: jaxckpt diff DIR_A DIR_B
    jaxckpt plan DIR --mesh 2x4 [--hosts 2]          restore dry-run onto another mesh
    jaxckpt verify DIR [--step N]                    checksums of every file
    jaxckpt export DIR OUT [--names MAP.yaml]        Hugging Face safetensors
                   [--include RE] [--exclude RE]     (only some leaves)
    jaxckpt rm DIR STEP [--force]                    delete a step, as the directory's writer

Everything reads metadata (and, for `verify`, `diff --values` and `export`, the data) on the
host: JAX runs on CPU devices, never an accelerator; only `rm` writes (under the writer's
lock). `--json` prints one JSON document, an error included. Progress bars go to stderr on
a terminal only (never with `-q/--quiet` or in logs). Bad input is one line on stderr,
`jaxckpt: error: ...`, and exit status 2 for a usage error, 1 for any other: never a
traceback. `diff` exits like diff(1): 0 the same, 1 different, 2 trouble. Names, paths and strings
read from a checkpoint are printed with control characters escaped (`jaxckpt._escape`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import click

from jaxckpt._escape import Formatter, escape, escape_markup
from jaxckpt._storage import is_remote
from jaxckpt.errors import ConfigError, CorruptCheckpointError, JaxckptError, NoCheckpointError

# The exit status: 0 done, 1 an error (what was asked for failed or is not there), 2 a
# usage error (an unknown command or option, an option value that cannot be right).
# `diff` follows diff(1) instead: 0 the same, 1 different, 2 trouble (any error).
EXIT_ERROR, EXIT_USAGE = 1, 2

# Library messages name the Python arguments that fix a problem (`overwrite=True`); here
# each becomes what a CLI user types or does instead. tests/test_cli_messages.py raises every
# one of these errors through the CLI, so a reworded library message fails a test rather
# than leaking a Python argument into the CLI's output.
CLI_WORDS = (
    # OutputExistsError (jaxckpt.hf._files)
    ("choose another directory or pass overwrite=True", "choose another OUT or pass --overwrite"),
    # StepNotFoundError (jaxckpt.errors)
    (
        "Pass one of them, or step=None for the latest.",
        "Pass one of them (commands without --step use the latest).",
    ),
    # CorruptCheckpointError (jaxckpt.errors)
    (
        "Restore another step, or pass fallback=True to restore the newest step that verifies.",
        "Use another step (--step N); `jaxckpt ls DIR --verify` shows which steps verify.",
    ),
    # UnsupportedValueError (jaxckpt.hf._files.SKIP_HINT)
    (
        "leave them out with exclude=, drop them in the name map, or pass skip_unsupported=True",
        "leave them out with --exclude, drop them in the name map, or omit --no-skip-unsupported",
    ),
    # LockedError (jaxckpt._lock)
    (
        "Stop that job first, or open this one with read_only=True to restore.",
        "Stop that job first (only `jaxckpt rm` needs the lock; the other commands read).",
    ),
)


class _Group(click.Group):
    """One-line errors: jaxckpt's, missing files, and click's usage errors; with --json,
    one JSON object on stdout instead. Never a traceback."""

    def main(self, args=None, prog_name=None, **kwargs):
        # Run as a program (no args given), the CLI owns the process's logging; called
        # in-process (tests, CliRunner) it leaves the caller's handlers alone.
        kwargs.setdefault("obj", {})["own_logging"] = args is None
        args = list(sys.argv[1:] if args is None else args)
        # The group's own options are flags, so the first other word names the command.
        command = next((a for a in args if not a.startswith("-")), None)
        words = args[: args.index("--")] if "--" in args else args
        as_json = "--json" in words[words.index(command) :] if command in words else False
        trouble = EXIT_USAGE if command == "diff" else EXIT_ERROR
        try:
            code = super().main(args, prog_name or "jaxckpt", standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help() if e.ctx else str(e))
            code = 0
        except click.UsageError as e:
            code = _fail(e.format_message(), e, EXIT_USAGE, as_json)
        except click.ClickException as e:
            code = _fail(e.format_message(), e, trouble, as_json)
        except click.exceptions.Abort:
            _say("jaxckpt: aborted", err=True)
            code = 130
        except (JaxckptError, OSError) as e:
            message = str(e)
            for python, cli in CLI_WORDS:
                message = message.replace(python, cli)
            code = _fail(message, e, trouble, as_json)
        sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str, error: BaseException, code: int, as_json: bool) -> int:
    if as_json:
        click.echo(json.dumps({"error": message, "type": type(error).__name__}))
    else:
        _say(f"jaxckpt: error: {message}", err=True)  # one line: a newline in it escaped
    return code


def _say(text: str, err: bool = False) -> None:
    """Prints a line that may hold names, paths, meta or an error, control and bidi
    characters escaped: no terminal escape, no newline forging a line (JSON escapes --json)."""
    click.echo(escape(text), err=err)


def _set_quiet(ctx: click.Context, _param, quiet: bool) -> None:
    obj = ctx.find_root().ensure_object(dict)
    if quiet:
        obj["quiet"] = True
        if obj.get("own_logging"):  # after the command: the group already set WARNING
            logging.getLogger().setLevel(logging.ERROR)


# `-q` is accepted before the command (`jaxckpt -q verify DIR`) and after it alike.
QUIET_OPTION = click.option(
    "-q",
    "--quiet",
    is_flag=True,
    expose_value=False,
    callback=_set_quiet,
    help="Only errors: no progress bars, no notes.",
)


@click.group(cls=_Group)
@QUIET_OPTION
@click.pass_context
def main(ctx: click.Context) -> None:
    """Inspect, compare, verify, plan and export jaxckpt checkpoints."""
    obj = ctx.ensure_object(dict)
    obj.setdefault("quiet", False)
    # (Orbax's absl logging installs a default handler on import: replaced when ours.)
    handler = logging.StreamHandler()
    handler.setFormatter(Formatter("%(message)s"))  # notes escaped, as all output is
    logging.basicConfig(
        level=logging.ERROR if obj["quiet"] else logging.WARNING,
        handlers=[handler],
        force=obj.get("own_logging", False),
    )
    logging.getLogger("absl").setLevel(logging.ERROR)


# ------------------------------------------------------------------------------------ helpers


def _cpu(devices: int | None = None) -> None:
    """Host-only JAX (before any device is used): checkpoints are read on CPU devices."""
    import jax

    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")
    if devices:
        try:
            jax.config.update("jax_num_cpu_devices", devices)
        except RuntimeError:  # JAX already runs (in-process use): enough devices will do
            if len(jax.devices()) < devices:
                raise ConfigError(
                    f"this process has {len(jax.devices())} devices, the mesh needs {devices}"
                ) from None


def _store(directory: str, lock=None) -> contextlib.closing:
    """A read-only view of a checkpoint directory, closed on leaving the `with`; a clear
    error when there is none. `lock`: the writer's lock that `rm` holds."""
    from jaxckpt import _orbax

    _need_dir(directory)
    return contextlib.closing(_orbax.OrbaxStore(directory, read_only=True, lock=lock))


def _need_dir(directory: str) -> None:
    """A clear error for a local checkpoint directory that is not there."""
    if not is_remote(directory) and not os.path.isdir(directory):
        raise NoCheckpointError(f"{directory}: no such checkpoint directory")


def _info(directory: str, step: int | None, item: str | None = None) -> tuple[Any, Any, str]:
    """The directory's path, the step's metadata (`StepInfo`; step None: the latest
    committed) and which of its trees `item` names: of a jaxckpt step "state" or "rng"
    (None: state), of a plain Orbax step its pytree item (None: its only one)."""
    from jaxckpt import _layout

    with _store(directory) as store:
        step = store.scan().resolve(step)
        if not store.is_orbax(step):
            _check_item(item or _layout.STATE)
        return store.directory, *store.tree(step, item)


def _check_item(item: str) -> None:
    from jaxckpt import _layout

    if item not in _layout.ITEMS:
        raise click.BadParameter(
            f"no item {item!r}; the step holds {list(_layout.ITEMS)}", param_hint="--item"
        )


def _du(path) -> tuple[int, int]:
    """Bytes and files below `path`: a step's size as `ls` and `verify` both report it,
    every file in its folder (jaxckpt's manifest and Orbax's commit files included). One
    listing per folder: fine on object storage too; locally links are counted as
    themselves, never followed."""
    size = files = 0
    if not is_remote(path):
        for folder, _, names in os.walk(path):
            for name in names:
                with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                    size, files = size + os.lstat(os.path.join(folder, name)).st_size, files + 1
        return size, files
    stack = [path]
    while stack:
        for p in stack.pop().iterdir():
            if p.is_dir():
                stack.append(p)
            else:
                size, files = size + p.stat().length, files + 1
    return size, files


def _table(header: list[str], rows: list[list[str]]) -> None:
    rows = [[escape(c) for c in row] for row in [header, *rows]]  # widths as printed
    widths = [max(len(c) for c in col) for col in zip(*rows, strict=True)]
    for row in rows:
        _say("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _json(doc: Any) -> None:
    from jaxckpt._tree import strict_json  # a NaN in meta= is the string "NaN" here

    click.echo(json.dumps(strict_json(doc), indent=1, allow_nan=False))


@contextlib.contextmanager
def _progress(description: str) -> Iterator:
    """`update(key, done, total)` drives one bar per key; silent unless stderr is a terminal
    and `--quiet` was not given."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    quiet = click.get_current_context().find_root().obj["quiet"] or not sys.stderr.isatty()
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn())
    with Progress(
        *columns,
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=quiet,
        transient=True,
    ) as bars:
        tasks: dict = {}

        def update(key, done: int, total: int) -> None:
            if key not in tasks:
                text = escape_markup(description.format(key=key))  # rich reads markup
                tasks[key] = bars.add_task(text, total=total)
            bars.update(tasks[key], completed=done, total=total)

        yield update


def _regex(pattern: str) -> re.Pattern:
    """A leaf-name regex (inspect --filter, export --include/--exclude); a usage error."""
    try:
        return re.compile(pattern)
    except re.error as e:
        raise click.BadParameter(f"{pattern!r} is not a regular expression: {e}") from None


def _count(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def _axis_names(mesh: str, shape: tuple[int, ...], axes: str | None, saved: tuple) -> tuple:
    """`--axes` (default: the saved mesh's axis names): one distinct name per axis of
    `--mesh`."""
    n = _count(len(shape), "axis", "axes")
    if axes:
        names = tuple(axes.split(","))
        problem = f"--axes {axes} gives {_count(len(names), 'name')} for the {n} of --mesh {mesh}"
    elif saved:
        names = saved
        problem = f"--mesh {mesh} has {n}, the saved mesh {len(saved)} ({','.join(saved)})"
    else:
        names = ()
        problem = f"--mesh {mesh} has {n} and the checkpoint saved no mesh to name them after"
    if len(names) != len(shape):
        candidates = (*names, "data", "model", *(f"axis{i}" for i in range(len(shape))))
        example = ",".join(list(dict.fromkeys(c for c in candidates if c))[: len(shape)])
        raise click.BadParameter(
            f"{problem}; give one name per axis with --axes, comma-separated "
            f"(e.g. --axes {example})"
        )
    if "" in names or len(set(names)) != len(names):
        raise click.BadParameter(f"--axes {axes} must name each axis once, e.g. --axes data,model")
    return names


# `plan` makes one CPU device per mesh device: 4,096 take ~6 s and ~0.65 GB here, 16,384
# over two minutes (and 100,000 exhaust the address space).
MAX_PLAN_DEVICES = 4096

JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON.")
DIR = click.argument("checkpoint_dir", metavar="DIR")


# ----------------------------------------------------------------------------------- commands


@main.command("ls")
@QUIET_OPTION
@DIR
@click.option("--verify", "check", is_flag=True, help="Verify each step's checksums too.")
@JSON_OPTION
def ls(checkpoint_dir: str, check: bool, as_json: bool) -> None:
    """The steps of a checkpoint directory: time, size, status; the latest marked *."""
    _cpu()
    from jaxckpt import _integrity, _layout
    from jaxckpt._plan import size_text

    rows = []
    with _store(checkpoint_dir) as store, _progress("verify step {key}") as update:
        listing = store.scan()
        for step in sorted({*listing.folders, *listing.committed}):
            if step in listing.damaged:
                rows.append(_status_row(step, f"damaged: {listing.damaged[step]}"))
            if step not in listing.committed:
                continue
            try:
                infos = [store.info(step, i) for i in _pytree_items(listing, step)]
            except (CorruptCheckpointError, FileNotFoundError) as e:
                problems = getattr(e, "problems", [f"{_layout.INFO_PATH} is gone"])
                rows.append(_status_row(step, f"damaged: {'; '.join(problems)}"))
                continue
            orbax = step in listing.orbax
            status = "committed (plain Orbax: not checksummed)" if orbax else "committed"
            if check:
                if orbax:
                    report = _integrity.verify(listing.directory, step, progress=update)[0]
                    status = "readable (not checksummed)" if report.ok else "UNREADABLE"
                else:
                    report = _integrity.verify_step(listing.folders[step], step, progress=update)
                    status = "verified" if report.ok else "CORRUPT"
            size, files = _du(store.step_dir(step))
            rows.append(
                {
                    "step": step,
                    "written_by": "orbax" if orbax else "jaxckpt",
                    "saved_at": infos[0].saved_at,
                    "bytes": size,
                    "files": files,
                    "leaves": sum(len(info.state) for info in infos),
                    "status": status,
                    "latest": step == listing.committed[-1],
                }
            )
    for step in listing.uncommitted:
        status = "uncommitted (a save in progress or one that never finished)"
        rows.append(_status_row(step, status))
    if as_json:
        _json({"directory": checkpoint_dir, "steps": rows, "unreadable": _unreadable(listing)})
        return
    _warn_unreadable(listing)
    if not rows:
        _say(f"{checkpoint_dir}: no steps")
        return
    _table(
        ["", "step", "saved at (UTC)", "size", "files", "leaves", "status"],
        [
            [
                "*" if r["latest"] else "",
                str(r["step"]),
                (r.get("saved_at") or "-")[:19].replace("T", " "),
                size_text(r["bytes"]) if "bytes" in r else "-",
                str(r.get("files", "-")),
                str(r.get("leaves", "-")),
                r["status"],
            ]
            for r in sorted(rows, key=lambda r: r["step"])
        ],
    )


def _unreadable(listing) -> list[dict]:
    """The step-like folders no one can read, and why: for --json."""
    return [{"folder": n, "why": why} for n, why in sorted(listing.unreadable.items())]


def _warn_unreadable(listing) -> None:
    """The step-like folders no one can read, and why, on stderr (ls and verify)."""
    for name, why in sorted(listing.unreadable.items()):
        _say(f"{name}: not a step jaxckpt can read: {why}", err=True)


def _pytree_items(listing, step: int) -> list[str | None]:
    """The items `ls` counts the leaves of: a jaxckpt step's state, each pytree item of a
    step plain Orbax wrote."""
    found = listing.orbax.get(step)
    return found.items_of("pytree") if found else [None]


def _status_row(step: int, status: str) -> dict:
    """An `ls` row of a step that is not a readable committed one: its status only."""
    return {"step": step, "status": status, "latest": False}


ITEM_OPTION = click.option(
    "--item",
    help="state (the default) or rng; of a step plain Orbax wrote, its pytree item "
    "(default: its only one).",
)


@main.command()
@QUIET_OPTION
@DIR
@click.option("--step", type=int, help="Step to inspect (default: the latest committed).")
@ITEM_OPTION
@click.option(
    "--filter", "patterns", metavar="REGEX", multiple=True, help="Only leaves whose name matches."
)
@click.option(
    "--data",
    "show_data",
    is_flag=True,
    help="Each process's saved data-iterator state, instead of the leaves.",
)
@JSON_OPTION
def inspect(checkpoint_dir, step, item, patterns, show_data, as_json):
    """The leaves of a step: path, shape, dtype, saved sharding, bytes; or with --data each
    process's data-iterator state. Reads metadata only (small JSON files)."""
    _cpu()
    wanted = [_regex(p) for p in patterns]  # repeated: a leaf any of them matches
    from jaxckpt import _layout
    from jaxckpt._plan import size_text

    path, info, which = _info(checkpoint_dir, step, item)
    specs = [s for s in info.leaves(which) if not wanted or any(r.search(s.name) for r in wanted)]
    total = sum(s.nbytes for s in specs)
    states = _layout.read_data_states(path, info) if show_data else None
    if as_json:
        doc = {
            "step": info.step,
            "item": info.item if info.orbax else which,
            "written_by": "orbax" if info.orbax else "jaxckpt",
            "saved_at": info.saved_at,
            "process_count": info.process_count,
            "data": info.data,
            "meta": info.meta,
            "leaves": [dict(s.to_json(), bytes=s.nbytes) for s in specs],
            "bytes": total,
        }
        if show_data:
            doc["data_states"] = states
        _json(doc)
        return
    if info.orbax:
        items = ", ".join(f"{n} ({k})" for n, k in sorted(info.orbax.items.items()))
        _say(
            f"step {info.step} of {checkpoint_dir}, written by plain Orbax (no manifest: not "
            f"checksummed); items: {items}; the leaves of {info.item}:"
        )
    else:
        _say(
            f"step {info.step} of {checkpoint_dir}, saved {(info.saved_at or '?')[:19]} by "
            f"{info.process_count or '?'} process(es), jax {info.versions.get('jax', '?')}"
        )
    if states is not None:
        if not states:
            _say("no data-iterator state: the step was saved without a data iterator")
        for s in states:
            _say(f"process {s['process']} of {s['processes']}: {json.dumps(s['state'])}")
        return
    if info.data:
        _say("data-iterator state: saved by each process (show it with --data)")
    if info.meta is not None:
        _say(f"meta: {json.dumps(info.meta)[:200]}")
    _table(
        ["leaf", "shape", "dtype", "saved sharding", "bytes"],
        [[s.name, str(tuple(s.shape)), s.dtype, s.layout, f"{s.nbytes:,}"] for s in specs],
    )
    _say(f"{len(specs)} leaves, {total:,} bytes ({size_text(total)})")


@main.command()
@QUIET_OPTION
@click.argument("first", metavar="DIR|DIR_A")
@click.argument("second", metavar="STEP_A|DIR_B")
@click.argument("third", metavar="[STEP_B]", required=False)
@click.option(
    "--item",
    default="state",
    show_default=True,
    help="state or rng; of a step plain Orbax wrote, its pytree item (state: its only one).",
)
@click.option("--values", is_flag=True, help="Read both and report max |a - b| per leaf.")
@JSON_OPTION
def diff(first: str, second: str, third: str | None, item: str, values: bool, as_json: bool):
    """Two steps of one directory (DIR STEP_A STEP_B) or the latest steps of two
    directories (DIR_A DIR_B): leaves added, removed, changed in shape or dtype, and with
    --values the largest absolute difference of each leaf."""
    _cpu()
    from jaxckpt._diff import diff as diff_steps

    dir_b, step_a, step_b = second, None, None
    if third is not None:
        try:
            dir_b, step_a, step_b = first, int(second), int(third)
        except ValueError:
            raise click.BadParameter(
                f"with three arguments, STEP_A and STEP_B are step numbers: got {second!r}, "
                f"{third!r}"
            ) from None
    _need_dir(first)
    _need_dir(dir_b)
    with _progress("compare {key}") as update:
        found = diff_steps(
            first,
            dir_b,
            step_a=step_a,
            step_b=step_b,
            item=item,
            values=values,
            progress=lambda done, total: update("values", done, total),
        )
    a, b, differing = found.a, found.b, found.differing

    def describe(spec) -> str:
        return f"{tuple(spec.shape)} {spec.dtype}"

    # diff(1)'s exit status: 0 the same, 1 different (in the tree and, with --values, in a
    # value), 2 trouble (the group's handler).
    if as_json:
        _json(
            {
                "a": {"directory": first, "step": found.steps[0]},
                "b": {"directory": dir_b, "step": found.steps[1]},
                "item": item,
                "added": found.added,
                "removed": found.removed,
                "changed": {n: [describe(a[n]), describe(b[n])] for n in found.changed},
                "max_abs_diff": found.max_abs_diff,
                "identical": not found.different if values else None,
                "different": found.different,
            }
        )
    else:
        _say(
            f"a: {first} step {found.steps[0]}; b: {dir_b} step {found.steps[1]} ({item}, "
            f"{len(a)} and {len(b)} leaves)"
        )
        for name in found.added:
            _say(f"  added    {name}  {describe(b[name])}")
        for name in found.removed:
            _say(f"  removed  {name}  {describe(a[name])}")
        for name in found.changed:
            _say(f"  changed  {name}  {describe(a[name])} -> {describe(b[name])}")
        for name, d in differing.items():
            _say(f"  values   {name}  max |a - b| = {d:.6g}")
        added, removed, changed = len(found.added), len(found.removed), len(found.changed)
        summary = f"{added} added, {removed} removed, {changed} changed in shape/dtype"
        if values:
            largest = max(differing.values(), default=0.0)
            summary += (
                f", {len(differing)} of {len(found.max_abs_diff)} differ in value "
                f"(largest |a - b|: {largest:.6g})"
            )
        _say(summary)
    if found.different:
        click.get_current_context().exit(1)


@main.command()
@QUIET_OPTION
@DIR
@click.option("--mesh", required=True, help="Target mesh shape, e.g. 2x4.")
@click.option("--axes", help="Its axis names, e.g. data,model (default: the saved mesh's).")
@click.option("--hosts", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--step", type=int, help="Step to plan (default: the latest committed).")
@ITEM_OPTION
@click.option(
    "--inflight-bytes",
    type=click.IntRange(min=1),
    help="The restore's read budget (restore_inflight_bytes; default: a quarter of this "
    "machine's memory, as the manager's default).",
)
@JSON_OPTION
def plan(checkpoint_dir, mesh, axes, hosts, step, item, inflight_bytes, as_json) -> None:
    """Restore dry-run onto another mesh: bytes each host reads and its peak memory.

    Each leaf keeps its saved PartitionSpec where the target mesh has those axes and they
    divide the leaf; otherwise it is planned replicated (and counted). Hosts hold the
    mesh's devices in equal consecutive groups; device memory is not host memory here.
    """
    try:
        shape = tuple(int(n) for n in mesh.lower().split("x"))
        if not shape or min(shape) < 1:
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"--mesh must look like 2x4, got {mesh!r}") from None
    devices = math.prod(shape)
    if devices > MAX_PLAN_DEVICES:
        raise click.BadParameter(
            f"--mesh {mesh} has {devices:,} devices; plan simulates each device of the mesh "
            f"on this machine's CPU, which takes minutes and gigabytes past "
            f"{MAX_PLAN_DEVICES:,}. Plan a mesh of at most {MAX_PLAN_DEVICES:,} devices with "
            "the same devices per host (e.g. a few of its hosts' worth)."
        )
    if devices % hosts:
        raise click.BadParameter(f"--hosts {hosts} does not divide the {devices} devices")
    _cpu(devices)
    import jax
    import numpy as np

    from jaxckpt._plan import auto_inflight_bytes, plan_reads
    from jaxckpt._targets import requests_on_mesh

    _, info, which = _info(checkpoint_dir, step, item)
    leaves = info.leaves(which)
    saved_axes = next((tuple(s.sharding["mesh"]) for s in leaves if s.spec is not None), ())
    names = _axis_names(mesh, shape, axes, saved_axes)
    target_mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]).reshape(shape), names)
    sizes = dict(zip(names, shape, strict=True))
    requests, replicated = requests_on_mesh(leaves, target_mesh)
    result = plan_reads(
        info.step,
        requests,
        inflight_bytes=inflight_bytes or auto_inflight_bytes(),
        processes=hosts,
        devices_on_host=False,
    )
    if as_json:
        _json(
            {
                "step": result.step,
                "mesh": sizes,
                "hosts": hosts,
                "leaves": result.leaves,
                "saved_bytes": result.saved_bytes,
                "planned_replicated": replicated,
                "processes": [dataclasses.asdict(p) for p in result.processes],
            }
        )
        return
    _say(f"onto mesh {' x '.join(f'{k}={v}' for k, v in sizes.items())}, {hosts} host(s)")
    for line in str(result).splitlines():
        _say(line)
    if replicated:
        _say(
            f"{len(replicated)} leaves planned replicated (their saved spec does not fit "
            f"this mesh): {', '.join(replicated[:5])}{' ...' if len(replicated) > 5 else ''}"
        )


@main.command()
@QUIET_OPTION
@DIR
@click.argument("out_dir", metavar="OUT")
@click.option("--step", type=int, help="Step to export (default: the latest committed).")
@click.option(
    "--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), help="Cast floating tensors."
)
@click.option(
    "--max-shard-size", default="5GB", show_default=True, help="Per-file limit (5GB = 5e9 bytes)."
)
@click.option(
    "--names", type=click.Path(dir_okay=False, exists=True), help="Name map YAML (configs/hf/)."
)
@click.option(
    "--include",
    metavar="REGEX",
    multiple=True,
    help="Only leaves whose name matches (as inspect --filter; repeated: any).",
)
@click.option(
    "--exclude", metavar="REGEX", multiple=True, help="Leave out leaves whose name matches."
)
@click.option(
    "--skip-unsupported/--no-skip-unsupported",
    default=True,
    show_default=True,
    help="Skip leaves safetensors cannot hold (PRNG keys, int4, complex128...), each named "
    "on stderr; or refuse them.",
)
@click.option("--overwrite", is_flag=True, help="Replace a non-empty OUT.")
@click.option(
    "--item", help="Of a step plain Orbax wrote, its pytree item (default: its only one)."
)
@click.option(
    "--format",
    "kind",
    type=click.Choice(["safetensors", "orbax"]),
    default="safetensors",
    show_default=True,
    help="orbax: the state tree as a plain Orbax checkpoint (ocp.StandardCheckpointer's).",
)
@JSON_OPTION
def export(checkpoint_dir, out_dir, kind, as_json, **options):
    """Export a checkpoint's state to Hugging Face-style sharded safetensors, or to a plain
    Orbax checkpoint (--format orbax)."""
    _cpu()
    from jaxckpt import export_orbax, export_safetensors

    for pattern in (*options["include"], *options["exclude"]):
        _regex(pattern)
    _need_dir(checkpoint_dir)
    if kind == "orbax":
        unused = [f"--{k}" for k in ("names", "dtype", "include", "exclude") if options[k]]
        unused += [] if options["skip_unsupported"] else ["--no-skip-unsupported"]
        if unused:
            raise click.BadParameter(f"{', '.join(unused)}: only with --format safetensors")
        keep = ("step", "overwrite", "item")
        exported = export_orbax(checkpoint_dir, out_dir, **{k: options[k] for k in keep})
        if as_json:
            _json({"step": exported, "out_dir": str(out_dir), "format": "orbax"})
        else:
            _say(f"exported step {exported} as a plain Orbax checkpoint to {out_dir}")
        return
    with _progress("export") as update:
        result = export_safetensors(
            checkpoint_dir, out_dir, progress=lambda d, t: update("export", d, t), **options
        )
    if as_json:
        _json(dict(dataclasses.asdict(result), out_dir=str(result.out_dir)))
        return
    _say(
        f"exported step {result.step}: {result.tensors} tensors, {result.total_size:,} bytes "
        f"in {len(result.files)} file(s) to {result.out_dir}"
    )


@main.command()
@QUIET_OPTION
@DIR
@click.option("--step", type=int, help="Verify only this step.")
@JSON_OPTION
def verify(checkpoint_dir, step, as_json) -> None:
    """Check every file of every step against its manifest; exit 1 on any problem."""
    _cpu()
    from jaxckpt._integrity import verify as verify_dir

    _need_dir(checkpoint_dir)
    with _progress("verify step {key}") as update:
        reports = verify_dir(checkpoint_dir, step, progress=update)
    with _store(checkpoint_dir) as store:
        listing = store.scan()
        # Sizes as `ls` shows them: every file of the step (the manifest checks all but
        # itself and Orbax's two commit files, which Orbax rewrites as it commits).
        sizes = {r.step: _du(store.step_dir(r.step)) for r in reports}
    if not reports:
        from jaxckpt._layout import no_checkpoint

        raise no_checkpoint(checkpoint_dir, listing.unreadable, listing.uncommitted)
    bad = [r.step for r in reports if not r.ok]
    if as_json:
        _json(
            {
                "ok": not bad,
                "steps": [
                    {
                        "step": r.step,
                        "files": sizes[r.step][1],
                        "bytes": sizes[r.step][0],
                        "problems": r.problems,
                        "checksummed": r.checksummed,
                    }
                    for r in reports
                ],
                "unreadable": _unreadable(listing),
            }
        )
    else:
        _warn_unreadable(listing)
        for r in reports:
            if r.ok and not r.checksummed:
                _say(
                    f"step {r.step}: readable, NOT checksummed (plain Orbax wrote it: no "
                    f"manifest; its {r.files} arrays, {r.bytes:,} bytes, were read whole)"
                )
            elif r.ok:
                size, files = sizes[r.step]
                _say(f"step {r.step}: ok ({files} files, {size:,} bytes)")
            else:
                _say(f"step {r.step}: CORRUPT")
                for problem in r.problems:
                    _say(f"  {problem}")
    if bad:
        _say(
            f"jaxckpt: error: {len(bad)} of {len(reports)} steps failed verification: {bad}",
            err=True,
        )
        sys.exit(1)


@main.command()
@QUIET_OPTION
@DIR
@click.argument("step", type=click.IntRange(min=0))
@click.option(
    "--force", is_flag=True, help="Also delete the latest committed step (refused otherwise)."
)
@JSON_OPTION
def rm(checkpoint_dir, step, force, as_json) -> None:
    """Delete one committed step, holding the directory's writer lock as a writer does.

    Refused while a training job (or another rm) holds the lock, and for the latest
    committed step unless --force: a job resuming from the directory would silently go back
    to an older step. The step leaves the listing at once (renamed, or tombstoned on gs://)
    and its files are deleted before the command returns.
    """
    _cpu()
    from jaxckpt._lock import writer_lock

    _need_dir(checkpoint_dir)
    lock = writer_lock(checkpoint_dir, lease_s=60.0)
    if lock is not None:
        lock.acquire()
    try:
        with _store(checkpoint_dir, lock) as store:  # closing waits for the files to go
            listing = store.scan()
            listing.resolve(step)
            steps = listing.committed
            if step == steps[-1] and not force:
                raise click.UsageError(
                    f"step {step} is the latest committed step in {checkpoint_dir}: a job "
                    "resuming from this directory would go back to "
                    + (f"step {steps[-2]}" if len(steps) > 1 else "no step at all")
                    + ". Pass --force to delete it all the same."
                )
            store.delete(step)
            left = store.committed_steps()
    finally:
        if lock is not None:
            lock.release()
    if as_json:
        _json({"directory": checkpoint_dir, "deleted": step, "steps": left})
        return
    rest = ", ".join(map(str, left)) or "none"
    _say(f"deleted step {step} from {checkpoint_dir}; committed steps: {rest}")
