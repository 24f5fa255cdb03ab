"""The `jaxckpt` command line's group and what every command shares: options, errors,
output (every line escaped, `jaxckpt._escape`), and the checkpoint opened to read."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import click

from jaxckpt import _store_errors, _store_time
from jaxckpt._escape import Formatter, escape, escape_markup
from jaxckpt._storage import files_below, is_remote
from jaxckpt.errors import ConfigError, JaxckptError, NoCheckpointError

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
    """One-line errors: jaxckpt's, missing files, a store's failures (named, as the
    library names them: `StorageError`), and click's usage errors; with --json, one JSON
    object on stdout instead. Never a traceback."""

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
            code = fail(e.format_message(), e, EXIT_USAGE, as_json)
        except click.ClickException as e:
            code = fail(e.format_message(), e, trouble, as_json)
        except click.exceptions.Abort:
            say("jaxckpt: aborted", err=True)
            code = 130
        except Exception as e:
            # A store's failure met past the library's entrances (a listing, a read): named
            # as they name it, after the command's first gs:// or s3:// argument.
            error = _store_errors.storage_error(next(filter(is_remote, args), None), e) or e
            if not isinstance(error, JaxckptError | OSError):
                raise
            message = str(error)
            for python, cli in CLI_WORDS:
                message = message.replace(python, cli)
            code = fail(message, error, trouble, as_json)
        sys.exit(code if isinstance(code, int) else 0)


def fail(message: str, error: BaseException, code: int, as_json: bool) -> int:
    if as_json:
        click.echo(json.dumps({"error": message, "type": type(error).__name__}))
    else:
        say(f"jaxckpt: error: {message}", err=True)  # one line: a newline in it escaped
    return code


def say(text: str, err: bool = False) -> None:
    """Prints a line that may hold names, paths, meta or an error, control and bidi
    characters escaped: no terminal escape, no newline forging a line (JSON escapes --json)."""
    click.echo(escape(text), err=err)


def set_quiet(ctx: click.Context, _param, quiet: bool) -> None:
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
    callback=set_quiet,
    help="Only errors: no progress bars, no notes.",
)


def set_storage_timeout(_ctx: click.Context, _param, seconds: float | None) -> None:
    if seconds is not None:  # read by the library where it makes a store's clients
        os.environ[_store_time.VARIABLE] = repr(seconds)


# Before the command or after it, as -q. A command on a store that does not answer ends
# within SECONDS and the pauses between attempts (about 5 s), with a one-line error.
STORAGE_TIMEOUT_OPTION = click.option(
    "--timeout",
    "--storage-timeout",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    expose_value=False,
    callback=set_storage_timeout,
    help=f"Give up on a gs:// or s3:// store that does not answer after SECONDS and the "
    f"pauses between attempts (default: ${_store_time.VARIABLE}, else "
    f"{_store_time.DEFAULT_S:g}).",
)


@click.group(cls=_Group)
@QUIET_OPTION
@STORAGE_TIMEOUT_OPTION
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
    # gcsfs logs each request it gives up on with a traceback: the error says it, once.
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)


# ------------------------------------------------------------------------------------ helpers


def on_cpu(devices: int | None = None) -> None:
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


def open_checkpoint(directory: str) -> Any:
    """The checkpoint directory, open to read (`jaxckpt.open`; a context manager); a clear
    error when there is none."""
    from jaxckpt import _reader

    need_dir(directory)
    return _reader.open_reader(directory)


def need_dir(directory: str) -> None:
    """A clear error for a local checkpoint directory that is not there."""
    if not is_remote(directory) and not os.path.isdir(directory):
        raise NoCheckpointError(f"{directory}: no such checkpoint directory")


def step_info(directory: str, step: int | None, item: str | None = None) -> tuple[Any, Any, str]:
    """The directory's path, the step's metadata (`StepInfo`; step None: the latest
    committed) and which of its trees `item` names: of a jaxckpt step "state" or "rng"
    (None: state), of a plain Orbax step its pytree item (None: its only one)."""
    from jaxckpt import _layout

    with open_checkpoint(directory) as ckpt:
        step = ckpt.resolve(step)
        if ckpt.is_checksummed(step):  # a jaxckpt step: "state" or "rng"
            check_item(item or _layout.STATE)
        return ckpt.directory, *ckpt.describe(step, item)


def check_item(item: str) -> None:
    from jaxckpt import _layout

    if item not in _layout.ITEMS:
        raise click.BadParameter(
            f"no item {item!r}; the step holds {list(_layout.ITEMS)}", param_hint="--item"
        )


def disk_usage(path) -> tuple[int, int]:
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
    for p in files_below(path):
        size, files = size + p.stat().length, files + 1
    return size, files


def table(header: list[str], rows: list[list[str]]) -> None:
    rows = [[escape(c) for c in row] for row in [header, *rows]]  # widths as printed
    widths = [max(len(c) for c in col) for col in zip(*rows, strict=True)]
    for row in rows:
        say("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def print_json(doc: Any) -> None:
    from jaxckpt._checks import strict_json  # a NaN in meta= is the string "NaN" here

    click.echo(json.dumps(strict_json(doc), indent=1, allow_nan=False))


@contextlib.contextmanager
def progress_bars(description: str) -> Iterator:
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


def regex(pattern: str) -> re.Pattern:
    """A leaf-name regex (inspect --filter, export --include/--exclude); a usage error."""
    try:
        return re.compile(pattern)
    except re.error as e:
        raise click.BadParameter(f"{pattern!r} is not a regular expression: {e}") from None


def count(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def axis_names(mesh: str, shape: tuple[int, ...], axes: str | None, saved: tuple) -> tuple:
    """`--axes` (default: the saved mesh's axis names): one distinct name per axis of
    `--mesh`."""
    n = count(len(shape), "axis", "axes")
    if axes:
        names = tuple(axes.split(","))
        problem = f"--axes {axes} gives {count(len(names), 'name')} for the {n} of --mesh {mesh}"
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


ITEM_OPTION = click.option(
    "--item",
    help="state (the default) or rng; of a step plain Orbax wrote, its pytree item "
    "(default: its only one).",
)
