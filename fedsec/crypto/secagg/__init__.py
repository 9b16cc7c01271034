"""SecAgg+ secure summation (Bell et al. 2020) as sans-I/O state machines."""

from fedsec.crypto.secagg.client import ClientSession, ClientStage
from fedsec.crypto.secagg.graph import NeighbourGraph, default_neighbors, prune
from fedsec.crypto.secagg.messages import (
    AdvertiseKeys,
    ConsistencyProof,
    ConsistencySignature,
    EncryptedShare,
    KeyList,
    MaskedInput,
    SecAggParams,
    ShareKeys,
    ShareRelay,
    UnmaskRequest,
    UnmaskResponse,
)
from fedsec.crypto.secagg.server import RoundResult, ServerSession, ServerStage

__all__ = [
    "AdvertiseKeys",
    "ClientSession",
    "ClientStage",
    "ConsistencyProof",
    "ConsistencySignature",
    "EncryptedShare",
    "KeyList",
    "MaskedInput",
    "NeighbourGraph",
    "RoundResult",
    "SecAggParams",
    "ServerSession",
    "ServerStage",
    "ShareKeys",
    "ShareRelay",
    "UnmaskRequest",
    "UnmaskResponse",
    "default_neighbors",
    "prune",
]
