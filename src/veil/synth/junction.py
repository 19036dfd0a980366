"""A junction tree over a set of attribute cliques: triangulation, maximal cliques, tree, message order.

Pure graph work on public structure (which marginals were measured), no data. The graph joins two
attributes when some clique holds both; it is triangulated by greedy elimination (at each step the
attribute whose elimination creates the smallest new clique, by domain size), the maximal cliques
of the chordal graph are joined by a maximum spanning tree on separator sizes (running
intersection), and :attr:`JunctionTree.order` lists the tree's edges from the root outwards.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Clique", "JunctionTree", "junction_tree", "model_cells"]

Clique = tuple[int, ...]


@dataclass(frozen=True)
class JunctionTree:
    """Maximal cliques (sorted attribute tuples) and the tree edges ``(parent, child)`` from the root."""

    cliques: tuple[Clique, ...]
    order: tuple[tuple[int, int], ...]

    def separator(self, parent: int, child: int) -> Clique:
        return tuple(sorted(set(self.cliques[parent]) & set(self.cliques[child])))

    def containing(self, attrs: Iterable[int]) -> int | None:
        """A clique holding every attribute of ``attrs`` (the smallest), or None."""
        want = set(attrs)
        best = None
        for i, c in enumerate(self.cliques):
            if want <= set(c) and (best is None or len(c) < len(self.cliques[best])):
                best = i
        return best


def _triangulate(n: int, cliques: Sequence[Clique], sizes: Sequence[int]) -> list[Clique]:
    adj: dict[int, set[int]] = {v: set() for v in range(n)}
    for c in cliques:
        for a in c:
            adj[a] |= set(c) - {a}
    remaining = set(range(n))
    found: list[set[int]] = []
    while remaining:

        def cost(v: int) -> tuple[float, int]:
            nb = adj[v] & remaining
            return (math.prod(sizes[u] for u in nb | {v}), v)

        v = min(remaining, key=cost)
        nb = adj[v] & remaining
        clique = nb | {v}
        for a in nb:
            adj[a] |= nb - {a}
        remaining.discard(v)
        if not any(clique <= f for f in found):
            found = [f for f in found if not f <= clique] + [clique]
    return [tuple(sorted(f)) for f in found]


def junction_tree(n: int, cliques: Sequence[Clique], sizes: Sequence[int]) -> JunctionTree:
    """The junction tree of the model over ``n`` attributes whose measured cliques are ``cliques``."""
    maximal = _triangulate(n, [tuple(c) for c in cliques] + [(i,) for i in range(n)], sizes)
    maximal.sort(key=lambda c: (-len(c), c))
    k = len(maximal)
    edges = sorted(
        ((len(set(maximal[i]) & set(maximal[j])), i, j) for i in range(k) for j in range(i + 1, k)),
        key=lambda e: -e[0],
    )
    parent = list(range(k))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    adj: dict[int, list[int]] = {i: [] for i in range(k)}
    for _, i, j in edges:
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[ri] = rj
            adj[i].append(j)
            adj[j].append(i)
    # Kruskal over every pair (empty separators included) joins all cliques into one tree.
    order: list[tuple[int, int]] = []
    seen = {0}
    stack = [0]
    while stack:
        p = stack.pop()
        for c in adj[p]:
            if c not in seen:
                seen.add(c)
                order.append((p, c))
                stack.append(c)
    return JunctionTree(tuple(maximal), tuple(order))


def model_cells(n: int, cliques: Sequence[Clique], sizes: Sequence[int]) -> int:
    """The number of cells the model's junction tree holds (its memory is 8 bytes a cell)."""
    tree = junction_tree(n, cliques, sizes)
    return sum(math.prod(sizes[a] for a in c) for c in tree.cliques)
