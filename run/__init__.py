"""The run: its configuration schema (run/config.py) and, later, how a run is built from it."""
