"""Checkpoint reading and writing: source HF checkpoints, the packed format, pack, layouts."""
from .blob import BlobLayout, blob_layout
from .layout import ExpertKey, ExpertLayout, ExpertTensor, discover_layout, find_experts_modules
from .lock import DestinationLocked
from .pack import PackSummary, pack
from .packed import BlobRef, Manifest, read_manifest, set_routing_prior

__all__ = [
    "BlobLayout", "BlobRef", "DestinationLocked", "ExpertKey", "ExpertLayout", "ExpertTensor", "Manifest", "PackSummary",
    "blob_layout", "discover_layout", "find_experts_modules", "pack", "read_manifest", "set_routing_prior",
]
