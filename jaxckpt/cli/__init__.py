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
    jaxckpt copy DIR OUT [--step N]                  a step copied to stand alone (OUT/STEP)

Everything reads metadata (and, for `verify`, `diff --values` and `export`, the data) on the
host: JAX runs on CPU devices, never an accelerator; only `rm` writes in DIR (under the writer's
lock), and `copy` into its OUT (under OUT's). `--json` prints one JSON document, an error included. Progress bars go to stderr on
a terminal only (never with `-q/--quiet` or in logs). Bad input is one line on stderr,
`jaxckpt: error: ...`, and exit status 2 for a usage error, 1 for any other: never a
traceback. `diff` exits like diff(1): 0 the same, 1 different, 2 trouble. Names, paths and strings
read from a checkpoint are printed with control characters escaped (`jaxckpt._escape`).
"""

from jaxckpt.cli import _data, _steps  # noqa: F401 (each registers its commands on main)
from jaxckpt.cli._common import main as main
