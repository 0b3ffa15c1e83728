"""scripts/rename.py, always on a throwaway copy of the repository, never on the checkout itself.

The copy is `git init` + this checkout's files (tracked and untracked-but-not-ignored, as they are
now, so uncommitted edits and this test's script are in it) + one commit. On top of it: run records
in outputs/ and binary files that mention the package, to show the rename leaves them alone.
The old name is read from the script, and no literal of it is written here, so after a fork's
rename this file still makes sense (and skips: there is nothing left to rename).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "rename.py"
NEW = "myproj"


def load_old_name() -> str:
    spec = importlib.util.spec_from_file_location("rename_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only; main() runs under __main__
    return module.OLD


OLD = load_old_name()
if not (REPO / "src" / OLD).is_dir():
    pytest.skip(f"the template is already renamed (no src/{OLD})", allow_module_level=True)


def git_env(tmp: Path) -> dict[str, str]:
    """git that sees only the copy: no user/system config, no GIT_DIR from a hook, a fixed author."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env |= {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CEILING_DIRECTORIES": str(tmp)}
    env |= {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return env


def run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = env or git_env(cwd.parent)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def git(repo: Path, *args: str) -> str:
    result = run(["git", *args], repo)
    assert result.returncode == 0, result.stderr
    return result.stdout


def rename(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "scripts/rename.py", *args], repo)


def is_binary(data: bytes) -> bool:
    if b"\0" in data:
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def make_template(tmp: Path) -> Path:
    """A committed copy of this checkout, plus tracked binary files and a tracked symlink naming the package."""
    repo = tmp / "template"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        src = REPO / name
        if src.is_file() and not src.is_symlink():  # skips files deleted in the checkout
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / name)
    (repo / "docs" / "blob.bin").write_bytes(b"\x89PNG\r\n\x00" + OLD.encode() + b"\x00")
    (repo / "docs" / "latin1.txt").write_bytes(f"café {OLD}\n".encode("latin-1"))  # not UTF-8, no NUL
    (tmp / "outside.txt").write_text(f"{OLD}\n")
    (repo / "docs" / "outside-link.txt").symlink_to(tmp / "outside.txt")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--no-verify", "-m", "template")
    return repo


def add_run_records(repo: Path) -> dict[Path, bytes]:
    """What a used clone has in outputs/ (ignored by git): metrics and a checkpoint naming the package."""
    run_dir = repo / "outputs" / "runs" / "x"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(f'{{"step": 1, "package": "{OLD}", "env": "{OLD.upper()}_DATA"}}\n')
    (run_dir / "ckpt.pt").write_bytes(b"PK\x03\x04\x00" + f"{OLD}.scaling\n{OLD}".encode() + b"\x00\xff")
    return {p: p.read_bytes() for p in run_dir.iterdir()}


def tracked_contents(repo: Path) -> dict[str, bytes]:
    names = filter(None, git(repo, "ls-files", "-z").split("\0"))
    return {n: (repo / n).read_bytes() for n in names if (repo / n).is_file() and not (repo / n).is_symlink()}


def test_rename_in_a_copy(tmp_path):
    repo = make_template(tmp_path)
    records = add_run_records(repo)
    binaries = {n: data for n, data in tracked_contents(repo).items() if is_binary(data)}
    package_files = git(repo, "ls-files", f"src/{OLD}").split()

    result = rename(repo, NEW)
    assert result.returncode == 0, result.stderr
    assert f"moved src/{OLD} -> src/{NEW}" in result.stdout and 'pip install -e ".[dev]"' in result.stdout

    fsck = run(["git", "fsck", "--full"], repo)
    fsck_output = (fsck.stdout + fsck.stderr).lower()
    assert fsck.returncode == 0 and "error" not in fsck_output and "corrupt" not in fsck_output, fsck_output
    assert {p: p.read_bytes() for p in records} == records  # run records byte for byte
    assert (tmp_path / "outside.txt").read_text() == f"{OLD}\n"  # not rewritten through the symlink
    after = tracked_contents(repo)
    assert {n: after[n] for n in binaries} == binaries
    # the script keeps the old name: it only ever renames that one, and refuses once it is gone
    left = [n for n, data in after.items() if not is_binary(data) and OLD in data.decode().lower()]
    assert left == ["scripts/rename.py"]

    status = git(repo, "status", "--porcelain").splitlines()
    renames = [line for line in status if line.startswith("R")]
    assert len(renames) == len(package_files) and all(f" -> src/{NEW}/" in line for line in renames)
    assert not [line for line in status if line.startswith(("??", "D", " D"))]

    pyproject = after["pyproject.toml"].decode()  # tomllib is 3.11+; the project supports 3.10
    assert f'name = "{NEW}"' in pyproject and f'{NEW} = "{NEW}.tools.cli:main"' in pyproject
    assert f"{NEW.upper()}_DATA" in after["README.md"].decode()
    check = f"import sys, {NEW}.config; assert {OLD!r} not in sys.modules; print({NEW}.__file__)"
    env = {**os.environ, "PYTHONPATH": str(repo / "src")}
    imported = run([sys.executable, "-c", check], repo, env)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == str(repo / "src" / NEW / "__init__.py")


def test_dry_run_lists_and_changes_nothing(tmp_path):
    repo = make_template(tmp_path)
    egg_info = add_egg_info(repo)
    result = rename(repo, NEW, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "  pyproject.toml\n" in result.stdout and f"  src/{OLD}/training/run.py\n" in result.stdout
    assert "docs/blob.bin" not in result.stdout and "scripts/rename.py" not in result.stdout
    assert f"would move src/{OLD} -> src/{NEW}" in result.stdout
    assert f"would remove src/{OLD}.egg-info" in result.stdout and egg_info.is_dir()
    assert git(repo, "status", "--porcelain") == ""


def add_egg_info(repo: Path) -> Path:
    """What `pip install -e .` of the template may leave in src/ (git-ignored): its metadata."""
    egg_info = repo / "src" / f"{OLD}.egg-info"
    egg_info.mkdir()
    (egg_info / "PKG-INFO").write_text(f"Metadata-Version: 2.1\nName: {OLD}\nVersion: 0.1.0\n")
    (egg_info / "top_level.txt").write_text(f"{OLD}\n")
    return egg_info


def installed_names(src: Path) -> set[str]:
    """The distributions pip and importlib.metadata find in src/, which an editable install puts on sys.path."""
    return {dist.metadata["Name"] for dist in importlib.metadata.distributions(path=[str(src)])}


def test_the_old_install_metadata_goes_so_that_only_the_new_name_is_listed(tmp_path):
    repo = make_template(tmp_path)
    add_egg_info(repo)
    assert installed_names(repo / "src") == {OLD}
    result = rename(repo, NEW)
    assert result.returncode == 0, result.stderr
    assert installed_names(repo / "src") == set()  # `pip install -e .` adds the new name, in site-packages
    assert f"removed src/{OLD}.egg-info" in result.stdout and f"pip uninstall -y {OLD}" in result.stdout
    assert git(repo, "status", "--porcelain", "--ignored", "src").count(".egg-info") == 0


needs_ruff = pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None and shutil.which("ruff") is None, reason="ruff not installed"
)


def ruff(repo: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ruff"] if importlib.util.find_spec("ruff") else ["ruff"]
    return run([*command, *args], repo)


@needs_ruff
def test_the_renamed_tree_passes_ruff_as_ci_runs_it(tmp_path):
    repo = make_template(tmp_path)
    result = rename(repo, NEW)  # shorter than the old name: ruff format joins lines again
    assert result.returncode == 0, result.stderr
    for args in (["check", "."], ["format", "--check", "."]):
        checked = ruff(repo, *args)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "formatted the " in result.stdout and "ruff check still finds" not in result.stdout


@needs_ruff
def test_a_longer_name_lists_the_lines_ruff_cannot_shorten(tmp_path):
    repo = make_template(tmp_path)
    longer = "a_much_longer_project_name"
    result = rename(repo, longer)
    assert result.returncode == 0, result.stderr
    assert ruff(repo, "format", "--check", ".").returncode == 0
    left = ruff(repo, "check", ".", "--quiet", "--output-format", "concise").stdout.splitlines()
    assert left and all("E501" in line for line in left)  # strings and comments over the line limit
    assert "ruff check still finds these in them" in result.stdout
    assert all(f"  {line}\n" in result.stdout for line in left)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return make_template(tmp_path_factory.mktemp("rename"))


@pytest.mark.parametrize(
    "name", ["MyProj", "my-proj", "1proj", "prój", "", "class", "json", "os", "winreg", "torch", "omegaconf", OLD]
)
def test_bad_name_is_one_line_and_changes_nothing(template, name):
    result = rename(template, name)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
    assert git(template, "status", "--porcelain") == ""


def test_refuses_a_second_rename(tmp_path):
    repo = make_template(tmp_path)
    assert rename(repo, NEW).returncode == 0
    for name in (NEW, "other"):
        again = rename(repo, name)
        assert again.returncode == 2 and again.stderr.strip().splitlines() == [
            f"error: src/{OLD} not found: the package is already renamed (this script renames only {OLD!r})"
        ]


def test_refuses_outside_a_git_checkout(tmp_path):
    plain = tmp_path / "plain"
    (plain / "scripts").mkdir(parents=True)
    (plain / "src" / OLD).mkdir(parents=True)
    shutil.copy2(SCRIPT, plain / "scripts" / "rename.py")
    (plain / "src" / OLD / "__init__.py").write_text(f'"""{OLD}"""\n')
    result = rename(plain, NEW)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "is not a git checkout" in result.stderr
    assert (plain / "src" / OLD / "__init__.py").read_text() == f'"""{OLD}"""\n'
