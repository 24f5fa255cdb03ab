"""The commands that read or plan arrays: `diff`, `plan`, `export`."""

from __future__ import annotations

import dataclasses
import math

import click

from jaxckpt.cli._common import (
    DIR,
    ITEM_OPTION,
    JSON_OPTION,
    MAX_PLAN_DEVICES,
    QUIET_OPTION,
    STORAGE_TIMEOUT_OPTION,
    axis_names,
    main,
    need_dir,
    on_cpu,
    print_json,
    progress_bars,
    regex,
    say,
    step_info,
)


@main.command()
@QUIET_OPTION
@STORAGE_TIMEOUT_OPTION
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
    on_cpu()
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
    need_dir(first)
    need_dir(dir_b)
    with progress_bars("compare {key}") as update:
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

    def describe(leaf: tuple[tuple[int, ...], str]) -> str:
        return f"{leaf[0]} {leaf[1]}"

    # diff(1)'s exit status: 0 the same, 1 different (in the tree and, with --values, in a
    # value), 2 trouble (the group's handler).
    if as_json:
        print_json(
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
        say(
            f"a: {first} step {found.steps[0]}; b: {dir_b} step {found.steps[1]} ({item}, "
            f"{len(a)} and {len(b)} leaves)"
        )
        for name in found.added:
            say(f"  added    {name}  {describe(b[name])}")
        for name in found.removed:
            say(f"  removed  {name}  {describe(a[name])}")
        for name in found.changed:
            say(f"  changed  {name}  {describe(a[name])} -> {describe(b[name])}")
        for name, d in differing.items():
            say(f"  values   {name}  max |a - b| = {d:.6g}")
        added, removed, changed = len(found.added), len(found.removed), len(found.changed)
        summary = f"{added} added, {removed} removed, {changed} changed in shape/dtype"
        if found.max_abs_diff is not None:  # (with --values)
            largest = max(differing.values(), default=0.0)
            summary += (
                f", {len(differing)} of {len(found.max_abs_diff)} differ in value "
                f"(largest |a - b|: {largest:.6g})"
            )
        say(summary)
    if found.different:
        click.get_current_context().exit(1)


@main.command()
@QUIET_OPTION
@STORAGE_TIMEOUT_OPTION
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
    on_cpu(devices)
    import jax
    import numpy as np

    from jaxckpt._memory import auto_inflight_bytes
    from jaxckpt._plan import plan_reads
    from jaxckpt._targets import requests_on_mesh

    _, info, which = step_info(checkpoint_dir, step, item)
    leaves = info.leaves(which)
    saved_axes = next((tuple(s.sharding["mesh"]) for s in leaves if s.spec is not None), ())
    names = axis_names(mesh, shape, axes, saved_axes)
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
        print_json(
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
    say(f"onto mesh {' x '.join(f'{k}={v}' for k, v in sizes.items())}, {hosts} host(s)")
    for line in str(result).splitlines():
        say(line)
    if replicated:
        say(
            f"{len(replicated)} leaves planned replicated (their saved spec does not fit "
            f"this mesh): {', '.join(replicated[:5])}{' ...' if len(replicated) > 5 else ''}"
        )


@main.command()
@QUIET_OPTION
@STORAGE_TIMEOUT_OPTION
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
    on_cpu()
    from jaxckpt import export_orbax, export_safetensors

    for pattern in (*options["include"], *options["exclude"]):
        regex(pattern)
    need_dir(checkpoint_dir)
    if kind == "orbax":
        unused = [f"--{k}" for k in ("names", "dtype", "include", "exclude") if options[k]]
        unused += [] if options["skip_unsupported"] else ["--no-skip-unsupported"]
        if unused:
            raise click.BadParameter(f"{', '.join(unused)}: only with --format safetensors")
        keep = ("step", "overwrite", "item")
        exported = export_orbax(checkpoint_dir, out_dir, **{k: options[k] for k in keep})
        if as_json:
            print_json({"step": exported, "out_dir": str(out_dir), "format": "orbax"})
        else:
            say(f"exported step {exported} as a plain Orbax checkpoint to {out_dir}")
        return
    with progress_bars("export") as update:
        result = export_safetensors(
            checkpoint_dir, out_dir, progress=lambda d, t: update("export", d, t), **options
        )
    if as_json:
        print_json(dict(dataclasses.asdict(result), out_dir=str(result.out_dir)))
        return
    say(
        f"exported step {result.step}: {result.tensors} tensors, {result.total_size:,} bytes "
        f"in {len(result.files)} file(s) to {result.out_dir}"
    )
