"""One layer's time on one device for one micro-batch: its compute and the tensor- and
sequence-parallel calls inside it (a leaf of the time model: :mod:`jaxpar.planner.cost`
builds it, :mod:`jaxpar.planner.comm` and the pipeline read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Calls:
    """The collective calls of one axis in one layer and micro-batch, forward and backward
    (the backward without the forward a full recompute repeats)."""

    fwd_s: float = 0.0  # seconds of the forward's calls, latency included
    bwd_s: float = 0.0
    fwd_latency_s: float = 0.0
    bwd_latency_s: float = 0.0
    fwd_calls: int = 0
    bwd_calls: int = 0
    fwd_bytes: float = 0.0  # wire bytes per device
    bwd_bytes: float = 0.0
    link: str = "intra"
    algorithm: str = "none"
    kind: str = ""  # what the calls are, e.g. "all-gather + reduce-scatter"
    # seconds of the calls above whose result the next kernel waits for (a current-scaling FP8
    # scale's max: the GEMM quantizes with it), which nothing hides
    fwd_sync_s: float = 0.0
    bwd_sync_s: float = 0.0


@dataclass(frozen=True)
class LayerTime:
    """One layer, one micro-batch, on one device (seconds)."""

    compute: float  # forward FLOPs and memory-bound work
    matmul: float  # the part of it the tp collectives may hide behind (collective matmuls)
    attention: float  # the attention core (ring sends may hide behind it)
    tp: Calls
    sp: Calls
    efficiency: float
    recompute: float = 0.0  # forward work the backward re-runs (remat full: all of it)
    overlap_tp: float = 0.0  # share of the matmuls beside them that hides tp calls
    ring_hidden: float = 0.0  # share of the tp calls hidden (rings; FP8: XLA's scheduler)
    backward_extra: float = 0.0  # backward compute beyond twice the forward (flash kernels)
    # the weight groups XLA gathers one at a time (ZeRO-3), in the order the forward uses them:
    # (forward seconds of its kernels, its local parameters); jaxpar.planner.zero3
    weight_groups: tuple[tuple[float, float], ...] = ()
    chunks: int = 1  # kernels each weight matmul runs as (tp ring chunks under Megatron-SP)

    @property
    def backward(self) -> float:
        """Backward compute (no communication, no recompute)."""
        return 2 * self.compute + self.backward_extra

    def hidden(self, axis: str, backward: bool = False) -> float:
        """Seconds of the ``axis`` ('tp' or 'sp') calls hidden behind the compute they are
        paired with (the matmuls for tp, the attention core for ring sp sends), up to its
        length, for an executor that overlaps them."""
        calls = self.tp if axis == "tp" else self.sp
        secs = calls.bwd_s - calls.bwd_sync_s if backward else calls.fwd_s - calls.fwd_sync_s
        window = (self.matmul if axis == "tp" else self.attention) * (2 if backward else 1)
        ring = self.ring_hidden * secs if axis == "tp" else 0.0
        return max(min(secs, self.overlap_tp * window), ring)

    @property
    def forward(self) -> float:
        """Forward with its exposed tp/sp calls."""
        return (self.compute + self.tp.fwd_s - self.hidden("tp") + self.sp.fwd_s
                - self.hidden("sp"))  # fmt: skip

    @property
    def backward_comm(self) -> float:
        """Exposed tp/sp calls of the backward (not counting a recompute's)."""
        return (self.tp.bwd_s - self.hidden("tp", True) + self.sp.bwd_s
                - self.hidden("sp", True))  # fmt: skip
