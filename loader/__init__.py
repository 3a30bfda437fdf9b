"""Checkpoint reading and writing: source HF checkpoints, the packed format, pack, layouts."""
from loader.blob import BlobLayout, blob_layout
from loader.layout import ExpertKey, ExpertLayout, ExpertTensor, discover_layout, find_experts_modules
from loader.pack import PackSummary, pack
from loader.packed import BlobRef, Manifest, read_manifest, set_routing_prior

__all__ = [
    "BlobLayout", "BlobRef", "ExpertKey", "ExpertLayout", "ExpertTensor", "Manifest", "PackSummary",
    "blob_layout", "discover_layout", "find_experts_modules", "pack", "read_manifest", "set_routing_prior",
]
