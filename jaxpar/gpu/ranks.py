"""A pipeline's ranks simulated side by side, meeting at their collectives over ``pp``.

One SPMD program runs on every device, but a pipeline's ranks take different branches of each
tick (idle, ``F``, ``B``, ``W``; stage 0 embeds, the last stage runs the head and loss): which
one is decided by the rank's row of the schedule table, a constant of the program indexed by
``partition-id``. :class:`jaxpar.analysis.hlo_text.Values` reads it when told the partition, so
the time model (:mod:`jaxpar.gpu.timing`) walks one device of each pipeline rank
(:func:`pipeline_partitions`: the ``pp`` coordinate varied, every other one 0; the devices that
differ only in dp, sp or tp coordinates run the same branches).

The ranks are coupled where they exchange data: a collective whose group spans pipeline ranks
cannot begin on a rank before its peers have reached it. A send/receive pair (NCCL's, what a
``collective-permute`` runs) moves data once both ends have posted it, so a rank's
``collective-permute`` begins when the ranks it sends to and receives from (its
``source_target_pairs``) have reached it; any other collective (the loss's sum over ``pp``)
begins when its last member has. So each rank's walk runs in its own thread, and at each such
collective :class:`Rendezvous` holds it until those peers have arrived: a tick lasts as long
as the slowest rank it exchanges with, and the time a rank waits — the pipeline's bubble and
its imbalance (the head's extra work on the last stage) — is exposed ``pp`` time.

The ranks must reach the same collectives over ``pp`` in the same order (the executor's sends
sit in switches indexed by the tick alone); where they do not,
:class:`Diverged` stops every walk and the caller falls back to one walk with branch counts
averaged over ranks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

WAIT_S = 600.0  # a rank waits this long for the others before the walk is given up


class Diverged(RuntimeError):
    """The ranks' walks did not reach the same collectives over ``pp`` in the same order."""


def pipeline_partitions(mesh: Any) -> list[int]:
    """The partition id of one device per pipeline rank (rank order): the mesh's ``pp``
    coordinate ``r``, every other coordinate 0, in the program's partition order (the mesh's
    devices, row-major). ``[0]`` where the mesh has no ``pp`` axis larger than 1."""
    names = tuple(getattr(mesh, "axis_names", ()))
    shape = tuple(int(s) for s in np.shape(mesh.devices))
    if "pp" not in names or shape[names.index("pp")] <= 1:
        return [0]
    k = names.index("pp")
    out = []
    for r in range(shape[k]):
        at = [0] * len(shape)
        at[k] = r
        out.append(int(np.ravel_multi_index(tuple(at), shape)))
    return out


class Rendezvous:
    """Where the ranks' walks meet (module docstring). Each rank numbers its collectives over
    ``pp`` in the order it reaches them; the ``n``-th of every rank is one collective."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._cv = threading.Condition()
        self._slots: dict[int, dict[int, tuple[str, float, Any]]] = {}
        self._done: set[int] = set()
        self.failed: str | None = None

    def meet(self, rank: int, seq: int, name: str, ready: float, link: Any,
             peers: Sequence[int] | None = None) -> tuple[float, Any]:  # fmt: skip
        """Rank ``rank`` reached its ``seq``-th collective over ``pp`` (HLO ``name``) and could
        begin it at ``ready`` (its clock), its critical path ``link``; ``peers`` the ranks it
        waits for (None: every rank). Returns when they have arrived: the latest ``ready`` of
        them and ``rank``, and that rank's link."""
        wanted = set(range(self.ranks) if peers is None else peers) | {rank}
        with self._cv:
            slot = self._slots.setdefault(seq, {})
            slot[rank] = (name, ready, link)
            self._cv.notify_all()
            while not wanted <= slot.keys() and self.failed is None:
                if any(r in self._done and r not in slot for r in wanted):
                    self.failed = f"{name} (collective {seq} over pp) is not reached by every rank"
                    self._cv.notify_all()
                    break
                if not self._cv.wait(timeout=WAIT_S):
                    self.failed = f"ranks did not meet at {name} within {WAIT_S:.0f} s"
            if self.failed is not None:
                raise Diverged(self.failed)
            names = {v[0] for v in slot.values()}
            if len(names) > 1:
                self.failed = f"collective {seq} over pp differs between ranks: {sorted(names)}"
                self._cv.notify_all()
                raise Diverged(self.failed)
            last = max(wanted, key=lambda r: slot[r][1])
            return slot[last][1], slot[last][2]

    def finished(self, rank: int) -> None:
        """Rank ``rank``'s walk ended (or failed): ranks waiting for it will not be met."""
        with self._cv:
            self._done.add(rank)
            self._cv.notify_all()

    def fail(self, why: str) -> None:
        with self._cv:
            self.failed = self.failed or why
            self._cv.notify_all()


def run_ranks(walk: Callable[[int, Rendezvous], Any], ranks: Sequence[int]) -> list[Any]:
    """``walk(rank, rendezvous)`` for every rank, each in its own thread, meeting at the
    rendezvous; their results in rank order. Raises :class:`Diverged` where the walks did not
    pair up, and re-raises the first exception a walk raised."""
    meet = Rendezvous(len(ranks))
    out: list[Any] = [None] * len(ranks)
    errors: list[BaseException | None] = [None] * len(ranks)

    def one(i: int) -> None:
        try:
            out[i] = walk(i, meet)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors[i] = e
            if not isinstance(e, Diverged):
                meet.fail(f"rank {i}: {type(e).__name__}: {e}")
        finally:
            meet.finished(i)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if e is not None and not isinstance(e, Diverged)]
    if real:
        raise real[0]
    if any(e is not None for e in errors):
        raise Diverged(meet.failed or "the ranks' walks did not pair up")
    return out
