"""Name maps between jaxckpt leaf names and Hugging Face tensor names.

A leaf's name is its tree path joined with dots, as stored in the checkpoint
(`h.0.attn.c_attn.kernel.value`). A map is a list of rules, tried in order; the first whose
`match` regex matches the whole name decides:

    include: '^params\\.'          # optional: leaves whose name does not match are left out
    rules:
      - match: '^wte\\.embedding\\.value$'
        name: transformer.wte.weight
      - match: '^(h\\.\\d+\\..*)\\.kernel\\.value$'
        name: 'transformer.\\1.weight'   # regex groups
        transpose: [1, 0]             # optional: axes permutation (e.g. Flax (in, out) -> torch (out, in))
      - match: '^layers\\.mlp\\.kernel\\.value$'
        name: 'model.layers.{i}.mlp.weight'
        split: 0                      # optional: a stacked (scanned) axis; one tensor per index i
      - match: '^attn\\.query\\.kernel$'       # (embed, layers, heads, head_dim)
        name: 'model.layers.{i}.q_proj.weight'
        split: 1
        reshape: [0, [1, 2]]          # optional: file axes, each merging leaf axes in order
        transpose: [1, 0]
        scale: 11.313708498984761     # optional: multiply floats by it (import divides)
      - match: '^rngs\\.'
        drop: true                    # optional: never exported

Patterns are searched (anchor them with ^ and $). With no map at all, names stay as they
are; with a map, a leaf that no rule matches is an error naming it (add a rule, a drop rule,
or narrow `include`). On export a leaf becomes its tensors in this order: `split` (one
tensor per index of that axis), `reshape` (each entry is a file axis: a leaf axis, or a list
of consecutive leaf axes merged into one in C order, as `np.reshape` merges them; every axis
once, in order), `transpose` (a permutation of the reshaped axes), `scale`. Import undoes
them in reverse, the merged axes' sizes taken from the target leaf. Maps load from YAML
files (configs/hf/).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxckpt._storage import read_whole
from jaxckpt.errors import ConfigError, NameMapError

_OPTIONS = ("transpose", "split", "drop", "reshape", "scale")  # a rule's keys besides match, name


@dataclasses.dataclass(frozen=True)
class Rule:
    match: re.Pattern[str]
    name: str | None = None
    transpose: tuple[int, ...] | None = None
    split: int | None = None
    drop: bool = False
    reshape: tuple[tuple[int, ...], ...] | None = None
    scale: float | None = None


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one leaf goes: one HF tensor per entry of `names` (one, or one per split index)."""

    leaf: str
    names: tuple[str, ...]
    transpose: tuple[int, ...] | None
    split: int | None
    reshape: tuple[tuple[int, ...], ...] | None = None  # leaf axes merged into each file axis
    scale: float | None = None


@dataclasses.dataclass(frozen=True)
class NameMap:
    rules: tuple[Rule, ...] = ()
    include: re.Pattern[str] | None = None

    @classmethod
    def load(cls, source: NameMap | str | os.PathLike[str] | Mapping[str, Any] | None) -> NameMap:
        """From a NameMap, a YAML file path, an already-parsed mapping, or None (identity)."""
        if source is None:
            return cls()
        if isinstance(source, NameMap):
            return source
        if isinstance(source, str | os.PathLike):
            import yaml  # only maps in files need it

            path = Path(source)
            try:
                with path.open("rb") as f:
                    source = yaml.safe_load(read_whole(f).decode("utf-8")) or {}
            except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
                raise ConfigError(f"cannot read the name map {path}: {e}") from None
        if not isinstance(source, Mapping):
            raise ConfigError(f"a name map is a mapping with 'rules', got {type(source).__name__}")
        if unknown := set(source) - {"rules", "include"}:
            raise ConfigError(
                f"unknown name-map keys {sorted(unknown)}; expected 'rules', 'include'"
            )
        rules = []
        for i, raw in enumerate(source.get("rules") or []):
            if (
                not isinstance(raw, dict)
                or "match" not in raw
                or set(raw) - {"match", "name", *_OPTIONS}
            ):
                raise ConfigError(
                    f"name-map rule {i} ({raw!r}) needs 'match' and may have only name, "
                    + ", ".join(_OPTIONS)
                )
            if not raw.get("drop") and raw.get("name") is None:
                raise ConfigError(
                    f"name-map rule {i} ({raw['match']!r}) needs a 'name' or 'drop: true'"
                )
            split = raw.get("split") is not None and not raw.get("drop")  # a drop goes nowhere
            if split and "{i}" not in raw["name"]:
                raise ConfigError(f"name-map rule {i} splits an axis: its name needs '{{i}}'")
            rules.append(
                Rule(
                    match=_compile(raw["match"], f"rule {i}"),
                    name=raw.get("name"),
                    transpose=tuple(raw["transpose"]) if raw.get("transpose") else None,
                    split=raw.get("split"),
                    drop=bool(raw.get("drop", False)),
                    reshape=_groups(raw.get("reshape"), i),
                    scale=_scale(raw.get("scale"), i),
                )
            )
        include = source.get("include")
        return cls(tuple(rules), _compile(include, "include") if include else None)


def place(name_map: NameMap, leaf: str, shape: Sequence[int]) -> Placement | None:
    """Where `name_map` puts `leaf` (of `shape`); None when it is left out (include/drop)."""
    if name_map.include is not None and not name_map.include.search(leaf):
        return None
    for rule in name_map.rules:
        if (m := rule.match.search(leaf)) is None:
            continue
        if rule.drop:
            return None
        if rule.name is None:  # `load` refuses such a rule; one built by hand is wrong
            raise ConfigError(f"name-map rule {rule.match.pattern!r} needs a name or drop")
        name = m.expand(rule.name)
        names: tuple[str, ...] = (name,)
        if rule.split is not None:
            if not 0 <= rule.split < len(shape):
                raise NameMapError(
                    f"leaf {leaf!r} of shape {tuple(shape)} has no axis {rule.split} to split"
                )
            names = tuple(name.replace("{i}", str(i)) for i in range(shape[rule.split]))
        return Placement(
            leaf, names, rule.transpose, rule.split, reshape=rule.reshape, scale=rule.scale
        )
    if name_map.rules:
        raise NameMapError(f"no name-map rule places the leaf {leaf!r}")
    return Placement(leaf, (leaf,), None, None)


def place_all(name_map: NameMap, shapes: Mapping[str, Sequence[int]]) -> list[Placement]:
    """Places every leaf by `name_map`; two leaves on one tensor name is an error naming both."""
    placements, unplaced = [], []
    owner: dict[str, str] = {}  # tensor name: the leaf on it
    for leaf, shape in shapes.items():
        try:
            placed = place(name_map, leaf, shape)
        except NameMapError:
            unplaced.append(leaf)
            continue
        if placed is None:
            continue
        for name in placed.names:
            if name in owner:
                raise NameMapError(
                    f"leaves {owner[name]!r} and {leaf!r} both map to the tensor {name!r}; "
                    "fix the name map so each tensor has one source"
                )
            owner[name] = leaf
        placements.append(placed)
    if unplaced:
        shown = ", ".join(repr(n) for n in unplaced[:20])
        more = f" (and {len(unplaced) - 20} more)" if len(unplaced) > 20 else ""
        raise NameMapError(
            f"no name-map rule places these leaves: {shown}{more}. Add a rule for them, "
            "a 'drop: true' rule, or narrow 'include'."
        )
    return placements


def reshape_text(groups: tuple[tuple[int, ...], ...]) -> str:
    """A reshape as written in a map: [0, [1, 2]]."""
    return "[" + ", ".join(str(g[0]) if len(g) == 1 else str(list(g)) for g in groups) + "]"


def _groups(raw: Any, i: int) -> tuple[tuple[int, ...], ...] | None:
    """A rule's `reshape`: each entry an axis or a non-empty list of axes."""
    if raw is None:
        return None

    def axis(a: Any) -> bool:
        return isinstance(a, int) and not isinstance(a, bool) and a >= 0

    groups = [[g] if axis(g) else g for g in raw] if isinstance(raw, list) and raw else None
    if groups is None or not all(isinstance(g, list) and g and all(map(axis, g)) for g in groups):
        raise ConfigError(
            f"name-map rule {i}: reshape lists the file tensor's axes, each a leaf axis or a "
            f"list of leaf axes merged into one (e.g. [0, [1, 2]]); got {raw!r}"
        )
    return tuple(tuple(g) for g in groups)


def _scale(raw: Any, i: int) -> float | None:
    if raw is None:
        return None
    number = isinstance(raw, int | float) and not isinstance(raw, bool)
    if not (number and math.isfinite(raw) and raw):
        raise ConfigError(f"name-map rule {i}: scale must be a finite non-zero number, got {raw!r}")
    return float(raw)


def _compile(pattern: str, where: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"name-map {where}: bad regex {pattern!r}: {e}") from None
