"""Every command in the docs runs as written.

Pages scanned: README.md and every `*.md` under docs/ (recursively). A page marks a code block
for running with an HTML comment on the line directly before its fence:

    <!-- quick -->                      run every command of the block, expect exit status 0
    <!-- quick: max_steps=20 -->        ... and give each `python train.py` command
                                        `trainer.max_steps=20` (replacing its own
                                        `trainer.max_steps=N`, else appended to it)
    <!-- quick: exit=2 -->              expect exit status 2 from every command of the block
    <!-- quick: exit=3 max_steps=50 --> options combine

Rules for a marked block:

- The fence is ```` ```bash ````, ```` ```console ```` or a plain ```` ``` ````, on the very next
  line: a blank line between marker and fence, an unknown option or a malformed marker fails
  `test_repo_markers_are_well_formed` with the page:line of the marker.
- Transcript: if any line starts with `$ `, each `$ ` line is a command and the non-empty lines
  after it, up to the next `$ ` line, are expected output. Each expected line must equal (trailing
  whitespace aside) some line of the command's stdout or stderr; `...` in it stands for any text,
  so `error: x=1: unknown key; did you mean y? ...` matches a longer line.
- Otherwise every non-empty line not starting with `#` is a command, and a trailing ` # comment`
  (space, hash, space) is cut from it (from `$ ` commands too). No line continuations.
- The block's commands run in order, in one fresh empty temporary directory (relative paths in
  the commands refer to it), with W&B offline. Rewritten first so that they run from there: a
  leading `python` is this interpreter (`python train.py`, `python scripts/...` and
  `python benchmarks/...` name the repository's files), and a leading `halfprec` is
  `python -m halfprec.tools.cli`. `VAR=value` assignments before the program are kept.
- Every block runs under `pytest -m slow` (which CI runs); a plain `pytest` checks the markers and
  this module's machinery alone.

A test per block, named by its page and the marker's line: `README.md:42`, `guide/formats.md:120`
(pages under docs/ by their path inside docs/).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO
from markdown.extensions.toc import slugify

TIMEOUT_S = 600  # per command
TAIL_LINES = 30  # of stdout and of stderr in a failure message
OPTIONS = ("exit", "max_steps")
FENCE_INFOS = ("", "bash", "console")
ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}

MARKER_RE = re.compile(r"^\s*<!--\s*quick(?![\w-])(?P<rest>.*?)-->\s*$")
FENCE_RE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")
PROGRAM_RE = re.compile(r"(?P<env>(?:[A-Za-z_]\w*=\S*\s+)*)(?P<prog>python|halfprec)(?P<rest>(?:\s.*)?)$", re.S)
REPO_SCRIPT_RE = re.compile(r"\s+(?=train\.py(?:\s|$)|scripts/|benchmarks/)")
MAX_STEPS_RE = re.compile(r"(?<!\S)(\+{0,2})trainer\.max_steps=\S*")


class MarkerError(ValueError):
    """A marker or its block breaks the convention above."""


@dataclass(frozen=True)
class Command:
    line: int  # 1-based, in its page
    text: str  # as written (after `$ `, without a trailing ` # comment`)
    expected: tuple[str, ...] = ()  # a transcript's expected output lines


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # the marker's
    exit: int
    max_steps: int | None
    commands: tuple[Command, ...]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


# ---------------------------------------------------------------------------------------------
# Extraction: pages -> marked blocks -> commands
# ---------------------------------------------------------------------------------------------


def parse_options(rest: str) -> dict[str, int]:
    """`rest` is what follows `quick` in a marker: empty, or `: key=value ...`."""
    rest = rest.strip()
    if not rest:
        return {}
    if not rest.startswith(":"):
        raise MarkerError(f"malformed marker: expected `<!-- quick -->` or `<!-- quick: key=N ... -->`, got {rest!r}")
    options: dict[str, int] = {}
    for token in rest[1:].split():
        key, _, value = token.partition("=")
        if key not in OPTIONS:
            raise MarkerError(f"unknown marker option {key!r} (known: {', '.join(OPTIONS)})")
        if key in options:
            raise MarkerError(f"marker option {key!r} given twice")
        if not value.isdigit() or (key == "max_steps" and int(value) < 1):
            raise MarkerError(f"marker option {token!r}: the value must be a whole number (max_steps >= 1)")
        options[key] = int(value)
    return options


def strip_comment(line: str) -> str:
    return line.split(" # ", 1)[0].strip()


def parse_commands(body: list[tuple[int, str]]) -> list[Command]:
    """A fenced block's lines (line number, text) -> its commands, with expected output for a transcript."""
    if not any(text.startswith("$ ") for _, text in body):
        return [
            Command(n, strip_comment(text)) for n, text in body if text.strip() and not text.lstrip().startswith("#")
        ]
    commands: list[Command] = []
    for n, text in body:
        if text.startswith("$ "):
            commands.append(Command(n, strip_comment(text[2:])))
        elif text.strip():
            if not commands:
                raise MarkerError(f"line {n}: output before the transcript's first `$ ` command")
            last = commands[-1]
            commands[-1] = Command(last.line, last.text, (*last.expected, text.rstrip()))
    return commands


def fence_close(lines: list[str], start: int) -> int | None:
    """The index of the line closing the fence opened at lines[start], None if it never closes."""
    fence = FENCE_RE.match(lines[start])
    assert fence is not None
    close = re.compile(rf"^\s*{re.escape(fence['fence'][0])}{{{len(fence['fence'])},}}\s*$")
    return next((i for i in range(start + 1, len(lines)) if close.match(lines[i])), None)


def marked_block(lines: list[str], at: int, page: str, rest: str) -> tuple[Block, int]:
    """The block marked at lines[at] and the index of the line after its closing fence."""
    options = parse_options(rest)
    fence = FENCE_RE.match(lines[at + 1]) if at + 1 < len(lines) else None
    if fence is None:
        raise MarkerError("a quick marker must be directly followed by a ```bash, ```console or ``` fence")
    if fence["info"] not in FENCE_INFOS:
        raise MarkerError(f"a quick marker's fence must be ```bash, ```console or ```, not {fence['info']!r}")
    close = fence_close(lines, at + 1)
    if close is None:
        raise MarkerError("the marked fence is never closed")
    indent = len(fence["indent"])
    body = [(i + 1, lines[i][indent:] if not lines[i][:indent].strip() else lines[i]) for i in range(at + 2, close)]
    commands = parse_commands(body)
    if not commands:
        raise MarkerError("the marked block has no command")
    block = Block(page, at + 1, options.get("exit", 0), options.get("max_steps"), tuple(commands))
    return block, close + 1


def parse_page(text: str, page: str) -> tuple[list[Block], list[str]]:
    """A page's marked blocks, and its errors as `page:line: message` (unmarked fences are skipped)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    errors: list[str] = []
    i = 0
    while i < len(lines):
        marker = MARKER_RE.match(lines[i])
        if marker:
            try:
                block, i = marked_block(lines, i, page, marker["rest"])
                blocks.append(block)
            except MarkerError as err:
                errors.append(f"{page}:{i + 1}: {err}")
                i += 1
        elif FENCE_RE.match(lines[i]):
            close = fence_close(lines, i)
            i = len(lines) if close is None else close + 1
        else:
            i += 1
    return blocks, errors


def collect_pages(root: Path) -> list[Path]:
    """README.md and every *.md under docs/, in `root`."""
    readme = [root / "README.md"] if (root / "README.md").is_file() else []
    docs = root / "docs"
    return readme + (sorted(docs.rglob("*.md")) if docs.is_dir() else [])


def page_name(path: Path, root: Path) -> str:
    docs = root / "docs"
    return path.relative_to(docs if docs in path.parents else root).as_posix()


def collect(root: Path) -> tuple[list[Block], list[str]]:
    blocks: list[Block] = []
    errors: list[str] = []
    for path in collect_pages(root):
        page_blocks, page_errors = parse_page(path.read_text(encoding="utf-8"), page_name(path, root))
        blocks += page_blocks
        errors += page_errors
    return blocks, errors


# ---------------------------------------------------------------------------------------------
# Running: rewrite, run, compare
# ---------------------------------------------------------------------------------------------


def command_end(command: str) -> int:
    """Where the first command of a shell line ends: its first unquoted `|`, `;`, `&`, `<` or `>`
    (before a redirect's file descriptor number, as in `2>&1`)."""
    quote = ""
    for i, ch in enumerate(command):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "|;&<>":
            fd = re.search(r"(?:^|\s)(\d+)$", command[:i]) if ch in "<>" else None
            return fd.start(1) if fd else i
    return len(command)


def set_max_steps(command: str, steps: int) -> str:
    """`trainer.max_steps=<steps>` in place of the command's own, else appended to its arguments."""
    end = command_end(command)
    head, tail = command[:end], command[end:]
    if MAX_STEPS_RE.search(head):
        head = MAX_STEPS_RE.sub(rf"\g<1>trainer.max_steps={steps}", head)
    else:
        head = f"{head.rstrip()} trainer.max_steps={steps}" + (" " if tail else "")
    return head + tail


def rewrite(command: str, max_steps: int | None = None) -> str:
    """The command as it runs from a temporary directory (see the module docstring)."""
    found = PROGRAM_RE.match(command)
    if found is None:
        return command
    python, rest = shlex.quote(sys.executable), found["rest"]
    if found["prog"] == "halfprec":
        return f"{found['env']}{python} -m halfprec.tools.cli{rest}"
    if max_steps is not None and re.match(r"\s+train\.py(?:\s|$)", rest):
        rest = set_max_steps(rest, max_steps)
    rest = REPO_SCRIPT_RE.sub(f" {shlex.quote(str(REPO))}/", rest, count=1) if REPO_SCRIPT_RE.match(rest) else rest
    return f"{found['env']}{python}{rest}"


def line_pattern(expected: str) -> re.Pattern[str]:
    """An expected output line as a regex: its text literally, `...` for any text."""
    return re.compile(".*".join(re.escape(part) for part in expected.rstrip().split("...")))


def missing_lines(expected: tuple[str, ...] | list[str], output: str) -> list[str]:
    """The expected lines that no line of `output` matches whole."""
    actual = [line.rstrip() for line in output.splitlines()]
    return [line for line in expected if not any(line_pattern(line).fullmatch(a) for a in actual)]


def _text(stream: str | bytes | None) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream or ""


def _tail(name: str, text: str) -> str:
    return f"--- {name} (last {TAIL_LINES} lines) ---\n" + "\n".join(text.splitlines()[-TAIL_LINES:])


def _report(where: str, problem: str, written: str, run: str, status: str, out: str, err: str) -> str:
    lines = [f"{where}: {problem}", f"  as written:  {written}", f"  run as:      {run}", f"  exit status: {status}"]
    return "\n".join([*lines, _tail("stdout", out), _tail("stderr", err)])


def run_command(block: Block, command: Command, cwd: Path) -> str | None:
    """Runs one command of the block; a failure message, or None when it did what the page says."""
    where, shell = f"{block.page}:{command.line}", rewrite(command.text, block.max_steps)
    env = {**os.environ, **ENV}
    try:
        proc = subprocess.run(
            shell, shell=True, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as err:
        status, out, errors = "none (killed)", _text(err.stdout), _text(err.stderr)
        return _report(where, f"timed out after {TIMEOUT_S} s", command.text, shell, status, out, errors)
    status = f"{proc.returncode} (expected {block.exit})"
    if proc.returncode != block.exit:
        problem = f"exit status {proc.returncode}, expected {block.exit}"
        return _report(where, problem, command.text, shell, status, proc.stdout, proc.stderr)
    missing = missing_lines(command.expected, proc.stdout + "\n" + proc.stderr)
    if missing:
        problem = "output lacks the expected line(s):\n" + "\n".join(f"    {line}" for line in missing)
        return _report(where, problem, command.text, shell, status, proc.stdout, proc.stderr)
    return None


def run_block(block: Block, cwd: Path) -> str | None:
    """Runs the block's commands in order in `cwd`, stopping at the first failure (its message)."""
    for command in block.commands:
        failure = run_command(block, command, cwd)
        if failure:
            return failure
    return None


# ---------------------------------------------------------------------------------------------
# The repository's pages
# ---------------------------------------------------------------------------------------------

BLOCKS, ERRORS = collect(REPO)


# Every block is slow: the training ones take seconds to a minute, and the config errors' messages
# are checked in a plain `pytest` by tests/test_cli.py already (the pages' ~45 s more on one worker).
@pytest.mark.slow
@pytest.mark.parametrize("block", [pytest.param(block, id=block.id) for block in BLOCKS])
def test_docs_block(block: Block, tmp_path: Path) -> None:
    failure = run_block(block, tmp_path)
    if failure:
        pytest.fail(failure, pytrace=False)


def test_repo_markers_are_well_formed() -> None:
    assert not ERRORS, "quick markers breaking the convention (tests/test_docs_commands.py):\n" + "\n".join(ERRORS)


def test_repo_has_quick_blocks() -> None:
    pages = [page_name(path, REPO) for path in collect_pages(REPO)]
    assert BLOCKS, f"no `<!-- quick -->` block in any of {len(pages)} pages: {', '.join(pages)}"


# ---------------------------------------------------------------------------------------------
# The machinery itself, on synthetic pages
# ---------------------------------------------------------------------------------------------

SAMPLE = """\
# Title

<!-- quick -->
```bash
# a comment line
python train.py logger=none   # trailing comment
python scripts/report.py --x 1
```

<!-- quick: exit=3 max_steps=50 -->
```console
$ python train.py trainer.max_steps=500 seed=1
error: x=1: unknown key; did you mean y? ...
second line
$ halfprec report outputs
```

```markdown
<!-- quick -->
an example inside an unmarked fence: not a marker
```

<!-- quick: max_steps=7 -->

```bash
python train.py
```
"""


def test_parse_sample_page() -> None:
    blocks, errors = parse_page(SAMPLE, "guide/sample.md")
    assert [b.id for b in blocks] == ["guide/sample.md:3", "guide/sample.md:10"]
    plain, transcript = blocks
    assert (plain.exit, plain.max_steps) == (0, None)
    assert [(c.line, c.text, c.expected) for c in plain.commands] == [
        (6, "python train.py logger=none", ()),
        (7, "python scripts/report.py --x 1", ()),
    ]
    assert (transcript.exit, transcript.max_steps) == (3, 50)
    assert [(c.line, c.text) for c in transcript.commands] == [
        (12, "python train.py trainer.max_steps=500 seed=1"),
        (15, "halfprec report outputs"),
    ]
    assert transcript.commands[0].expected == ("error: x=1: unknown key; did you mean y? ...", "second line")
    assert errors == [
        "guide/sample.md:23: a quick marker must be directly followed by a ```bash, ```console or ``` fence"
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("<!-- quick -->\nsome text\n", "directly followed by a"),
        ("<!-- quick -->", "directly followed by a"),
        ("<!-- quick -->\n```python\nprint(1)\n```\n", "not 'python'"),
        ("<!-- quick -->\n```bash\n# only a comment\n```\n", "no command"),
        ("<!-- quick -->\n```bash\npython train.py\n", "never closed"),
        ("<!-- quick -->\n```console\noutput first\n$ python train.py\n```\n", "output before"),
        ("<!-- quick max_steps=3 -->\n```bash\npython train.py\n```\n", "malformed marker"),
        ("<!-- quick: exit=2 exit=3 -->\n```bash\npython train.py\n```\n", "given twice"),
        ("<!-- quick: max_steps=0 -->\n```bash\npython train.py\n```\n", "whole number"),
        ("<!-- quick: exit -->\n```bash\npython train.py\n```\n", "whole number"),
    ],
)
def test_bad_markers_are_reported(text: str, message: str) -> None:
    blocks, errors = parse_page(text, "p.md")
    assert blocks == [] and len(errors) == 1 and errors[0].startswith("p.md:1: ") and message in errors[0]


def test_unknown_option_is_reported() -> None:
    blocks, errors = parse_page("\n<!-- quick: foo=1 -->\n```bash\npython train.py\n```\n", "p.md")
    assert blocks == []
    assert errors == ["p.md:2: unknown marker option 'foo' (known: exit, max_steps)"]


def test_max_steps_replaced_or_appended() -> None:
    assert set_max_steps(" train.py a=1", 20) == " train.py a=1 trainer.max_steps=20"
    assert set_max_steps(" train.py trainer.max_steps=500 a=1", 20) == " train.py trainer.max_steps=20 a=1"
    assert set_max_steps(" train.py ++trainer.max_steps=5", 20) == " train.py ++trainer.max_steps=20"
    assert set_max_steps(" train.py a=1 | tail -1", 20) == " train.py a=1 trainer.max_steps=20 | tail -1"
    assert set_max_steps(" train.py a=1 2>&1", 20) == " train.py a=1 trainer.max_steps=20 2>&1"
    assert set_max_steps(" train.py 'a=x|y' && ls", 20) == " train.py 'a=x|y' trainer.max_steps=20 && ls"


def test_rewrite() -> None:
    python, repo = shlex.quote(sys.executable), shlex.quote(str(REPO))
    assert rewrite("python train.py a=1", 20) == f"{python} {repo}/train.py a=1 trainer.max_steps=20"
    assert rewrite("python train.py a=1") == f"{python} {repo}/train.py a=1"
    assert rewrite("OMP_NUM_THREADS=1 python scripts/x.py", 20) == f"OMP_NUM_THREADS=1 {python} {repo}/scripts/x.py"
    assert rewrite("python benchmarks/startup.py") == f"{python} {repo}/benchmarks/startup.py"
    assert rewrite("python -c 'print(1)'", 20) == f"{python} -c 'print(1)'"
    assert rewrite("halfprec report outputs", 20) == f"{python} -m halfprec.tools.cli report outputs"
    assert rewrite("ls outputs && python train.py") == "ls outputs && python train.py"  # only a leading program
    assert rewrite("pythonic train.py") == "pythonic train.py"


def test_trailing_comment_stripped() -> None:
    assert strip_comment("python train.py a=1   # six jobs") == "python train.py a=1"
    assert strip_comment("python train.py a=#1") == "python train.py a=#1"


def test_wildcard_matching() -> None:
    out = "noise\nerror: x=1: unknown key; did you mean y? it takes: a, b   \nend\n"
    assert missing_lines(["error: x=1: unknown key; did you mean y? ..."], out) == []
    assert missing_lines(["error: ... did you mean ...?..."], out) == []
    assert missing_lines(["end"], out) == []
    assert missing_lines(["en"], out) == ["en"]  # a whole line, not a part of one
    assert missing_lines(["error: x=2: ..."], out) == ["error: x=2: ..."]
    assert missing_lines(["a.b"], "axb\n") == ["a.b"]  # the literal parts are literal


def test_halfprec_cli_runs_as_a_module() -> None:
    import halfprec.tools.cli as cli

    assert callable(cli.main)
    assert 'if __name__ == "__main__":' in Path(cli.__file__).read_text(encoding="utf-8")


def _write_page(root: Path, text: str) -> list[Block]:
    (root / "docs" / "guide").mkdir(parents=True)
    (root / "docs" / "guide" / "page.md").write_text(text, encoding="utf-8")
    (root / "README.md").write_text("# nothing marked\n\n    python train.py\n", encoding="utf-8")
    blocks, errors = collect(root)
    assert errors == []
    return blocks


def test_run_config_error_transcript(tmp_path: Path) -> None:
    page = """\
<!-- quick: exit=2 -->
```console
$ python train.py accum=0
error: accum=0: must be an integer >= 1 ...
```
"""
    (block,) = _write_page(tmp_path / "root", page)
    assert block.id == "guide/page.md:1"
    assert run_block(block, tmp_path) is None


def test_run_failures_are_reported(tmp_path: Path) -> None:
    page = """\
<!-- quick -->
```console
$ python -c "print('hi')"
bye
```

<!-- quick -->
```
python train.py accum=0
```
"""
    wrong_output, wrong_status = _write_page(tmp_path / "root", page)
    message = run_block(wrong_output, tmp_path)
    assert message is not None and message.startswith("guide/page.md:3: output lacks the expected line(s):\n    bye\n")
    assert "as written:  python -c \"print('hi')\"" in message and "\nhi" in message
    message = run_block(wrong_status, tmp_path)
    assert message is not None and message.startswith("guide/page.md:9: exit status 2, expected 0\n")
    assert f"run as:      {shlex.quote(sys.executable)} {shlex.quote(str(REPO))}/train.py accum=0" in message
    assert "error: accum=0: must be an integer >= 1" in message
    assert "\n  exit status: 2 (expected 0)\n" in message


@pytest.mark.slow
def test_run_short_training(tmp_path: Path) -> None:
    page = "<!-- quick: max_steps=3 -->\n```bash\npython train.py logger=none   # three steps\nls outputs\n```\n"
    (block,) = _write_page(tmp_path / "root", page)
    assert rewrite(block.commands[0].text, block.max_steps).endswith("train.py logger=none trainer.max_steps=3")
    assert run_block(block, tmp_path) is None
    assert (tmp_path / "outputs").is_dir()


# ---------------------------------------------------------------------------------------------
# README's links: mkdocs --strict checks the links inside docs/; README.md lies outside it
# ---------------------------------------------------------------------------------------------

LINK_RE = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK_RE.findall(page.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md":
            headings = [line.lstrip("#").strip() for line in file.read_text().splitlines() if line.startswith("#")]
            if anchor not in {slugify(h, "-") for h in headings}:  # the anchors mkdocs' toc makes
                broken.append(f"{target}: no heading with that anchor in {path or page.name}")
    return broken


def test_readme_links_point_at_files_and_headings_that_exist() -> None:
    assert broken_links(REPO / "README.md") == []


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "guide.md").write_text("# Title\n\n## fp16 and bf16 on a CPU\n")
    page = tmp_path / "README.md"
    page.write_text("[a](guide.md#fp16-and-bf16-on-a-cpu) [b](guide.md#nothing) [c](gone.md) [d](https://x.org/y)\n")
    assert broken_links(page) == ["guide.md#nothing: no heading with that anchor in guide.md", "gone.md: no such file"]
