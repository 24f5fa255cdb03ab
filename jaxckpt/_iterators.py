"""What a data iterator was when saved, to refuse restoring its position into another one.

An iterator's state alone rarely says what it iterates: a grain `MapDataset` pipeline's is
`{"next_index": 7}` with a batch size of 32 or of 64, so a resumed job with another batch
size would continue silently at another place of the data. Beside each process's state,
save records a description of the iterator (`describe`):

* `type`: the iterator's qualified class name;
* `state`: the fields of its state (the keys of the JSON object);
* `config`: for a grain `DataLoaderIterator`, the fields of its state that are its
  configuration and that grain itself checks on `set_state`, after every array was read
  (`sampler`, with its seed, `data_source`, `worker_count`). grain records a source by its
  `repr`: one without a `__repr__` of its own is `<Source object at 0x...>`, whose address
  means nothing in another process, so it is compared by its class alone (and grain is
  handed the state with this process's address, `with_own_addresses`);
* `pipeline`: for grain, each transformation of the pipeline as grain describes it
  (`BatchMapDataset(batch_size=32, drop_remainder=False)`, a DataLoader's operations),
  without what does not change the data: prefetching nodes, memory addresses, the source
  lines of functions.

`differences` compares two descriptions; restore refuses a mismatch before reading any
array, unless told `data_mismatch_ok=True`. grain's pipeline graph is read through its
iterators' private `_parents` links, as grain's own pipeline visualisation does: when a
grain version lacks them, less is recorded, and compared.

>>> import grain
>>> saved = describe(iter(grain.MapDataset.range(64).batch(32).to_iter_dataset()))
>>> given = describe(iter(grain.MapDataset.range(64).batch(16).to_iter_dataset()))
>>> differences(saved, given)  # doctest: +NORMALIZE_WHITESPACE
['pipeline: BatchMapDataset(batch_size=32, drop_remainder=False) was saved,
  BatchMapDataset(batch_size=16, drop_remainder=False) is given']
"""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any

import jax

from jaxckpt import _layout
from jaxckpt._checks import check_json
from jaxckpt.errors import CorruptCheckpointError, DataStateError

log = logging.getLogger("jaxckpt")

# grain's DataLoader state: its configuration (what grain's own `_validate_state` compares).
LOADER_CONFIG = ("sampler", "data_source", "worker_count")
MAX_NODES = 256
MAX_TEXT = 500
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_SOURCE_LINE = re.compile(r" @ [^\s,()]+:\d+")  # grain names functions `f @ .../file.py:12`


def describe(data: Any, state: Any = None) -> dict[str, Any]:
    """A JSON description of the iterator: type, state fields, grain configuration.

    `state`: its `get_state()` if already taken (JSON, or the bytes of a DataLoader's JSON);
    None: taken here.
    """
    about: dict[str, Any] = {"type": f"{type(data).__module__}.{type(data).__qualname__}"}
    if state is None:
        try:
            state = data.get_state()
        except Exception:  # an iterator that cannot tell: only its type is compared
            return about
    if isinstance(state, bytes):
        try:
            state = json.loads(state.decode("utf-8"))
        except (ValueError, RecursionError):
            state = None
    if isinstance(state, dict):
        about["state"] = sorted(str(k) for k in state)
        if all(k in state for k in LOADER_CONFIG):
            about["config"] = {k: _text(_unaddressed(state[k])) for k in LOADER_CONFIG}
    if pipeline := _pipeline(data):
        about["pipeline"] = pipeline
    return about


def differences(saved: dict[str, Any], given: dict[str, Any]) -> list[str]:
    """What differs between two descriptions, one line each (empty: alike). A field one of
    them lacks (an older jaxckpt, an iterator that cannot tell) is not compared."""
    if saved.get("type") != given.get("type"):
        return [f"type: a {saved.get('type')} was saved, a {given.get('type')} is given"]
    lines = []
    if "state" in saved and "state" in given and saved["state"] != given["state"]:
        lines.append(f"state fields: {saved['state']} were saved, {given['state']} are given")
    saved_config, given_config = saved.get("config") or {}, given.get("config") or {}
    for key in sorted(saved_config.keys() & given_config.keys()):
        a, b = _unaddressed(saved_config[key]), _unaddressed(given_config[key])  # older saves'
        if a != b:
            lines.append(f"{key}: {a} was saved, {b} is given")
    if "pipeline" in saved and "pipeline" in given and saved["pipeline"] != given["pipeline"]:
        a, b = saved["pipeline"], given["pipeline"]
        if len(a) != len(b):
            lines.append(
                f"pipeline: {len(a)} steps were saved ({'; '.join(a)}), {len(b)} are given "
                f"({'; '.join(b)})"
            )
        else:
            changed = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
            lines += [f"pipeline: {x} was saved, {y} is given" for x, y in changed[:3]]
            if len(changed) > 3:
                lines.append(f"pipeline: and {len(changed) - 3} more steps differ")
    return lines


def with_own_addresses(saved: bytes, data: Any) -> bytes:
    """A grain DataLoader's saved state, its configuration's memory addresses replaced by
    those `data` (the DataLoaderIterator it goes into) has now where they alone differ:
    grain compares its source's `repr`, `<Source object at 0x...>` without a `__repr__`,
    and refused every restore in another process. Any other state is returned as it is."""
    try:
        state, own = json.loads(saved), json.loads(data.get_state())
    except Exception:  # not a DataLoader's JSON: grain's set_state judges it
        return saved
    if not (isinstance(state, dict) and isinstance(own, dict)):
        return saved
    changed = False
    for key in LOADER_CONFIG:
        a, b = state.get(key), own.get(key)
        alike = isinstance(a, str) and isinstance(b, str) and _unaddressed(a) == _unaddressed(b)
        if alike and a != b:
            state[key], changed = b, True
    return json.dumps(state, indent=4).encode("utf-8") if changed else saved


def _unaddressed(value: Any) -> Any:
    return _ADDRESS.sub("", value) if isinstance(value, str) else value


def _pipeline(data: Any) -> list[str]:
    """grain's description of each transformation, the iterator's first (empty for other
    iterators)."""
    grain = sys.modules.get("grain")  # never imported here: only a grain iterator has one
    if grain is None:
        return []
    nodes: list[Any] = []
    if isinstance(data, grain.DatasetIterator):
        nodes = _walk(data)
    elif hasattr(data, "_data_loader"):  # a DataLoaderIterator: its operations
        nodes = list(getattr(data._data_loader, "_operations", None) or ())
    return [_normalised(node) for node in nodes if "Prefetch" not in type(node).__name__]


def _walk(node: Any) -> list[Any]:
    out: dict[int, Any] = {}  # the nodes by id, in the order they were reached
    stack = [node]
    while stack and len(out) < MAX_NODES:
        node = stack.pop()
        if node is None or id(node) in out:
            continue
        out[id(node)] = node
        links = getattr(node, "__dict__", {})  # never grain's asserting `_parent` property
        try:
            parents = list(links.get("_parents", ()) or ())
        except TypeError:
            parents = []
        parents += [links.get("_map_parent"), links.get("_iter_parent")]
        stack.extend(reversed(parents))
    return list(out.values())


def _normalised(node: Any) -> str:
    try:
        text = str(node)
    except Exception:
        text = type(node).__name__
    return _text(_SOURCE_LINE.sub("", _ADDRESS.sub("", text)))


def _text(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_TEXT:
        return value[: MAX_TEXT - 3] + "..."
    return value


# ------------------------------------------------------------------ saved, checked, restored


def snapshot(data: Any) -> tuple[str | None, str | None, str | None]:
    """Takes the iterator's state now (at save): as text to store, its kind ("json" or
    "bytes"), and what the iterator is (`describe`, as JSON text)."""
    if data is None:
        return None, None, None
    if not callable(getattr(data, "get_state", None)):
        raise DataStateError(
            f"data= takes an iterator with get_state() and set_state() (e.g. a grain "
            f"DatasetIterator); got a {type(data).__name__}"
        )
    state = data.get_state()
    about = json.dumps(describe(data, state))
    if isinstance(state, bytes):  # grain's DataLoaderIterator: JSON text as bytes
        try:
            return state.decode("utf-8"), "bytes", about
        except UnicodeDecodeError:
            raise DataStateError(
                "data.get_state() returned bytes that are not UTF-8 text; jaxckpt stores "
                "iterator states as text (JSON or UTF-8 bytes)"
            ) from None
    check_json(state, "data.get_state()")
    return json.dumps(state), "json", about


def problem(info: _layout.StepInfo, data: Any, mismatch_ok: bool, directory: Any) -> str | None:
    """Why `data` cannot take the state saved at step `info.step` in `directory` (None: it
    can), reading only the step's small data files."""
    step = info.step
    if not callable(getattr(data, "set_state", None)):
        return f"data= takes an iterator with set_state(); got a {type(data).__name__}"
    if info.data is None:
        return (
            f"step {step} holds no data-iterator state (it was saved without data=); "
            "restore without data= or from a step saved with it"
        )
    here = (jax.process_index(), jax.process_count())
    if info.orbax is not None:  # grain's handler records no description: its state is there?
        try:
            _layout.read_data_state(directory, info, *here)
        except DataStateError as e:
            return str(e)
        return None
    # None: a step saved before jaxckpt recorded it
    saved = _layout.read_data_about(directory, step, *here)
    changed = differences(saved, describe(data)) if saved else []
    if not changed:
        return None
    if mismatch_ok:
        log.warning(
            "restore: the data iterator differs from the one saved at step %d "
            "(data_mismatch_ok=True): %s",
            step,
            "; ".join(changed),
        )
        return None
    where = f" (process {jax.process_index()})" if jax.process_count() > 1 else ""
    return (
        f"the data iterator is not built like the one saved at step {step}{where}:\n  "
        + "\n  ".join(changed)
        + "\nBuild it like the saved one to resume the same data order; for a deliberate "
        "change, pass data_mismatch_ok=True to move it to the saved position all the "
        "same. Nothing was read."
    )


def restore(data: Any, info: _layout.StepInfo, directory: Any) -> None:
    """Moves `data` to the position saved at `info.step` in `directory` (checked
    beforehand by `problem`)."""
    step = info.step
    text = _layout.read_data_state(directory, info, jax.process_index(), jax.process_count())
    as_json = info.data == "json"
    if info.data == "grain":  # grain's Orbax handler: a DatasetIterator's as JSON, else text
        import grain

        as_json = isinstance(data, grain.DatasetIterator)
    try:
        saved = json.loads(text) if as_json else with_own_addresses(text.encode(), data)
    except (ValueError, RecursionError):
        raise CorruptCheckpointError(
            step,
            [f"{info.data_item}/: this process's data-iterator state is not JSON"],
            str(directory),
        ) from None
    try:
        data.set_state(saved)
    except Exception as e:
        raise DataStateError(
            f"the data iterator refused the state saved at step {step}: {type(e).__name__}: "
            f"{e}. Restore into an iterator built like the one that was saved (same type, "
            "dataset and options)."
        ) from e
