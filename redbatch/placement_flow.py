"""The fewest slot moves that spread every model's sub-queues and all slots evenly
(``redbatch.placement.plan``), as a small min-cost flow.

With ``W`` primaries, a group (one model's distinct slots) of ``n`` slots puts
``n // W`` on every primary and one more on ``n % W`` of them (its "extras"); the
primaries' totals must differ by one at most, which, since every group gives each
primary the same ``n // W``, asks the same of the extras: each primary takes
``R // W`` or one more of the ``R`` extras in all.  A primary that already owns more
than ``n // W`` of a group's slots keeps one more of them if it takes one of that
group's extras.  Choosing the extras is then a bipartite flow: source -> group
(its ``n % W`` extras) -> primary (one each, worth 1 where it keeps a slot) -> sink
(``R // W`` required, one more allowed), solved for the most kept slots by
successive shortest paths (Bellman-Ford: a few groups and primaries).  The integral
optimum exists because the even fractional spread (``n / W`` each) satisfies every
bound of this network matrix.  Ties go to the earlier group keeping its slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _Arc:
    to: int
    cap: int
    cost: int
    rev: int  # the index of the reverse arc in ``to``'s list
    flow: int = 0


@dataclass
class _Network:
    arcs: list[list[_Arc]] = field(default_factory=list)

    def node(self) -> int:
        self.arcs.append([])
        return len(self.arcs) - 1

    def add(self, a: int, b: int, cap: int, cost: int) -> _Arc:
        arc = _Arc(b, cap, cost, len(self.arcs[b]))
        self.arcs[a].append(arc)
        self.arcs[b].append(_Arc(a, 0, -cost, len(self.arcs[a]) - 1))
        return arc

    def cheapest_path(self, source: int, sink: int) -> list[_Arc] | None:
        """The cheapest path of residual arcs (Bellman-Ford; no negative cycle, as
        successive shortest paths keep it), None when the sink is out of reach."""
        inf = float("inf")
        dist: list[float] = [inf] * len(self.arcs)
        via: list[_Arc | None] = [None] * len(self.arcs)
        dist[source] = 0
        for _ in range(len(self.arcs)):
            changed = False
            for a, out in enumerate(self.arcs):
                for arc in (x for x in out if dist[a] < inf and x.cap > x.flow):
                    if dist[a] + arc.cost < dist[arc.to]:
                        dist[arc.to], via[arc.to], changed = dist[a] + arc.cost, arc, True
            if not changed:
                break
        return None if via[sink] is None else self._walk(via, source, sink)

    def _walk(self, via: list[_Arc | None], source: int, sink: int) -> list[_Arc]:
        path, node = [], sink
        while node != source:
            arc = via[node]
            assert arc is not None
            path.append(arc)
            node = self.arcs[arc.to][arc.rev].to
        return path

    def push(self, path: list[_Arc]) -> None:
        """One unit along ``path``."""
        for arc in path:
            arc.flow += 1
            self.arcs[arc.to][arc.rev].flow -= 1


def extras(sizes: Sequence[int], keeps: Sequence[Sequence[bool]], width: int
           ) -> list[list[int]]:
    """Per group (``sizes[g]`` slots), the primaries (indexes) that take one of its
    ``size % width`` extras; ``keeps[g][p]``: primary ``p`` would keep one more of
    group ``g``'s slots with an extra.  The choice keeps the most slots, each
    primary taking ``R // width`` extras or one more."""
    total = sum(size % width for size in sizes)
    net = _Network()
    source, sink = net.node(), net.node()
    primaries = [net.node() for _ in range(width)]
    choices = _group_arcs(net, source, primaries, sizes, keeps)
    _sink_arcs(net, primaries, sink, total, weight=(len(sizes) * total + 1) * (total + 1) * 2)
    for _ in range(total):
        path = net.cheapest_path(source, sink)
        assert path is not None  # (the even spread is always feasible)
        net.push(path)
    return [[p for p, arc in enumerate(arcs) if arc.flow > 0] for arcs in choices]


def _group_arcs(net: _Network, source: int, primaries: list[int], sizes: Sequence[int],
                keeps: Sequence[Sequence[bool]]) -> list[list[_Arc]]:
    """Source -> group (its extras) -> primary (one each): a kept slot is worth more
    than every tie-break together, which favours the earlier groups."""
    width, groups = len(primaries), len(sizes)
    kept = groups * sum(size % width for size in sizes) + 1
    choices = []
    for g, size in enumerate(sizes):
        node = net.node()
        net.add(source, node, size % width, 0)
        choices.append([net.add(node, primary, 1, -(kept + groups - g) if keeps[g][p] else 0)
                        for p, primary in enumerate(primaries)])
    return choices


def _sink_arcs(net: _Network, primaries: list[int], sink: int, total: int, weight: int
               ) -> None:
    """Primary -> sink: ``total // width`` required (each worth ``weight``, more than
    every kept slot together), one more allowed where the extras do not divide."""
    width = len(primaries)
    for primary in primaries:
        net.add(primary, sink, total // width, -weight)
        net.add(primary, sink, 1 if total % width else 0, 0)
