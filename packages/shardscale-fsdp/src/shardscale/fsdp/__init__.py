"""shardscale.fsdp: gradient adapters that tell shardscale how sharded models lay out their gradients.

Installing ``shardscale-fsdp`` is all it takes: the adapters register through
the ``shardscale`` entry point and :class:`shardscale.core.ShardedGradScaler`
(and ``shardscale.clip``) pick them up for every parameter they claim.

========================  ==========================================  ========
adapter                   parameters                                  priority
========================  ==========================================  ========
``fsdp1``                 FSDP1 ``FlatParameter`` s and, with         30
                          ``use_orig_params=True``, original params
``dtensor``               any ``DTensor``: FSDP2 ``fully_shard``      20
                          (1-D, HSDP, FSDP+TP), tensor parallel,
                          FSDP2-based ``replicate``
``plain`` (core)          plain tensors: DDP, one process             0
========================  ==========================================  ========
"""

from __future__ import annotations

from shardscale.fsdp._dtensor import DTENSOR_PRIORITY, DTensorAdapter
from shardscale.fsdp._fsdp1 import (
    FSDP1_PRIORITY,
    Fsdp1Adapter,
    Fsdp1Layout,
    fsdp1_layout,
    register_fsdp1,
)
from shardscale.fsdp._mesh_replicas import ALL_DIMS, ReplicaStatus, replica_status

__all__ = [
    "DTensorAdapter",
    "Fsdp1Adapter",
    "register_fsdp1",
    "fsdp1_layout",
    "Fsdp1Layout",
    "replica_status",
    "ReplicaStatus",
    "ALL_DIMS",
    "DTENSOR_PRIORITY",
    "FSDP1_PRIORITY",
]
