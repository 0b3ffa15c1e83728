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
"""

from __future__ import annotations

import argparse
import importlib.util
import keyword
import re
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


def rename(new: str, dry_run: bool) -> None:
    check_name(new)
    check_checkout(new)
    subs = replacements(new)
    changes = {p: data for p in tracked_files() if (data := renamed_text(p, subs)) is not None}
    relative = sorted(str(p.relative_to(ROOT)) for p in changes)
    move = f"src/{OLD} -> src/{new}"
    if dry_run:
        print(f"would change {len(changes)} files:")
        print("\n".join(f"  {name}" for name in relative))
        print(f"would move {move} (git mv)")
        return
    # move first: if git refuses, nothing has been rewritten yet
    git("mv", f"src/{OLD}", f"src/{new}")
    old_dir, new_dir = ROOT / "src" / OLD, ROOT / "src" / new
    for path, data in changes.items():
        if path.is_relative_to(old_dir):
            path = new_dir / path.relative_to(old_dir)
        path.write_bytes(data)
    print(f"changed {len(changes)} files ({', '.join(subs)} -> {', '.join(subs.values())})")
    print(f"moved {move} (git mv; `git status` shows the rename, nothing is committed)")
    print(f'next: pip uninstall -y {OLD}; pip install -e ".[dev]"  (then review `git diff` and commit)')


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
