"""The run: its configuration schema (run/config.py) and the run object built from it (run/build.py)."""
