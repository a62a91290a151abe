"""Imported first by train.py, before torch: a Ctrl-C before the run has begun (while Python imports torch,
Hydra composes the config, the process group forms) exits at once in one line, not a 30-line traceback out of
an import. Nothing is running yet, so nothing is lost: what this start made and left empty is removed.

Interrupts (run/lifecycle.py) takes SIGINT over for the run's life, from before it is built until its last
save, and hands it back after: a Ctrl-C then, as the process exits, is answered here too.
"""
import os
import signal
import sys


def _interrupted(signum, frame) -> None:
    lifecycle = sys.modules.get("run.lifecycle")  # loaded once the imports got that far
    if lifecycle is not None:
        try:
            lifecycle.remove_new_dirs()
        except OSError:  # NOTE: best effort: the process exits next either way, and says so
            pass
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank gets the Ctrl-C: one line
        os.write(2, b"ballast: SIGINT outside the training loop: exiting (no run in progress, nothing to save)\n")
    os._exit(128 + signal.SIGINT)  # run/lifecycle.py Exit.ABORTED (not imported: torch may be loading)


def _is_program() -> bool:
    """train.py runs as the program (python train.py, torchrun, runpy): a test that imports it keeps its Ctrl-C."""
    main = sys.modules.get("__main__")
    return os.path.basename(getattr(main, "__file__", None) or "") == "train.py"


if _is_program():
    signal.signal(signal.SIGINT, _interrupted)
