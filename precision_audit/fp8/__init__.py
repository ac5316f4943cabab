"""FP8 and block-scaled formats: exact CPU quantisers, per-layer measurement per recipe, cost (docs/fp8.md)."""
