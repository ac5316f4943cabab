"""Analysis: turn captured statistics into findings (error metrics, ranges, loss scale)."""
