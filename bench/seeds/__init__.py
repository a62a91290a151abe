"""Do the demos hold over seeds and threads (bench/__init__.py lists every group)."""
