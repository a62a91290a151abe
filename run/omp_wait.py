"""Imported before torch by the entry points that train (train.py, labs/run.py): how OpenMP threads wait.

GNU OpenMP (the CPU build of torch) spins a thread that reaches a barrier early for GOMP_SPINCOUNT
iterations (300,000 by default) before it sleeps. Alone on its cores that costs nothing; on a machine
shared with other processes the spinning threads take the cores the late thread needs, so every parallel
region waits for a descheduled thread and the step collapses (python -m bench.speed.threads measures it). A short
spin keeps the idle speed and sleeps soon enough to give the cores back. Set before libgomp loads (it reads
its environment once); an explicit GOMP_SPINCOUNT or OMP_WAIT_POLICY of the user's wins.
"""
import os

SPIN = "1000"

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN)
