"""The commands about steps: `ls`, `inspect`, `verify`, `rm`, `copy`."""

from __future__ import annotations

import json
import sys

import click

from jaxckpt.cli._common import (
    DIR,
    ITEM_OPTION,
    JSON_OPTION,
    QUIET_OPTION,
    STORAGE_TIMEOUT_OPTION,
    disk_usage,
    main,
    need_dir,
    on_cpu,
    open_checkpoint,
    print_json,
    progress_bars,
    regex,
    say,
    step_info,
    table,
)
from jaxckpt.errors import CorruptCheckpointError


@main.command("ls")
@QUIET_OPTION
@STORAGE_TIMEOUT_OPTION
@DIR
@click.option("--verify", "check", is_flag=True, help="Verify each step's checksums too.")
@JSON_OPTION
def ls(checkpoint_dir: str, check: bool, as_json: bool) -> None:
    """The steps of a checkpoint directory: time, size, status; the latest marked *. An
    incremental step's size is its own bytes; its status names the steps it shares bytes
    with, and a retired step's the steps that keep it."""
    on_cpu()
    from jaxckpt import _incremental, _integrity, _layout
    from jaxckpt._plan import size_text

    rows = []
    with open_checkpoint(checkpoint_dir) as ckpt, progress_bars("verify step {key}") as update:
        listing = ckpt.listing()
        here = {*listing.committed, *listing.retired}  # (a step's shares must be among them)
        for step in sorted({*listing.folders, *listing.committed}):
            if step in listing.damaged:
                rows.append(_status_row(step, f"damaged: {listing.damaged[step]}"))
            if step not in listing.committed:
                continue
            try:
                infos = [ckpt.info(step, i) for i in _pytree_items(listing, step)]
            except (CorruptCheckpointError, FileNotFoundError) as e:
                problems = getattr(e, "problems", [f"{_layout.INFO_PATH} is gone"])
                rows.append(_status_row(step, f"damaged: {'; '.join(problems)}"))
                continue
            orbax = step in listing.orbax
            status = "committed (plain Orbax: not checksummed)" if orbax else "committed"
            if check:
                if orbax:
                    report = ckpt.verify(step, progress=update)[0]
                    status = "readable (not checksummed)" if report.ok else "UNREADABLE"
                else:
                    folder = listing.folders[step]
                    report = _integrity.verify_step(folder, step, progress=update)
                    processes = infos[0].process_count or 1
                    ok = report.ok and not _incremental.verify_shared(folder, processes)
                    status = "verified" if ok else "CORRUPT"
            shares = [] if orbax else sorted(_shares(listing.folders[step], step, infos[0]))
            if shares:
                status += f"; shares bytes with step(s) {', '.join(map(str, shares))}"
            if absent := [s for s in shares if s not in here]:
                status = (
                    f"INCOMPLETE: shares bytes with step(s) {', '.join(map(str, absent))}, not "
                    "in this directory (copied without them?): copy them too, or copy this "
                    "step from where it was saved with jaxckpt copy (it then stands alone)"
                )
            size, files = disk_usage(ckpt.folder(step))
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
                    "shares": shares,
                }
            )
        for step in listing.retired:
            users = [r["step"] for r in rows if step in r.get("shares", ())]
            row = _status_row(step, f"retired: kept for step(s) {', '.join(map(str, users))}")
            row["bytes"], row["files"] = disk_usage(listing.directory / str(step))
            rows.append(row)
    for step in listing.uncommitted:
        status = "uncommitted (a save in progress or one that never finished)"
        rows.append(_status_row(step, status))
    if as_json:
        print_json({"directory": checkpoint_dir, "steps": rows, "unreadable": _unreadable(listing)})
        return
    _warn_unreadable(listing)
    if not rows:
        say(f"{checkpoint_dir}: no steps")
        return
    table(
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


def _shares(folder, step: int, info) -> frozenset[int]:
    """The steps a step shares bytes with, as its packed index says (none where that cannot
    be read: verify says why)."""
    from jaxckpt import _incremental

    if not info.packed:
        return frozenset()
    try:
        return _incremental.needs(folder, step, info.process_count or 1)
    except (OSError, ValueError):
        return frozenset()


def _unreadable(listing) -> list[dict]:
    """The step-like folders no one can read, and why: for --json."""
    return [{"folder": n, "why": why} for n, why in sorted(listing.unreadable.items())]


def _warn_unreadable(listing) -> None:
    """The step-like folders no one can read, and why, on stderr (ls and verify)."""
    for name, why in sorted(listing.unreadable.items()):
        say(f"{name}: not a step jaxckpt can read: {why}", err=True)


def _pytree_items(listing, step: int) -> list[str | None]:
    """The items `ls` counts the leaves of: a jaxckpt step's state, each pytree item of a
    step plain Orbax wrote."""
    found = listing.orbax.get(step)
    return found.items_of("pytree") if found else [None]


def _status_row(step: int, status: str) -> dict:
    """An `ls` row of a step that is not a readable committed one: its status only."""
    return {"step": step, "status": status, "latest": False}


@main.command()
@QUIET_OPTION
@STORAGE_TIMEOUT_OPTION
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
    on_cpu()
    wanted = [regex(p) for p in patterns]  # repeated: a leaf any of them matches
    from jaxckpt import _layout
    from jaxckpt._plan import size_text

    path, info, which = step_info(checkpoint_dir, step, item)
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
        print_json(doc)
        return
    if info.orbax:
        items = ", ".join(f"{n} ({k})" for n, k in sorted(info.orbax.items.items()))
        say(
            f"step {info.step} of {checkpoint_dir}, written by plain Orbax (no manifest: not "
            f"checksummed); items: {items}; the leaves of {info.item}:"
        )
    else:
        say(
            f"step {info.step} of {checkpoint_dir}, saved {(info.saved_at or '?')[:19]} by "
            f"{info.process_count or '?'} process(es), jax {info.versions.get('jax', '?')}"
        )
    if states is not None:
        if not states:
            say("no data-iterator state: the step was saved without a data iterator")
        for s in states:
            say(f"process {s['process']} of {s['processes']}: {json.dumps(s['state'])}")
        return
    if info.data:
        say("data-iterator state: saved by each process (show it with --data)")
    if info.meta is not None:
        say(f"meta: {json.dumps(info.meta)[:200]}")
    table(
        ["leaf", "shape", "dtype", "saved sharding", "bytes"],
        [[s.name, str(tuple(s.shape)), s.dtype, s.layout, f"{s.nbytes:,}"] for s in specs],
    )
    say(f"{len(specs)} leaves, {total:,} bytes ({size_text(total)})")


@main.command()
@QUIET_OPTION
@STORAGE_TIMEOUT_OPTION
@DIR
@click.option("--step", type=int, help="Verify only this step.")
@JSON_OPTION
def verify(checkpoint_dir, step, as_json) -> None:
    """Check every file of every step against its manifest; exit 1 on any problem."""
    on_cpu()
    with open_checkpoint(checkpoint_dir) as ckpt:
        with progress_bars("verify step {key}") as update:
            reports = ckpt.verify(step, progress=update)
        listing = ckpt.listing()
        # Sizes as `ls` shows them: every file of the step (the manifest checks all but
        # itself and Orbax's two commit files, which Orbax rewrites as it commits).
        sizes = {r.step: disk_usage(ckpt.folder(r.step)) for r in reports}
    if not reports:
        from jaxckpt._listing import no_checkpoint

        raise no_checkpoint(checkpoint_dir, listing.unreadable, listing.uncommitted)
    bad = [r.step for r in reports if not r.ok]
    if as_json:
        print_json(
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
                say(
                    f"step {r.step}: readable, NOT checksummed (plain Orbax wrote it: no "
                    f"manifest; its {r.files} arrays, {r.bytes:,} bytes, were read whole)"
                )
            elif r.ok:
                size, files = sizes[r.step]
                say(f"step {r.step}: ok ({files} files, {size:,} bytes)")
            else:
                say(f"step {r.step}: CORRUPT")
                for problem in r.problems:
                    say(f"  {problem}")
    if bad:
        say(
            f"jaxckpt: error: {len(bad)} of {len(reports)} steps failed verification: {bad}",
            err=True,
        )
        sys.exit(1)


@main.command()
@QUIET_OPTION
@STORAGE_TIMEOUT_OPTION
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
    and its files are deleted before the command returns; a step whose bytes a kept
    incremental step shares is retired instead: its files stay until no step shares them.
    """
    on_cpu()
    from jaxckpt import CheckpointManager, PreemptionPolicy
    from jaxckpt._layout import RETIRED_SUFFIX

    need_dir(checkpoint_dir)
    # As the directory's writer (its lock held); closing waits for the files to go.
    with CheckpointManager(checkpoint_dir, preemption=PreemptionPolicy(enabled=False)) as m:
        steps = m.all_steps()
        if step in steps and step == steps[-1] and not force:
            raise click.UsageError(
                f"step {step} is the latest committed step in {checkpoint_dir}: a job "
                "resuming from this directory would go back to "
                + (f"step {steps[-2]}" if len(steps) > 1 else "no step at all")
                + ". Pass --force to delete it all the same."
            )
        m.delete(step)
        left = m.all_steps()
        # kept, out of the listing: a step shares its bytes (`_incremental`)
        retired = (m.directory / f"{step}{RETIRED_SUFFIX}").exists()
    if as_json:
        print_json(
            {"directory": checkpoint_dir, "deleted": step, "retired": retired, "steps": left}
        )
        return
    rest = ", ".join(map(str, left)) or "none"
    done = "retired (its files stay: a kept step shares its bytes)" if retired else "deleted"
    say(f"{done} step {step} from {checkpoint_dir}; committed steps: {rest}")


@main.command()
@QUIET_OPTION
@STORAGE_TIMEOUT_OPTION
@DIR
@click.argument("out_dir", metavar="OUT")
@click.option("--step", type=click.IntRange(min=0), help="Step to copy (default: the latest).")
@JSON_OPTION
def copy(checkpoint_dir, out_dir, step, as_json) -> None:
    """Copy a step into the checkpoint directory OUT (as OUT/STEP), standing alone.

    An incremental step holds only what changed since the step before and reads the rest
    from earlier steps' files: `cp -r DIR/STEP` copies part of it. This copy holds all of it,
    each byte checked as it is copied; any step, local or gs:// or s3://, either way.
    """
    on_cpu()
    from jaxckpt import copy_step

    need_dir(checkpoint_dir)
    copied = copy_step(checkpoint_dir, out_dir, step=step)
    if as_json:
        print_json({"step": copied, "out_dir": str(out_dir)})
    else:
        say(f"copied step {copied} to {out_dir}, standing alone")
