"""Labs: each claim of the course notes as a runnable experiment (`python -m labs.run --list`).

A lab is a module here with TITLE, run(seed, quick) -> dict and plot(result, path). The result holds
`ok` (did the expected effect appear?), `checks` (each claim → bool) and `table` (the printed report);
labs/run.py prints it, saves result.json and a PNG, and exits non-zero when ok is false.
"""

# name -> module; lazily imported so `--list` never pays for a lab's imports.
LABS = {
    "lowprec_gemm": "labs.lowprec_gemm",
}
