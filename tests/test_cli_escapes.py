"""Hostile names on disk never reach a terminal raw: a checkpoint directory, a step folder,
leaf names, mesh axis names and meta strings holding OSC (`ESC ] 0 ; ... BEL`) and CSI
(`ESC [ 2J`) sequences, a newline that would forge a table row, a bidi override and rich
markup. Every command prints them escaped as JSON escapes them; nothing else changes."""

import re

import jax
import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from conftest import run_python
from jaxckpt.cli import main

OSC, CSI, BIDI = "\x1b]0;pwned\x07", "\x1b[2J", "\u202e"
LEAF = f"w{OSC}{CSI}\n[red]fake  (9,)  float32{BIDI}"  # its second line looks like a row
LEAF_ESCAPED = "w\\u001b]0;pwned\\u0007\\u001b[2J\\n[red]fake  (9,)  float32\\u202e"
INT4 = f"q{OSC}"  # a leaf export skips, with a note naming it
DIR_NAME = f"ck{OSC}{BIDI}pt"
DIR_ESCAPED = "ck\\u001b]0;pwned\\u0007\\u202ept"
STEP_FOLDER = f"{OSC}[red]x_7"  # step-like (ASCII, `<prefix>_<digits>`), unreadable
STEP_ESCAPED = "\\u001b]0;pwned\\u0007[red]x_7"
AXIS = f"d{CSI}"
# Anything a terminal acts on: C0 but newline, DEL, C1, bidi controls.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    directory = tmp_path_factory.mktemp("escapes") / DIR_NAME
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((4, 2), (AXIS, "model"), axis_types=auto)
    w = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P(AXIS, "model")))
    state = {LEAF: w, INT4: np.array([1, 2], ml_dtypes.int4)}
    with jaxckpt.CheckpointManager(directory) as m:
        m.save(1, state=state, meta={"note": f"{OSC}\n[bold]meta"})
        m.save(2, state={"plain": np.zeros(2, np.float32)})
    (directory / STEP_FOLDER).mkdir()
    return directory


def terminal(*args):
    """The CLI as a terminal shows it: colour on, so click strips no escape itself."""
    result = CliRunner().invoke(main, [str(a) for a in args], color=True)
    assert "Traceback" not in result.output, result.output
    return result


def assert_clean(text: str) -> None:
    assert not RAW.search(text), ascii(text)
    assert "\n[red]fake" not in text  # no forged line


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "{dir}"],
        ["ls", "{dir}", "--verify"],
        ["verify", "{dir}"],
        ["inspect", "{dir}", "--step", "1"],
        ["diff", "{dir}", "1", "2"],
        ["inspect", "{dir}", "--step", "7"],  # an error naming the directory
        ["export", "{dir}", "{dir}"],  # likewise
    ],
)
def test_no_raw_control_character_reaches_the_terminal(hostile, args):
    result = terminal(*(a.format(dir=hostile) for a in args))
    assert_clean(result.stdout)
    assert_clean(result.stderr)
    if args[0] in ("ls", "verify"):
        assert f"{STEP_ESCAPED}: not a step jaxckpt can read" in result.stderr
    if args[-1] == "7" or args[0] == "export":
        assert result.exit_code == 1
        (line,) = result.stderr.splitlines()
        assert line.startswith("jaxckpt: error: ") and DIR_ESCAPED in line


def test_inspect_shows_hostile_names_escaped_one_row_each(hostile):
    result = terminal("inspect", hostile, "--step", 1)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"step 1 of {hostile.parent}/{DIR_ESCAPED}, saved ")
    assert lines[1] == 'meta: {"note": "\\u001b]0;pwned\\u0007\\n[bold]meta"}'
    header, *rows, total = lines[2:]
    assert header.split()[0] == "leaf" and total.startswith("2 leaves")
    assert len(rows) == 2  # one row per leaf: the newline forged none
    (row,) = [r for r in rows if r.startswith(LEAF_ESCAPED)]
    assert "P('d\\x1b[2J', 'model') on d\\u001b[2J=4,model=2" in row  # the saved axis name


def test_diff_names_hostile_leaves_escaped(hostile):
    result = terminal("diff", hostile, 1, 2)
    assert result.exit_code == 1
    assert f"  removed  {LEAF_ESCAPED}  (8, 4) float32" in result.stdout.splitlines()


def test_export_notes_and_errors_are_escaped(hostile, tmp_path):
    """The note of a skipped leaf (a log record, printed by the CLI's own handler) and an
    error listing leaf names."""
    proc = run_python("-m", "jaxckpt", "export", str(hostile), str(tmp_path / "hf"), "--step", "1")
    assert_clean(proc.stdout + proc.stderr)
    assert proc.stderr.splitlines() == [
        "export: skipping q\\u001b]0;pwned\\u0007 (dtype int4; safetensors cannot hold it)"
    ]
    result = terminal("export", hostile, tmp_path / "x", "--step", 1, "--include", "^nothing")
    assert (
        result.exit_code == 1 and "the include pattern '^nothing' matches no leaf" in result.stderr
    )
    assert_clean(result.stderr)


def test_the_escape_helper():
    from jaxckpt._escape import escape, escape_markup

    assert escape(LEAF) == LEAF_ESCAPED
    assert escape(escape(LEAF)) == LEAF_ESCAPED  # idempotent
    assert escape("\x00\x7f\x9b\t\r\u2066\u2028") == "\\u0000\\u007f\\u009b\\t\\r\\u2066\\u2028"
    assert escape("plain params.w é ✓ [x]") == "plain params.w é ✓ [x]"  # the rest untouched

    # rich (the progress bars) shows markup in a name instead of applying it.
    from rich.console import Console
    from rich.text import Text

    console = Console(record=True, width=200, color_system=None)
    console.print(Text.from_markup(escape_markup(f"step [bold]{OSC}[/bold]")))
    assert console.export_text() == "step [bold]\\u001b]0;pwned\\u0007[/bold]\n"
