"""The doctor's evaluation harness (bench/__init__.py lists every group)."""
