"""Assembling a run: everything train.py's loop needs, built from the composed config (run/build.py)."""
