"""The `jaxckpt` command line: one-line errors and a non-zero exit on bad input."""

from __future__ import annotations

import logging
import sys

import click

from jaxckpt.errors import JaxckptError


class _Group(click.Group):
    """Turns jaxckpt's errors (and missing files) into one line on stderr and exit code 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (JaxckptError, FileNotFoundError) as e:
            click.echo(f"jaxckpt: error: {e}", err=True)
            sys.exit(1)


@click.group(cls=_Group)
@click.option("-q", "--quiet", is_flag=True, help="Only errors.")
def main(quiet: bool) -> None:
    """Inspect, verify and export jaxckpt checkpoints."""
    logging.basicConfig(level=logging.ERROR if quiet else logging.WARNING, format="%(message)s")
    logging.getLogger("absl").setLevel(logging.ERROR)


@main.command()
@click.argument("checkpoint_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
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
@click.option("--overwrite", is_flag=True, help="Replace a non-empty OUT_DIR.")
def export(checkpoint_dir, out_dir, step, dtype, max_shard_size, names, overwrite) -> None:
    """Export a checkpoint's state to Hugging Face-style sharded safetensors."""
    from jaxckpt.hf import export_safetensors

    result = export_safetensors(
        checkpoint_dir,
        out_dir,
        step=step,
        names=names,
        dtype=dtype,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
    )
    click.echo(
        f"exported step {result.step}: {result.tensors} tensors, {result.total_size:,} bytes "
        f"in {len(result.files)} file(s) to {result.out_dir}"
    )


@main.command()
@click.argument("checkpoint_dir", type=click.Path(file_okay=False))
@click.option("--step", type=int, help="Verify only this step.")
def verify(checkpoint_dir, step) -> None:
    """Check every file of every step against its manifest; exit 1 on any problem."""
    from pathlib import Path

    from jaxckpt.errors import NoCheckpointError
    from jaxckpt.integrity import verify as verify_dir

    if not Path(checkpoint_dir).is_dir():
        raise FileNotFoundError(f"{checkpoint_dir} is not a directory")
    reports = verify_dir(checkpoint_dir, step)
    if not reports:
        raise NoCheckpointError(f"no committed checkpoint in {checkpoint_dir}")
    for r in reports:
        if r.ok:
            click.echo(f"step {r.step}: ok ({r.files} files, {r.bytes:,} bytes)")
        else:
            click.echo(f"step {r.step}: CORRUPT")
            for problem in r.problems:
                click.echo(f"  {problem}")
    bad = [r.step for r in reports if not r.ok]
    if bad:
        click.echo(
            f"jaxckpt: error: {len(bad)} of {len(reports)} steps failed verification: {bad}",
            err=True,
        )
        sys.exit(1)
