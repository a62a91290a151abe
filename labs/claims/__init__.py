"""The small claim labs: one course-note claim each, shown on the repository's own code in seconds.

Every lab here builds the same tiny dense model on the embedded synthetic data (labs/claims/tiny.py)
and drives it only through the real step pieces — optim/accumulate.py, optim/clip.py,
optim/scaler.py, precision/step.py, model/, checkpoint/, data/loader.py — so a lab that stops showing
its effect points at a change in those pieces, not at a second implementation.
"""
