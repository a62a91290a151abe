"""Atomic publish: a reader only ever sees a complete checkpoint, or none.

    <root>/
      latest                  "step_000200" — the commit point, moved with an atomic rename
      step_000200/            DCP files (.metadata, __<rank>_0.distcp) + marker.json, written last
      .tmp-step_000300/       a save in progress (or killed): never read, removed on the next start

A save writes into .tmp-<name>, fsyncs every file, writes marker.json (size + sha256 of every other
file) last, renames the directory into place and only then moves `latest`. A SIGKILL at any moment
leaves either the old `latest` (still complete) or the new one (complete, since the marker went
first). Loading trusts nothing without a marker whose hashes match, and says why it skipped one.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

MARKER = "marker.json"
LATEST = "latest"
FORMAT = "ballast-checkpoint-1"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def _fsync_dir(path: Path) -> None:
    # NOTE: a rename is only durable once the directory holding the entry is fsync'd.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
        os.fsync(f.fileno())  # the data must be on disk before a marker vouches for it
    return h.hexdigest()


def _payload_files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MARKER)


def write_marker(tmp: Path, info: dict) -> dict:
    """Hash every file of the finished write and write marker.json last (fsync'd)."""
    files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _hash_file(p)}
             for p in _payload_files(tmp)}
    if ".metadata" not in files:
        raise RuntimeError(f"{tmp}: DCP wrote no .metadata; refusing to mark it complete")
    marker = {"format": FORMAT, **info, "files": files}
    with open(tmp / MARKER, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    return marker


def check(ckpt: Path, verify_hashes: bool = True) -> str | None:
    """None when `ckpt` is a complete checkpoint, else the reason it is not (one line)."""
    if not ckpt.is_dir():
        return "no such directory"
    try:
        marker = json.loads((ckpt / MARKER).read_text())
    except FileNotFoundError:
        return f"no {MARKER} (an interrupted or unfinished save)"
    except (OSError, ValueError) as e:
        return f"unreadable {MARKER} ({e})"
    if marker.get("format") != FORMAT or not isinstance(marker.get("files"), dict):
        return f"{MARKER} is not a {FORMAT} marker"
    for rel, want in marker["files"].items():
        path = ckpt / rel
        if not path.is_file():
            return f"file {rel} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"file {rel} has {size} bytes, marker says {want['bytes']} (truncated?)"
        if verify_hashes and _hash_file(path) != want["sha256"]:
            return f"file {rel} does not match its sha256 in {MARKER}"
    return None


def read_marker(ckpt: Path) -> dict:
    return json.loads((ckpt / MARKER).read_text())


def write_atomic(path: Path, text: str) -> None:
    """Replace the file `path` with `text` so that a reader, or a crash, or a full disk, sees the old content or
    the new one, never a truncated file: written beside it, fsync'd, renamed over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old content or the new one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def set_latest(root: Path, name: str) -> None:
    if (root / LATEST).is_dir():  # damage (a directory where the pointer file belongs): out of the way
        _discard(root / LATEST)
    write_atomic(root / LATEST, name + "\n")


def read_latest(root: Path) -> str | None:
    try:
        name = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):  # missing, a directory, unreadable bytes: damage like any other
        return None  # NOTE: UnicodeDecodeError is a ValueError, which train.py would call a config error
    return name if _STEP_DIR.match(name) else None


def _discard(path: Path) -> None:
    """Delete a directory so that no crash can leave it looking complete: rename away, then remove."""
    trash = path.with_name(f".trash-{path.name}-{time.time_ns()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def publish(tmp: Path, root: Path, name: str) -> Path:
    """Rename a marked temp directory into place, then move `latest` to it."""
    final = root / name
    if final.exists():
        # WARN: only reached when a run re-saves a step it already saved (resumed from an older
        # checkpoint). The old directory goes only after the new one is complete and marked.
        _discard(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    set_latest(root, name)
    return final


def list_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every step_* directory, oldest first; complete or not."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def clean_stale(root: Path) -> list[str]:
    """Remove leftovers of killed saves (.tmp-*, .trash-*); return their names for the log."""
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return sorted(p.name for p in stale)


def prune(root: Path, keep_last: int, keep_every: int | None) -> list[str]:
    """Retention: keep the newest `keep_last` checkpoints, every step divisible by `keep_every`, and
    whatever `latest` names; delete the rest. Returns the deleted names."""
    steps = list_steps(root)
    keep = {p.name for _, p in steps[-keep_last:]} | {read_latest(root)}
    if keep_every:
        keep |= {p.name for s, p in steps if s % keep_every == 0}
    gone = [p for _, p in steps if p.name not in keep]
    for p in gone:
        _discard(p)
    return [p.name for p in gone]


def resolve(spec: str, root: Path, verify_hashes: bool = True) -> tuple[Path, list[str]]:
    """The checkpoint `spec` names, and log lines for everything skipped on the way.

    spec: "latest" (under `root`), a checkpoint directory, or a checkpoints root (holding `latest`).
    An explicitly named checkpoint must be complete; "latest" falls back to the newest older
    complete one, and says so.
    """
    path = Path(spec)
    if spec != LATEST and ((path / MARKER).exists() or _STEP_DIR.match(path.name)):
        reason = check(path, verify_hashes)
        if reason:
            raise ValueError(f"resume={spec}: not a complete checkpoint: {reason}")
        return path, []
    if spec != LATEST:
        if not path.is_dir():
            raise ValueError(f"resume={spec}: no such checkpoint or checkpoint directory")
        root = path
    notes = []
    name = read_latest(root)
    if name is None:
        notes.append(f"{root / LATEST} is missing or unreadable; scanning {root} for checkpoints")
    candidates = list(reversed(list_steps(root)))
    if name is not None:
        committed = int(_STEP_DIR.match(name).group(1))
        newer = [p.name for s, p in candidates if s > committed]
        if newer:  # a save was renamed into place but died before moving `latest`
            notes.append(f"ignoring {', '.join(newer)}: newer than {LATEST} ({name}), never committed")
        candidates = [(s, p) for s, p in candidates if s <= committed]
        if not (root / name).is_dir():  # only a re-save of the same step, killed between its renames
            notes.append(f"{LATEST} names {name}, which is missing; falling back to an older checkpoint")
    for _, p in candidates:
        reason = check(p, verify_hashes)
        if reason is None:
            return p, notes
        notes.append(f"skipping checkpoint {p.name}: {reason}; falling back to an older one")
    raise ValueError(f"resume={spec}: no complete checkpoint under {root}" + (f" ({notes[-1]})" if notes else ""))
