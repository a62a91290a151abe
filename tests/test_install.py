"""The install takes no common names: `pip install -e .` installs the dependencies only, and the code runs
from the repository root (pyproject.toml), so a second checkout and an unrelated `data` or `model` package
never meet ours."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import HANG_S, ROOT, TINY, env

JUNK = shutil.ignore_patterns(".git", ".venv", "runs", "outputs", "multirun", "wandb", "__pycache__", "*.egg-info",
                              "build", "out")


def our_names(root: Path) -> list[str]:
    """The repository's top-level importable names: its packages and its root modules."""
    return sorted([p.parent.name for p in root.glob("*/__init__.py")] + [p.stem for p in root.glob("*.py")])


def install(root: Path, prefix: Path) -> Path:
    """`pip install -e root` into a scratch prefix; its site-packages directory. No dependencies (the point
    is what the project itself registers) and no build isolation: the build backend, setuptools, is already
    here (torch requires it), so nothing is downloaded."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
           "--prefix", str(prefix), "-e", str(root)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-2000:]
    (site,) = prefix.glob("lib/python*/site-packages")
    return site


def resolve(names: list[str], cwd: Path, site: Path) -> dict[str, str | None]:
    """Where each name imports from in a fresh interpreter run from `cwd`, with `site` as its only site
    directory (its .pth files processed, as site-packages' are): the file, or None. find_spec only: no
    module runs, so torch is not needed."""
    code = ("import importlib.util, json, site, sys\n"
            f"site.addsitedir({str(site)!r})\n"
            "specs = {n: importlib.util.find_spec(n) for n in sys.argv[1:]}\n"
            "print(json.dumps({n: s and s.origin for n, s in specs.items()}))\n")
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -S: not the environment's site-packages (a developer's may hold another checkout's install)
    r = subprocess.run([sys.executable, "-S", "-c", code, *names], cwd=cwd, env=e, capture_output=True, text=True,
                       timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_a_copy_run_from_its_root_imports_only_its_own_files(tmp_path):
    site = install(ROOT, tmp_path / "env")  # the original checkout, installed as the README says
    copy = tmp_path / "copy"
    shutil.copytree(ROOT, copy, ignore=JUNK)
    names = our_names(ROOT)
    assert {"model", "data", "doctor", "train"} <= set(names)
    gone = "labs"  # a package the student deleted from the copy must not come back from the original
    shutil.rmtree(copy / gone)

    where = resolve(names, copy, site)
    assert where.pop(gone) is None
    outside = {n: f for n, f in where.items() if not (f and Path(f).resolve().is_relative_to(copy.resolve()))}
    assert not outside, f"run from the copy's root, these resolve outside it: {outside}"
    # from anywhere else the install itself provides none of them
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert resolve(names, elsewhere, site) == dict.fromkeys(names)


def test_unrelated_data_and_model_packages_on_the_path_do_not_shadow_ours(tmp_path):
    others = tmp_path / "site"
    for name in ("data", "model"):
        (others / name).mkdir(parents=True)
        (others / name / "__init__.py").write_text(f"raise RuntimeError('the unrelated {name} package was imported')\n")
    # PYTHONPATH comes after the script's directory, where an installed package's site-packages is too
    e = {**env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(others), os.environ.get("PYTHONPATH")]))}
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "train.py", f"hydra.run.dir={run}", *TINY, "train.steps=2",
                        "train.eval_every=2", "logging.plot=false"], cwd=ROOT, env=e, capture_output=True, text=True,
                       timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


def test_the_doctor_imports_no_torch():
    """The doctor reads a run's files with the schedule's arithmetic (optim/schedule.py), never the training
    stack: `import optim.schedule` must not pull torch in through the optim package."""
    code = ("import sys\n"
            "from doctor.cli import doctor\n"
            "from doctor.timeline import lr_schedule\n"
            "lr = lr_schedule({'optim': {'lr': 1e-3, 'schedule': {'name': 'cosine', 'warmup_steps': 5}},"
            " 'train': {'steps': 20}})\n"
            "print(lr(5), 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True,
                       timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["0.001", "False"]
