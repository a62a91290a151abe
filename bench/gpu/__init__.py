"""The GPU checks: bash bench/gpu/all.sh on a GPU machine (bench/__init__.py lists every group)."""
