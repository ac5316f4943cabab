"""Which part of a tensor this rank counts (docs/distributed.md): the helpers live in capture/shards.py, where
the capture session uses them, and are re-exported here for the distributed audit."""

from ..capture.shards import local_tensor, owned_part, set_replicated_owner

__all__ = ["local_tensor", "owned_part", "set_replicated_owner"]
