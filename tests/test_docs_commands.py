"""Every command the README and the documentation pages show, parsed by the program it calls: a flag renamed or a
value no longer accepted fails here, even where running the command would take hours or a GPU (the README's
quick starts also run, in tests/test_readme.py)."""
from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from visattn.bench import max_tokens_cli, sweep_cli
from visattn.bench.arguments import MAX_TOKENS
from visattn.experiments import accuracy, resolution, transfer
from visattn.predict import cli as predict_cli
from visattn.train.cli import resolve_config

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# What a documented command may end with on this machine instead of parsing: no GPU, or a file the reader provides.
EXPECTED_REFUSALS = ("--device must be cpu or an available cuda device",)
# Commands shown to demonstrate an error.
SHOWN_FAILING = {"--epochs two"}


def _commands() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words and words[0] in ("python", "accelerate", "visattn-bench", "visattn-predict", "make"):
                    found.append((page.name, " ".join(shlex.quote(w) for w in words)))
    return sorted(set(found))


COMMANDS = _commands()


def _train_args(words: list[str]) -> list[str]:
    return words[words.index("train.py") + 1:]


def _parse(words: list[str]) -> None:
    """Parse ``words`` as the program it names does, without running it."""
    if words[0] == "make":
        subprocess.run(["make", "-n", *words[1:]], cwd=REPO, check=True, capture_output=True)
    elif "train.py" in words:
        resolve_config(_train_args(words))
    elif words[0] == "visattn-bench":
        if words[1:2] == [MAX_TOKENS]:
            max_tokens_cli.parse_args(words[2:])
        else:
            sweep_cli.parse_args(words[1:])
    elif words[0] == "visattn-predict":
        predict_cli.build_parser().parse_args(words[1:])
    elif words[:3] == ["python", "-m", "visattn.experiments.accuracy"]:
        accuracy.parse_args(words[3:])
    elif words[:3] == ["python", "-m", "visattn.experiments.resolution"]:
        resolution.parse_args(words[3:])
    elif words[:3] == ["python", "-m", "visattn.experiments.transfer"]:
        transfer.parse_args(words[3:])
    elif words[0] == "python" and words[1].startswith("scripts/"):
        assert (REPO / words[1]).is_file(), f"{words[1]} does not exist"
    else:
        pytest.fail(f"no parser for {' '.join(words)}")


def test_the_pages_show_commands():
    assert len(COMMANDS) >= 40
    assert {page for page, _ in COMMANDS} >= {"README.md", "training.md", "benchmark.md", "fine-tuning.md"}


@pytest.mark.parametrize("page, command", COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_documented_command_parses(page, command, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # max-tokens refuses a cap above the memory available now, which other processes move: a machine with room
    monkeypatch.setattr(max_tokens_cli, "available_bytes", lambda: 2**40)
    words = shlex.split(command)
    if any(shown in command for shown in SHOWN_FAILING):
        with pytest.raises((SystemExit, ValueError)):
            _parse(words)
        return
    try:
        _parse(words)
    except SystemExit as exit_:
        error = capsys.readouterr().err
        assert exit_.code == 0 or any(refusal in error for refusal in EXPECTED_REFUSALS), f"{page}: {command}\n{error}"


def test_visattn_predict_help_states_each_default_once():
    options = re.split(r"\n  (?=-)", predict_cli.build_parser().format_help())
    assert len(options) > 8
    for option in options:
        assert len(re.findall(r"\bdefault\b", option)) <= 1, option


def test_the_json_keys_of_visattn_predict_are_named_alike_in_its_help_and_on_the_prediction_page():
    help_text = " ".join(predict_cli.build_parser().format_help().split())
    json_help = help_text.split("--json ", 1)[1].split(" --tile ", 1)[0]
    (row,) = [line for line in (REPO / "docs" / "prediction.md").read_text().splitlines() if line.startswith("| `--json` |")]
    keys = re.findall(r"`(\w+)`", row.removeprefix("| `--json` |"))
    assert {"run_dir", "weights", "device", "data_config", "tiling", "predictions", "skipped"} <= set(keys)
    assert [key for key in keys if not re.search(rf"\b{key}\b", json_help)] == []
