"""specula.targets: the target VLM behind one small protocol (see README.md in this folder).

Knows nothing of Ray or gRPC.
"""

from .hf_target import HFTarget
from .kv import KVPolicy
from .llava import LlavaTarget
from .loading import BACKENDS, load_target
from .protocol import Target
from .qwen2_5_vl import Qwen2_5_VLTarget
from .types import (
    Accept,
    DraftBlock,
    PrefillOutput,
    PrefillRequest,
    TargetFeatures,
    TargetInfo,
    VerifyOutput,
    VisualFeatures,
)

__all__ = [
    "Accept",
    "BACKENDS",
    "DraftBlock",
    "HFTarget",
    "KVPolicy",
    "LlavaTarget",
    "PrefillOutput",
    "PrefillRequest",
    "Qwen2_5_VLTarget",
    "Target",
    "TargetFeatures",
    "TargetInfo",
    "VerifyOutput",
    "VisualFeatures",
    "load_target",
]
