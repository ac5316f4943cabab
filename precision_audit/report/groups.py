"""Repeated structure in the module tree, for the report's grouped views (docs/report.md, "Models with hundreds of
layers"): the 24 blocks of a GPT-2, the stages of a ResNet, shown once with the spread across their repeats.

View logic only: it reads the names, types and own parameter counts of audit.json's ``layers`` (the typed record)
and computes no figure. Siblings under one parent with the same *signature* -- their type and, in execution
order, every module below them that ran with its relative name, type and own parameter count -- are the repeats
of one group. A group of containers needs two repeats; a group of leaves (a flat ``nn.Sequential`` of 250
``Linear(8, 8)``) needs :data:`MIN_LEAF_REPEATS`, so that two ReLUs of a small MLP stay two rows. Inside a group
nothing is grouped again: its members' modules are the group's *paths* (``attn.c_attn``), each one row with the
spread over the repeats.

Example::

    g = grouping(record.layers)
    [grp.label for grp in g.groups]          # ['transformer.h.*']
    compress_names(["transformer.h.0.attn", ..., "lm_head"], g)   # ['transformer.h.*.attn', 'lm_head']
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import record as R

#: Leaves of one type and size under one parent form a group from this many on (containers from two).
MIN_LEAF_REPEATS = 4
#: A model with more modules than this gets the grouped views, its full per-module tables collapsed.
GROUPED_VIEW_MIN_LAYERS = 40
#: A repeat is named as an outlier when its figure is this many times the median (errors, magnitudes, shares)...
OUTLIER_RATIO = 4.0
#: ... or, for headroom in bits, this many bits below the median.
OUTLIER_BITS = 2.0
#: Outliers named per figure; the rest are counted.
MAX_OUTLIERS_NAMED = 3


@dataclass
class Group:
    """One set of repeats: ``members`` (module names, execution order) under ``parent``, all of one signature."""

    gid: str
    parent: str
    members: list[str]
    type: str
    paths: list[str] = field(default_factory=list)  # "" is the member itself
    index: dict[tuple[str, str], int] = field(default_factory=dict)  # (member, path) -> layer index

    @property
    def label(self) -> str:
        """``transformer.h.*`` when the members are every child of the parent that ran, else the members listed."""
        return self._label(all_children=self._all_children)

    _all_children: bool = False

    def _label(self, all_children: bool) -> str:
        prefix = f"{self.parent}." if self.parent else ""
        if all_children:
            return f"{prefix}*"
        short = [m[len(prefix):] for m in self.members]
        return f"{prefix}{{{_ranges(short)}}}"

    def name(self, path: str) -> str:
        return self.label + (f".{path}" if path else "")

    def short(self, member: str) -> str:
        """The member's name below the parent: ``0`` for ``transformer.h.0``."""
        return member[len(self.parent) + 1:] if self.parent else member

    def column(self, path: str) -> list[int]:
        """The layer index of ``path`` in each member (members lacking it left out)."""
        return [self.index[(m, path)] for m in self.members if (m, path) in self.index]


@dataclass
class Grouping:
    groups: list[Group]
    #: layer index -> (group, member, path) for every module inside a group
    placed: dict[int, tuple[Group, str, str]]
    #: (first layer index, last layer index, label): the chart axes' units (top-level modules and each repeat)
    units: list[tuple[int, int, str]]

    @property
    def grouped(self) -> bool:
        return bool(self.groups)


def _ranges(items: Sequence[str]) -> str:
    """``0…23`` for consecutive integers, ``0,2,…,498`` for every other one, else the items joined by commas."""
    if all(s.isdigit() for s in items) and len(items) > 2:
        nums = [int(s) for s in items]
        step = nums[1] - nums[0]
        if step > 0 and nums == list(range(nums[0], nums[-1] + 1, step)):
            return f"{nums[0]}…{nums[-1]}" if step == 1 else f"{nums[0]},{nums[1]},…,{nums[-1]}"
    return ",".join(items)


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def grouping(layers: Sequence[R.LayerReport]) -> Grouping:
    """The groups of repeated modules among ``layers`` (audit.json order), and the chart units."""
    first: dict[str, int] = {}
    for i, L in enumerate(layers):
        first.setdefault(L.name or "", i)
    names = list(first)
    # every node of the tree, those that did not run (a ModuleList) included, with its descendants in order
    below: dict[str, list[str]] = {"": []}
    children: dict[str, list[str]] = {}
    for n in names:
        if not n:
            continue
        parts = n.split(".")
        for k in range(len(parts)):
            anc = ".".join(parts[:k])
            below.setdefault(anc, []).append(n)
            child = ".".join(parts[:k + 1])
            kids = children.setdefault(anc, [])
            if child not in kids:
                kids.append(child)
        below.setdefault(n, [])

    def info(n: str) -> tuple[str, int] | None:
        i = first.get(n)
        return (layers[i].type, layers[i].own_parameters) if i is not None else None

    def signature(n: str) -> tuple[Any, ...]:
        cut = len(n) + 1
        return (info(n), tuple((d[cut:], info(d)) for d in below.get(n, [])))

    groups: list[Group] = []
    placed: dict[int, tuple[Group, str, str]] = {}

    def visit(node: str) -> None:
        kids = children.get(node, [])
        classes: dict[tuple[Any, ...], list[str]] = {}
        for k in kids:
            classes.setdefault(signature(k), []).append(k)
        for sig, members in classes.items():
            leaf = not below.get(members[0])
            if sig[0] is not None and len(members) >= (MIN_LEAF_REPEATS if leaf else 2):
                g = Group(gid=f"g{len(groups)}", parent=node, members=members, type=sig[0][0],
                          _all_children=len(members) == len(kids))
                g.paths = [""] + [d[len(members[0]) + 1:] for d in below.get(members[0], [])]
                for m in members:
                    for p in g.paths:
                        i = first.get(f"{m}.{p}" if p else m)
                        if i is not None:
                            g.index[(m, p)] = i
                            placed[i] = (g, m, p)
                groups.append(g)
            else:
                for m in members:
                    visit(m)

    visit("")
    groups.sort(key=lambda g: min(g.index.values()))
    for k, g in enumerate(groups):
        g.gid = f"g{k}"
    return Grouping(groups, placed, _units(names, first, children, below, placed))


def _units(names: list[str], first: dict[str, int], children: dict[str, list[str]], below: dict[str, list[str]],
           placed: dict[int, tuple[Group, str, str]]) -> list[tuple[int, int, str]]:
    members = {m for g, m, p in placed.values() if p == ""}
    has_group = {n for n in below if any(first.get(d) in placed for d in below[n])}
    out: list[tuple[int, int, str]] = []

    def walk(n: str) -> None:
        kids = children.get(n, [])
        if n in members or not kids or (n and n not in has_group and len(kids) > 1):
            idx = [first[x] for x in [n, *below.get(n, [])] if x in first]
            if idx:
                out.append((min(idx), max(idx), n or "(model)"))
            return
        for k in kids:
            walk(k)

    walk("")
    return sorted(out)


def compress_names(names: Iterable[str], g: Grouping) -> list[str]:
    """``names`` with every complete column of a group (the same path in each repeat) written once as its
    pattern (``transformer.h.*.mlp.c_proj``); the rest as they are, in the given order."""
    todo = list(dict.fromkeys(names))
    rest = set(todo)
    out: dict[str, str] = {}  # the first name of a replaced column -> its pattern
    for grp in g.groups:
        for p in grp.paths:
            col = [f"{m}.{p}" if p else m for m in grp.members]
            if len(col) > 1 and all(c in rest for c in col):
                out[col[0]] = grp.name(p)
                rest -= set(col[1:])
    return [out.get(n, n) for n in todo if n in rest]


# --- the spread of one figure across a group's repeats -----------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """One figure over a group's repeats: the median, the range, where the worst is, the outliers named."""

    median: float
    lo: float
    hi: float
    worst: str
    outliers: list[str]
    more: int
    n: int


def spread(values: Sequence[tuple[str, float | None]], worse: str = "high", bits: bool = False) -> Spread | None:
    """``values``: (repeat, figure) pairs, None for a figure the record lacks. ``worse`` is "high" (errors,
    magnitudes, shares) or "low" (headroom); ``bits`` compares by difference instead of ratio."""
    got = [(m, v) for m, v in values if v is not None and not math.isnan(v)]
    if not got:
        return None
    vs = sorted(v for _, v in got)
    mid = len(vs) // 2
    median = vs[mid] if len(vs) % 2 else (vs[mid - 1] + vs[mid]) / 2
    key: Callable[[tuple[str, float]], float] = (lambda x: x[1]) if worse == "high" else (lambda x: -x[1])
    worst = max(got, key=key)[0]

    def out(v: float) -> bool:
        if bits:
            return v < median - OUTLIER_BITS if worse == "low" else v > median + OUTLIER_BITS
        if worse == "high":
            return v > OUTLIER_RATIO * median if median > 0 else v > 0 and median == 0 and len(got) > 2
        return v * OUTLIER_RATIO < median
    odd = sorted((x for x in got if out(x[1])), key=key, reverse=True)
    return Spread(median, vs[0], vs[-1], worst, [m for m, _ in odd[:MAX_OUTLIERS_NAMED]],
                  max(0, len(odd) - MAX_OUTLIERS_NAMED), len(got))


_GLOB = re.compile(r"[^*]+|\*")


def glob_regex(pattern: str) -> str:
    """A filter pattern with ``*`` as "any characters" as a JavaScript/Python regular expression source."""
    return "".join(".*" if t == "*" else re.escape(t) for t in _GLOB.findall(pattern))


__all__ = ["GROUPED_VIEW_MIN_LAYERS", "Group", "Grouping", "Spread", "compress_names", "glob_regex", "grouping",
           "spread"]
