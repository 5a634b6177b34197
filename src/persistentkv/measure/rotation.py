"""Cold-cache rotation: how many copies of a case's (compact) cache, and which copy each call reads.

A measured call must not find its K/V in L2 (60 MB on H200) because an earlier call just read
them. Every backend reads the same bytes, so the rotation is global: one cursor walks the R copies
for every call of every backend and protocol, with R x case_bytes >= cold_l2_factor x L2. For a
case smaller than L2 this puts (R - 1) x case_bytes >= (cold_l2_factor - 1) x L2 of other data
between two reads of the same copy; a case larger than L2 evicts itself.

Worked number: B=1 at 4096 tokens reads 16.8 MB (Hkv=8, D=128, fp16); for 3 x 60 MB of L2,
R = ceil(180 / 16.8) = 11 copies.

Kernel rows replay CUDA graphs of ``calls_per_graph`` (c) calls whose copies are fixed at capture.
So that replays continue the walk exactly, one graph is captured per starting copy (R graphs, the
one starting at copy o reading o, o+1, ..., o+c-1 mod R) and each replay starts where the cursor
is. Every copy is then re-read only after all R - 1 others, whatever mix of graph replays and
single calls the interleaved rounds make. R > c only for cases under cold_l2_factor x L2 / c
(18 MB on H200), whose graphs are cheap to capture; R is capped (harness.Settings.max_copies).
"""

from __future__ import annotations

from ..cache import Batch
from ..ceiling import cold_copies  # noqa: F401  (defined with the one-kernel floor, which rotates the same way)
from ..errors import require


def cache_bytes(batch: Batch) -> int:
    """Bytes of one copy of a case's cache: every page of its universe, K and V."""
    spec = batch.spec
    return int(batch.num_pages) * spec.page_size * spec.kv_bytes_per_token


def graph_offsets(copies: int) -> list[int]:
    """First copy of each graph to capture: every copy."""
    require(copies >= 1, f"copies must be >= 1, got {copies}")
    return list(range(copies))


def graph_copies(offset: int, copies: int, calls_per_graph: int) -> list[int]:
    """Copies read, in order, by the calls of the graph starting at ``offset``."""
    return [(offset + i) % copies for i in range(calls_per_graph)]


class CopyCursor:
    """The global walk over copies, shared by every backend and protocol of a case.

    ``next_copy()`` is the copy for the next eager/step/published call; ``next_graph()`` the index
    (into ``offsets``) of the graph to replay next, which reads the next ``calls_per_graph`` copies.
    """

    def __init__(self, copies: int, calls_per_graph: int):
        require(calls_per_graph >= 1, f"calls_per_graph must be >= 1, got {calls_per_graph}")
        self.copies = copies
        self.calls_per_graph = calls_per_graph
        self.offsets = graph_offsets(copies)
        self.position = 0

    def next_copy(self) -> int:
        index = self.position % self.copies
        self.position += 1
        return index

    def next_graph(self) -> int:
        graph = self.position % self.copies
        self.position += self.calls_per_graph
        return graph
