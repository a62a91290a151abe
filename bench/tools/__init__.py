"""Tools a user runs on their own runs and changes (bench/__init__.py lists every group)."""
