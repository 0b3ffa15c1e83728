"""Rename the template's package `halfprec` to your project's name.

    python scripts/rename.py myproj            # rename: src/halfprec -> src/myproj, and every mention
    python scripts/rename.py myproj --dry-run  # only list what would change

What it touches, and why only that:
- files tracked by git (`git ls-files`), so never .git/ (a rewritten .git/index is a corrupt
  repository), nor outputs/, a venv in the tree, W&B files or anything else untracked or ignored;
- text files only: a file with a NUL byte or that is not UTF-8 is binary (plots, checkpoints)
  and is left byte for byte as it is;
- not outputs/ even where a file there is tracked: runs record what they ran as;
- not this script: it keeps the old name, so a second run finds src/halfprec gone and refuses
  instead of replacing the new name, which may be a common word, all over the tree.

It replaces halfprec -> myproj, HALFPREC -> MYPROJ (the HALFPREC_DATA variable) and
Halfprec -> Myproj (class names; my_proj gives MyProj), and moves the package with `git mv`,
so `git status` shows a rename. Nothing is committed: review with `git diff`, then commit.
Standard library only, and it does not import the package, which it is about to move.

Two things besides, so that the tree passes CI and pip forgets the old name:
- `ruff format` and `ruff check --fix` on the Python files it changed, when ruff is installed (a
  dev dependency): a name of another length moves line breaks, and CI runs `ruff format --check .`.
  Lines a longer name pushed over the line limit are listed: ruff cannot shorten a string or a comment.
- it removes src/halfprec.egg-info, setuptools' git-ignored metadata of the old install: an editable
  install puts src/ on sys.path, where pip and importlib.metadata would go on reading it as an
  installed `halfprec` after the reinstall under the new name.
"""

from __future__ import annotations

import argparse
import importlib.util
import keyword
import re
import shutil
import subprocess
import sys
from pathlib import Path

OLD = "halfprec"
ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve()
SKIP_DIRS = ("outputs/",)  # run records: they say what they ran as


class RenameError(Exception):
    """A one-line reason to stop, before anything is changed."""


def camel(name: str) -> str:
    """`my_proj` -> `MyProj`: the spelling of the name inside class names such as `HalfprecLoop`."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def replacements(new: str) -> dict[str, str]:
    return {OLD: new, OLD.upper(): new.upper(), camel(OLD): camel(new)}


def check_name(new: str) -> None:
    """The name must work as `import new` everywhere, and not hide a standard-library module."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", new):
        raise RenameError(f"{new!r} is not a lowercase Python identifier (letters a-z, digits, _; not first a digit)")
    if keyword.iskeyword(new):
        raise RenameError(f"{new!r} is a Python keyword; `import {new}` would be a syntax error")
    # all platforms' names, not only this one's: a package named `winreg` breaks on Windows
    if new in sys.stdlib_module_names or new in sys.builtin_module_names:
        raise RenameError(f"{new!r} is a standard-library module; your package would hide it")
    if new == OLD:
        raise RenameError(f"the package is already named {OLD!r}")
    if importlib.util.find_spec(new) is not None:  # torch, hydra, omegaconf, ...: a dependency of yours
        raise RenameError(f"{new!r} is an installed package; one of the two would hide the other")


def git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or ["failed"])[0]
        raise RenameError(f"git {' '.join(args)}: {detail}")
    return result.stdout


def check_checkout(new: str) -> None:
    """A git checkout of the template that is not renamed yet, with room for the new package."""
    try:
        inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT, capture_output=True, text=True)
    except FileNotFoundError:
        raise RenameError("git not found; the rename needs git to know which files are yours") from None
    if inside.stdout.strip() != "true":
        raise RenameError(f"{ROOT} is not a git checkout; run `git init && git add -A && git commit` there first")
    if not (ROOT / "src" / OLD).is_dir():
        raise RenameError(f"src/{OLD} not found: the package is already renamed (this script renames only {OLD!r})")
    if (ROOT / "src" / new).exists():
        raise RenameError(f"src/{new} already exists")


def tracked_files() -> list[Path]:
    """The files git tracks, minus run records and this script; no symlinks (their target may be outside)."""
    names = [n for n in git("ls-files", "-z").split("\0") if n]
    paths = [ROOT / n for n in names if not n.startswith(SKIP_DIRS)]
    # a deleted-but-tracked file or a submodule is not a file; a symlink is rewritten through its target
    return [p for p in paths if p.is_file() and not p.is_symlink() and p.resolve() != SELF]


def renamed_text(path: Path, subs: dict[str, str]) -> bytes | None:
    """The file's new bytes, or None when it is binary or has nothing to replace."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    new_text = text
    for old, new in subs.items():
        new_text = new_text.replace(old, new)
    # bytes in, bytes out: line endings and the file's mode stay as they are
    return new_text.encode("utf-8") if new_text != text else None


def stale_egg_info() -> Path | None:
    """src/<old>.egg-info when setuptools left one there and git does not track it: metadata of the
    old install, which `pip install -e .` under the new name neither uses nor removes."""
    path = ROOT / "src" / f"{OLD}.egg-info"
    if not path.is_dir() or git("ls-files", "--", str(path.relative_to(ROOT))).strip():
        return None
    return path


NO_RUFF = "ruff not found: run `ruff format .` and `ruff check .` (CI runs both) once it is installed"


def ruff_command() -> list[str] | None:
    """This environment's ruff (a dev dependency, the one pre-commit and CI run); None without one."""
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    found = shutil.which("ruff")
    return [found] if found else None


def tidy(paths: list[Path]) -> list[str]:
    """`ruff format`, then `ruff check --fix`, on the renamed Python files; the lines to print: what
    ran, and what ruff still finds (a string or comment a longer name made too long)."""
    ruff = ruff_command()
    if ruff is None:
        return [NO_RUFF]
    if not paths:  # ruff with no paths would take the whole tree
        return []
    names = [str(p.relative_to(ROOT)) for p in paths]
    # --force-exclude: files named on the command line still obey the project's exclude settings
    check = (*ruff, "check", "--fix", "--force-exclude", "--quiet", "--output-format", "concise")
    ruff_run = [(*ruff, "format", "--force-exclude", "--quiet"), check]
    done = [subprocess.run([*args, *names], cwd=ROOT, capture_output=True, text=True) for args in ruff_run]
    if done[0].returncode != 0:
        detail = (done[0].stderr.strip().splitlines() or ["failed"])[0]
        return [f"ruff format failed ({detail}): run `ruff format .` and `ruff check .` by hand"]
    lines = [f"formatted the {len(names)} changed Python files (ruff format; ruff check --fix)"]
    if done[1].returncode != 0:  # 1: findings it could not fix (stdout); 2: ruff itself failed (stderr)
        left = [line for line in (done[1].stdout or done[1].stderr).splitlines() if line.strip()]
        lines.append("ruff check still finds these in them (lines a longer name made too long: shorten them):")
        lines += [f"  {line}" for line in left]
    return lines


def rename(new: str, dry_run: bool) -> None:
    check_name(new)
    check_checkout(new)
    subs = replacements(new)
    changes = {p: data for p in tracked_files() if (data := renamed_text(p, subs)) is not None}
    relative = sorted(str(p.relative_to(ROOT)) for p in changes)
    move = f"src/{OLD} -> src/{new}"
    egg_info = stale_egg_info()
    python = sum(p.suffix in (".py", ".pyi") for p in changes)
    if dry_run:
        print(f"would change {len(changes)} files:")
        print("\n".join(f"  {name}" for name in relative))
        print(f"would move {move} (git mv)")
        tidying = f"would run ruff format and ruff check --fix on the {python} changed Python files"
        print(tidying if ruff_command() else NO_RUFF)
        if egg_info:
            print(f"would remove src/{egg_info.name} (git-ignored metadata of the old install)")
        return
    # move first: if git refuses, nothing has been rewritten yet
    git("mv", f"src/{OLD}", f"src/{new}")
    old_dir, new_dir = ROOT / "src" / OLD, ROOT / "src" / new
    written = []
    for path, data in changes.items():
        if path.is_relative_to(old_dir):
            path = new_dir / path.relative_to(old_dir)
        path.write_bytes(data)
        written.append(path)
    print(f"changed {len(changes)} files ({', '.join(subs)} -> {', '.join(subs.values())})")
    print(f"moved {move} (git mv; `git status` shows the rename, nothing is committed)")
    for line in tidy([p for p in written if p.suffix in (".py", ".pyi")]):
        print(line)
    if egg_info:
        shutil.rmtree(egg_info)
        print(f"removed src/{egg_info.name}: pip would go on listing {OLD} from it (the reinstall does not need it)")
    # the old install's record in site-packages stays until pip uninstalls it by its old name
    uninstall = f"pip uninstall -y {OLD} (its install stays listed otherwise)"
    print(f'next: {uninstall}; pip install -e ".[dev]"  (then review `git diff` and commit)')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=f"Rename the package {OLD!r} in this git checkout.")
    parser.add_argument("new_name", help="the new package name: a lowercase Python identifier")
    parser.add_argument("--dry-run", action="store_true", help="list the files that would change; change nothing")
    args = parser.parse_args(argv)
    try:
        rename(args.new_name, args.dry_run)
    except RenameError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
