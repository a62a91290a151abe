"""Labs: each claim of the course (docs/course.md) as a runnable experiment (`python -m labs.run --list`).

A lab is a module here with TITLE, run(seed, quick) -> dict and plot(result, path). The result holds
`ok` (did the expected effect appear?), `checks` (each claim → bool) and `table` (the printed report);
labs/run.py prints it, saves result.json and a PNG, and exits non-zero when ok is false.
"""

# name -> module; lazily imported so `--list` never pays for a lab's imports.
LABS = {
    "lowprec_gemm": "labs.lowprec_gemm",
    "gradients": "labs.gradients",
    "mixture": "labs.mixture",
    "microbatch_mean": "labs.claims.microbatch_mean",
    "shard_norm": "labs.claims.shard_norm",
    "clip_unscale": "labs.claims.clip_unscale",
    "swiglu_clamp": "labs.claims.swiglu_clamp",
    "resume_jump": "labs.claims.resume_jump",
    "zloss": "labs.claims.zloss",
    "clip_always": "labs.claims.clip_always",
    "rho_early": "labs.claims.rho_early",
    "levers": "labs.lever_headroom",
    "anticipatory": "labs.anticipatory_ablation",
}
