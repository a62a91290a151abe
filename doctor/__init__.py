"""The doctor: offline diagnosis of a finished run from the files it wrote (metrics.jsonl, events.jsonl,
config.yaml, checkpoints), and single-batch replay. Never imported by the training step.

    python -m doctor runs/<run>                   # report.md, report.json, doctor_timeline.png
    python -m doctor.replay runs/<run> --step S   # one logged batch again, FP32 or FP64
"""
