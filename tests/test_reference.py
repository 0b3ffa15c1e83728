"""docs/reference/config.md is what scripts/config_reference.py writes from the code: every group's
options, every fixed key with its type, default and meaning, each component's keys and the formats."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from halfprec.config import schema

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "config_reference.py"


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["config_reference"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def text(generator):
    return generator.reference()


def section(text: str, part: str, title: str) -> str:
    """The `### title` section of the `## part` of the reference."""
    within = text.split(f"\n## {part}", 1)[1].split("\n## ", 1)[0]
    return within.split(f"\n### {title}\n", 1)[1].split("\n### ", 1)[0]


RERUN = "run python scripts/config_reference.py and commit what it writes"


def test_the_committed_reference_and_tables_are_what_the_code_says(generator, text, monkeypatch):
    """A new option, key, format or experiment changes the reference and the pages' generated tables
    (docs/guide/extending.md says so): the failure names the files and the command, not a diff."""
    monkeypatch.setattr(generator, "reference", lambda: text)  # made once, by the fixture (it composes every group)
    stale = [p for p, text in generator.outputs().items() if not p.exists() or p.read_text() != text]
    if stale:
        pytest.fail(f"{', '.join(str(p.relative_to(generator.REPO)) for p in stale)} stale: {RERUN}", pytrace=False)


def test_every_key_option_and_format_is_there_with_the_default_runs_value(text):
    trainer = section(text, "Keys of the fixed groups", "trainer")
    for field in dataclasses.fields(schema.Trainer):
        assert f"| `{field.name}` |" in trainer
    # the default run's values, from conf/ (trainer/default.yaml; the lm task changes max_steps, the default does not)
    assert "| `max_steps` | an integer >= 1 | `500` |" in trainer
    ckpt_every = "| `ckpt_every` | an integer >= 0 | `100` | optimizer steps between checkpoints; 0 = only at the end |"
    assert ckpt_every in trainer
    options = section(text, "Groups and options", "precision")
    for path in (SCRIPT.parents[1] / "conf" / "precision").glob("*.yaml"):
        assert f"| `{path.stem}` |" in options, f"precision={path.stem} is not in the reference: {RERUN}"
    assert "| `nvfp4` | E2M1 | 6 | 16 | nvfp4 | 4.5 | 16x16 | yes |" in text
    assert "| `mxint8` | INT8 | 1.984375 | 32 | e8m0 | 8.25 |  | yes |" in text  # 127/64
    # a component's key with its Spec's doc and the value its option sets
    assert "| `n_layer` | an integer >= 1 | `4` | transformer blocks |" in text
    assert "| `gemms` | a non-empty list of forward, dgrad or wgrad | `[forward, dgrad, wgrad]` |" in section(
        text, "Keys of the fixed groups", "precision.schedule: each phase"
    )


def test_check_fails_on_a_stale_file_and_passes_on_a_fresh_one(generator, text, tmp_path, monkeypatch, capsys):
    out = tmp_path / "config.md"
    monkeypatch.setattr(generator, "OUT", out)
    monkeypatch.setattr(generator, "REPO", tmp_path)
    monkeypatch.setattr(generator, "reference", lambda: text)
    monkeypatch.setattr(sys, "argv", ["config_reference.py", "--check"])
    out.write_text(text.replace("transformer blocks", "blocks"))
    assert generator.main() == 1
    assert "config.md is stale: run python scripts/config_reference.py" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["config_reference.py"])
    assert generator.main() == 0 and out.read_text() == text
    monkeypatch.setattr(sys, "argv", ["config_reference.py", "--check"])
    assert generator.main() == 0


def test_a_pages_generated_table_is_filled_from_the_code_and_checked(generator, tmp_path, monkeypatch, capsys):
    """A hand-written page holds no copy of a fact the code holds: its marked region is the generator's."""
    page = tmp_path / "docs" / "guide" / "page.md"
    page.parent.mkdir(parents=True)
    page.write_text("# A page\n\n<!-- generated: formats -->\n| old | table |\n<!-- end generated -->\n\nprose\n")
    monkeypatch.setattr(generator, "REPO", tmp_path)
    monkeypatch.setattr(generator, "OUT", tmp_path / "docs" / "reference" / "config.md")
    monkeypatch.setattr(generator, "reference", lambda: "reference\n")
    monkeypatch.setattr(sys, "argv", ["config_reference.py", "--check"])
    assert generator.main() == 1
    assert "docs/guide/page.md is stale" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["config_reference.py"])
    assert generator.main() == 0
    filled = page.read_text()
    assert "| old | table |" not in filled and filled.endswith("<!-- end generated -->\n\nprose\n")
    assert "| `nvfp4` | E2M1 | 6 | 16 | nvfp4 | 4.5 | 16x16 | yes |" in filled
    monkeypatch.setattr(sys, "argv", ["config_reference.py", "--check"])
    assert generator.main() == 0
    page.write_text("<!-- generated: colours -->\n<!-- end generated -->\n")
    with pytest.raises(SystemExit, match="no generated table 'colours'; the tables are formats, groups, experiments"):
        generator.main()


def test_the_groups_table_lists_every_option_and_the_default(generator):
    rows = {line.split(" | ")[0].strip("| `"): line for line in generator.groups_table()[2:]}
    assert rows["precision"].startswith("| `precision` | `fp32` |") and "nvfp4" in rows["precision"]
    assert rows["experiment"].startswith("| `experiment` | (none: `+experiment=...`) |")
    assert "task_optim" not in rows
