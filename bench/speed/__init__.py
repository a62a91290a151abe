"""Speed and overhead benchmarks (bench/__init__.py lists every group)."""
