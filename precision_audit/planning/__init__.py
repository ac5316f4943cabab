"""Planning: choose a format per module."""
