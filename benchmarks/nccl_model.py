"""What an NCCL all-reduce of n bytes costs at W ranks: NCCL's own tuning model, written out.

[Note: the all-reduce cost model]
NCCL picks an algorithm and a protocol per call by predicting each one's
time as ``latency + bytes / bandwidth`` and taking the smallest
(``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime`` in NVIDIA/nccl
``src/graph/tuning.cc``; the constants below are that file's defaults at
commit 5067397c, June 2026). For an all-reduce over N nodes of g GPUs each
(W = N·g ranks), per algorithm a and protocol p, in µs:

* tree: ``base[a][p] + 2·((g - 1)·nvlink[a][p] + floor(log2 N)·net[a][p])``;
* ring: ``base[a][p] + (2(W-1) - 2(N-1))·max(nvlink[a][p], o) + 2(N-1)·net[a][p]``,
  with o the network post overhead (1 µs, x3 for Simple), and x1.4 (the
  "plateau" correction on Hopper) once each rank's share per channel
  reaches 64 bytes for Simple;

and the algorithm bandwidth (GB/s) from the per-channel inter-node
bandwidth times the channel count (``bus``), refined per protocol as NCCL
does (LL capped at ``llMaxBw``, LL128 at 120/128 and a per-channel cap,
tree at 0.92 and a per-channel cap, then halved for the tree's two passes;
ring times W / 2(W-1)), and for a tree multiplied by NCCL's correction for
medium sizes. The hardware assumed is stated in :class:`Fabric`: Hopper
GPUs, 8 per node over NVLink, one 400 Gb/s NIC per GPU, x86 (Intel) hosts.
NVLS/CollNet (switch offload) and PAT are left out: they need hardware or
layouts not every cluster has; where present they only lower the latency
floor, which makes a larger vector *relatively* more expensive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Fabric", "ModelTime", "allreduce_us", "predict"]

_ALGOS = ("tree", "ring")
_PROTOS = ("LL", "LL128", "Simple")

#: baseLatencies (µs), tuning.cc defaults: tree, ring x LL, LL128, Simple.
_BASE = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)}
#: hwLatencies (µs) over NVLink and over the network.
_NVLINK = {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4)}
_NET = {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0)}
#: Hopper, more than two nodes: llMaxBws (Intel host), perChMaxRingLL128Bws,
#: perChMaxTreeLL128Bws, perChMaxTreeBws (GB/s).
_LL_MAX_BW = 20.4
_RING_LL128_PER_CH = 36.7
_TREE_LL128_PER_CH = 29.0
_TREE_PER_CH = 36.0
#: treeCorrectionFactor rows (LL, LL128, Simple), indexed by floor(log2(bytes / 64)).
_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)  # fmt: skip
_NET_OVERHEAD_US = 1.0  # Intel x86 host
_RING_PLATEAU = 1.4  # Hopper (compute capability >= 8.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Fabric:
    """The cluster the model assumes (NCCL's graph search finds these on a real one)."""

    gpus_per_node: int = 8
    #: Channels NCCL runs the tree and ring on, and each channel's inter-node bandwidth
    #: (GB/s): 16 x 25 = 400 GB/s per node, one 400 Gb/s (50 GB/s) NIC per GPU.
    channels: int = 16
    bw_inter_per_channel: float = 25.0


@dataclass(frozen=True, slots=True)
class ModelTime:
    """The predicted time of one all-reduce, and the algorithm/protocol NCCL would choose."""

    us: float
    algo: str
    proto: str


def _log2i(n: int) -> int:
    return max(n, 1).bit_length() - 1


def _latency(algo: str, p: int, ranks: int, nodes: int, fabric: Fabric) -> float:
    g = ranks // nodes
    if algo == "tree":
        return _BASE[algo][p] + 2 * ((g - 1) * _NVLINK[algo][p] + _log2i(nodes) * _NET[algo][p])
    overhead = _NET_OVERHEAD_US * (3 if _PROTOS[p] == "Simple" else 1) if nodes > 1 else 0.0
    steps, inter = 2 * (ranks - 1), 2 * (nodes - 1)
    intra = max(_NVLINK[algo][p], overhead)
    return _BASE[algo][p] + (steps - inter) * intra + inter * _NET[algo][p]


def _bandwidth(algo: str, p: int, ranks: int, fabric: Fabric) -> float:
    ch = fabric.channels
    bus = ch * fabric.bw_inter_per_channel
    proto = _PROTOS[p]
    if algo == "ring":
        if proto == "LL":
            bus = min(_LL_MAX_BW, bus * 0.5)
        elif proto == "LL128":
            bus = min(bus * 0.92, ch * _RING_LL128_PER_CH)
        return bus * ranks / (2 * (ranks - 1))
    bus = min(bus * 0.92, ch * _TREE_PER_CH)
    if proto == "LL":
        bus = min(bus / 3.8, _LL_MAX_BW)
    elif proto == "LL128":
        bus = min(bus * 120.0 / 128.0, ch * _TREE_LL128_PER_CH)
    return bus * 0.5


def predict(nbytes: int, ranks: int, fabric: Fabric | None = None) -> list[ModelTime]:
    """Every algorithm/protocol's predicted time for an all-reduce of ``nbytes`` over ``ranks``."""
    fabric = fabric or Fabric()
    if ranks % fabric.gpus_per_node or ranks < 2 * fabric.gpus_per_node:
        raise ValueError(
            f"ranks={ranks}: the model is for whole nodes of {fabric.gpus_per_node} GPUs, "
            "at least two of them"
        )
    nodes = ranks // fabric.gpus_per_node
    out = []
    for algo in _ALGOS:
        for p, proto in enumerate(_PROTOS):
            lat = _latency(algo, p, ranks, nodes, fabric)
            bw = _bandwidth(algo, p, ranks, fabric)
            log_size = _log2i(nbytes >> 6) if nbytes >= 64 else 0
            if algo == "tree" and log_size < len(_TREE_CORRECTION[p]):
                bw *= _TREE_CORRECTION[p][log_size]
            if algo == "ring" and proto == "Simple" and nbytes / (fabric.channels * ranks) >= 64:
                lat *= _RING_PLATEAU
            out.append(ModelTime(lat + nbytes / (1000.0 * bw), algo, proto))
    return out


def allreduce_us(nbytes: int, ranks: int, fabric: Fabric | None = None) -> ModelTime:
    """The fastest prediction: what NCCL's tuner would pick, and its time in µs."""
    return min(predict(nbytes, ranks, fabric), key=lambda t: (t.us, t.algo, t.proto))


if __name__ == "__main__":  # pragma: no cover - a quick look: python -m ...
    for w in (1024, 16384, 65536, 131072):
        for n in (8, 8 * (4 * w + 2)):
            t = allreduce_us(n, w)
            print(w, n, f"{t.us:.1f}", t.algo, t.proto, f"log2={math.log2(n):.1f}")
