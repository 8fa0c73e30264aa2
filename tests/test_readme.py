"""The README's and the documentation pages' import paths, module names, repository paths and relative links
resolve, every command of the README's quick starts starts, and every Python block of the README and the pages
runs."""
from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# The pages written by hand (the generated tables and benchmark reports are run outputs, under results/).
DOC_PAGES = sorted((REPO / "docs").rglob("*.md"))
PAGES = [README, *DOC_PAGES]
TEXTS = {page: page.read_text() for page in PAGES}


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


def _found(pattern: str) -> list[tuple[str, str]]:
    return sorted({(_name(page), hit) for page, text in TEXTS.items() for hit in re.findall(pattern, text)})


# `visattn.a.b` (a module, or attributes of one) and `from visattn.a import b, c` as the pages write them.
DOTTED = _found(r"\bvisattn(?:\.[A-Za-z_]\w*)+")
FROM_IMPORTS = sorted(
    {(_name(page), module, name.strip()) for page, text in TEXTS.items()
     for module, names in re.findall(r"from (visattn[\w.]*) import ([\w, ]+)", text) for name in names.split(",")}
)
# Paths of the repository the pages name, relative to its root.
FILES = _found(r"`((?:visattn|tests|configs|scripts|docs|results)/[\w./-]*\w)`")


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc (the site) gives a heading; GitHub's agrees on these pages."""
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _outside_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _anchors(path: Path) -> set[str]:
    return {_slug(heading) for heading in re.findall(r"^#{1,6} (.*)$", _outside_code(path.read_text()), flags=re.M)}


LINKS = sorted(
    {(_name(page), target) for page, text in TEXTS.items()
     for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`\n]*`", "", _outside_code(text)))
     if not re.match(r"[a-z]+://|mailto:", target)}
)


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_pages_name_import_paths_files_and_links():
    assert len(DOC_PAGES) > 20
    assert len(DOTTED) > 20 and FROM_IMPORTS and len(FILES) > 20 and len(LINKS) > 50


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("page, dotted", DOTTED, ids=[f"{p}:{d}" for p, d in DOTTED])
def test_dotted_path_resolves(page, dotted):
    _resolve(dotted)


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("page, module, name", FROM_IMPORTS, ids=[f"{p}:{m}.{n}" for p, m, n in FROM_IMPORTS])
def test_from_import_resolves(page, module, name):
    assert hasattr(importlib.import_module(module), name)


@pytest.mark.parametrize("page, path", FILES, ids=[f"{p}:{f}" for p, f in FILES])
def test_named_file_exists(page, path):
    assert (REPO / path).exists(), f"{page} names {path}, which does not exist"


@pytest.mark.parametrize("page, target", LINKS, ids=[f"{p}:{t}" for p, t in LINKS])
def test_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    file = (REPO / page).parent / path if path else REPO / page
    assert file.exists(), f"{page} links to {target}: no such file"
    if anchor:
        assert file.suffix == ".md" and anchor in _anchors(file), f"{page} links to {target}: no such heading"


def test_slug_matches_the_sites_anchors():
    assert _slug("linear with spatial decay (`decay=`)") == "linear-with-spatial-decay-decay"
    assert _slug("Trained at 256 tokens, tested at 1,024: a larger grid") == "trained-at-256-tokens-tested-at-1024-a-larger-grid"
    assert _slug("timm's `attn_layer=`") == "timms-attn_layer"


# ------------------------------------------------------------------------------------------------------------------
# The quick starts: every command in the README's "Quick starts" section, each started as written with small
# overrides for time. A command added to the README without an entry here fails test_every_quick_start_is_checked.

QUICK_STARTS = TEXTS[README].split("## Quick starts", 1)[1].split("\n## ", 1)[0]
BLOCKS = re.findall(r"```(bash|python)\n(.*?)```", QUICK_STARTS, flags=re.S)
COMMANDS = [line for kind, block in BLOCKS if kind == "bash" for line in block.replace("\\\n", " ").splitlines() if line.strip()]
PYTHON_BLOCKS = [block for kind, block in BLOCKS if kind == "python"]

SHORT_TRAINING = "--epochs 1 --warmup-epochs 0 --max-train-samples 16 --max-eval-samples 16 --batch-size 8 --num-workers 0"
# What each command is started with: (extra flags appended, or a replacement; whether a one-line refusal also counts).
STARTS = {
    "make train": "make -n train",
    # the environment the tests run in stands in for the .venv that make sets up
    ". .venv/bin/activate # the environment make set up: the commands below run in it":
        "bash -c '. {venv}/bin/activate && accelerate --help > /dev/null && python -c \"import visattn\"'",
    "python scripts/digits_images.py /tmp/digits_png": "{python} scripts/digits_images.py {images}",
    "accelerate launch train.py --config configs/imagefolder.yaml --data-dir /tmp/digits_png --img-size 512":
        "{accelerate} launch -q --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no train.py "
        "--config configs/imagefolder.yaml --data-dir {images} --img-size 64 --depth 1 --mixed-precision no "
        f"{SHORT_TRAINING} --run-dir {{tmp}}/imagefolder",
    "python train.py --attn softmax --run-dir runs/digits-softmax # the weights to start from":
        f"{{python}} train.py --attn softmax {SHORT_TRAINING} --run-dir {{tmp}}/digits-softmax",
    # the short digits run stands in for the softmax run (the same qkv and proj)
    "python train.py --config configs/finetune-digits.yaml # linear attention at 32 px":
        f"{{python}} train.py --config configs/finetune-digits.yaml --initial-checkpoint {{run}} {SHORT_TRAINING} "
        "--run-dir {tmp}/finetune-digits",
    "accelerate launch train.py --config configs/finetune.yaml --data-dir /tmp/digits_png --pretrained "
    "# needs the hub or its cache":
        "{python} train.py --config configs/finetune.yaml --data-dir {images} --pretrained --img-size 32 "
        f"--mixed-precision no {SHORT_TRAINING} --run-dir {{tmp}}/finetune",
    "visattn-predict runs/digits-axial /tmp/digits_png/3 --top-k 3": "{python} -m visattn.predict {run} {images}/3 --top-k 3",
    "visattn-predict runs/digits-axial /tmp/digits_png/3 --tile 8 --tile-overlap 2":
        "{python} -m visattn.predict {run} {images}/3 --tile 8 --tile-overlap 2",
    "accelerate launch --mixed_precision bf16 train.py --dataset cluttered-digits --img-size 1024 "
    "--model vit_small_patch16_224 --attn linear --batch-size 32 --epochs 4 --num-workers 8 --measure-loader 8":
        "{accelerate} launch -q --num_processes 1 --num_machines 1 --mixed_precision bf16 --dynamo_backend no train.py "
        "--dataset cluttered-digits --img-size 64 --model vit_small_patch16_224 --attn linear --depth 1 --num-workers 2 "
        f"--dataset-kwargs train_size=64 val_size=16 test_size=16 --measure-loader 2 {SHORT_TRAINING} --run-dir {{tmp}}/gpu1024",
    "make device-check": "make -n device-check",
    "visattn-bench --device cpu --attn linear axial neighborhood --sizes 2048 --modes infer --out bench_out/cpu2048":
        "{python} -m visattn.bench --device cpu --attn linear axial neighborhood --sizes 2048 --modes infer --out {tmp}/cpu2048 "
        "--sizes 64 --model-kwargs depth=1 --warmup 0 --min-iters 1 --min-seconds 0 --settle 0",
    "visattn-bench --device cuda --dtype bf16 --sizes 1024 2048 --batch-size 8 --out bench_out/gpu":
        "{python} -m visattn.bench --device cuda --dtype bf16 --sizes 1024 2048 --batch-size 8 --out {tmp}/gpu"
        + " --sizes 64 --batch-size 2 --model-kwargs depth=1 --warmup 0 --min-iters 1 --min-seconds 0 --settle 0",
}
# Refusals that are the command starting correctly on this machine: no hub for --pretrained, no GPU for cuda.
ACCEPTED_REFUSALS = {
    "accelerate launch train.py --config configs/finetune.yaml": "--initial-checkpoint PATH",
    "visattn-bench --device cuda": "--device must be cpu or an available cuda device",
}


def test_every_quick_start_is_checked():
    assert len(COMMANDS) >= 6 and len(PYTHON_BLOCKS) >= 2
    assert sorted(" ".join(c.split()) for c in COMMANDS) == sorted(STARTS)


def test_the_environment_the_pages_activate_is_the_one_make_sets_up():
    venv = re.search(r"^VENV \?= (\S+)$", (REPO / "Makefile").read_text(), flags=re.M).group(1)
    for page in (README, REPO / "docs" / "installation.md"):
        activations = re.findall(r"^\. (\S+)/bin/activate\b", TEXTS[page], flags=re.M)
        assert activations and set(activations) == {venv}, _name(page)


def test_the_pages_install_visattn_from_a_clone_until_a_release():
    released = re.search(r"^## \[\d+\.\d+\.\d+\]", (REPO / "CHANGELOG.md").read_text(), flags=re.M)
    from_an_index = _found(r"pip install (?:-U |--upgrade )?[\"']?visattn\b[^\n`]*")
    assert released or not from_an_index, f"pages install the unreleased package from an index: {from_an_index}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short run of the digits recipe in place of runs/digits-axial, and the digits as image files."""
    tmp = tmp_path_factory.mktemp("quickstart")
    images, run = tmp / "digits_png", tmp / "digits-axial"
    subprocess.run([sys.executable, "scripts/digits_images.py", str(images)], cwd=REPO, check=True, capture_output=True)
    result = subprocess.run(
        [sys.executable, "train.py", "--attn", "axial", *shlex.split(SHORT_TRAINING), "--run-dir", str(run)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {"tmp": tmp, "images": images, "run": run}


def _run(command: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(shlex.split(command), cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(STARTS), ids=lambda c: c.split(" --")[0][:60])
def test_quick_start_command_starts(command, trained):
    accelerate = Path(sys.executable).with_name("accelerate")
    started = STARTS[command].format(python=sys.executable, accelerate=accelerate, venv=sys.prefix, **trained)
    result = _run(started)
    refusal = next((line for prefix, line in ACCEPTED_REFUSALS.items() if command.startswith(prefix)), None)
    if result.returncode != 0 and refusal and refusal in result.stderr:
        assert refusal in result.stderr.strip().splitlines()[-1], result.stderr[-3000:]  # one line, no traceback
        return
    assert result.returncode == 0, f"{started}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_quick_start_python_runs(index, trained):
    code = PYTHON_BLOCKS[index].replace('"runs/digits-axial"', repr(str(trained["run"])))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]


# ------------------------------------------------------------------------------------------------------------------
# The Python blocks of the documentation pages, each run as written, with stand-ins for the reader's files: the short
# runs below for runs/digits-axial and runs/digits-softmax, the digits as image files for digits_png, a weights file
# for model.safetensors, and fresh weights for timm's (which need the Hugging Face hub). A block added to a page
# without an entry here fails test_every_page_block_is_checked.

PAGE_BLOCKS = {
    f"{page.name}:{index}": block
    for page in sorted((REPO / "docs").glob("*.md"))
    for index, block in enumerate(re.findall(r"```python\n(.*?)```", TEXTS[page], flags=re.S))
}
# For each block: (text of the block, what stands in for it), the stand-in formatted with the fixtures' paths.
STAND_INS = {
    "attention-types.md:0": [],
    "backends.md:0": [],
    "backends.md:1": [],
    "checkpoints.md:0": [("runs/digits-axial", "{run}")],
    "fine-tuning.md:0": [("runs/digits-softmax", "{softmax_run}")],
    "prediction.md:0": [("runs/digits-axial", "{run}"), ('["digits_png"]', '["{images}"]')],
    "prediction.md:1": [],
    "timm.md:0": [],
    "timm.md:1": [],
    "timm.md:2": [('file="model.safetensors"', 'file="{weights}"')],
    "timm.md:3": [],
    "timm.md:4": [('"vit_small_patch16_224", pretrained=True', '"vit_small_patch16_224", pretrained=False')],
}


def test_every_page_block_is_checked():
    assert len(PAGE_BLOCKS) >= 10
    assert sorted(PAGE_BLOCKS) == sorted(STAND_INS)
    for name, stand_ins in STAND_INS.items():
        for text, _ in stand_ins:
            assert text in PAGE_BLOCKS[name], f"{name} no longer holds {text!r}"


@pytest.fixture(scope="module")
def page_files(trained):
    """What the pages' blocks read: a short softmax run and a weights file of a registered model."""
    softmax_run = trained["tmp"] / "page-softmax"
    result = subprocess.run(
        [sys.executable, "train.py", "--attn", "softmax", *shlex.split(SHORT_TRAINING), "--run-dir", str(softmax_run)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    weights = trained["tmp"] / "model.safetensors"
    code = ("import timm, visattn; from safetensors.torch import save_file; "
            "model = timm.create_model('visattn_vit_small_patch16', attn='axial', num_classes=10); "
            f"save_file(model.state_dict(), {str(weights)!r})")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, timeout=600)
    return {**trained, "softmax_run": softmax_run, "weights": weights}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STAND_INS))
def test_page_python_block_runs(name, page_files):
    code = PAGE_BLOCKS[name]
    for text, stand_in in STAND_INS[name]:
        code = code.replace(text, stand_in.format(**page_files))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{name}:\n{code}\n{result.stderr[-3000:]}"


@pytest.mark.parametrize(
    "command",
    [[sys.executable, "train.py", "--help"], [sys.executable, "-m", "visattn.bench", "--help"]],
    ids=["train.py", "visattn-bench"],
)
def test_commands_print_their_help(command):
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage:" in result.stdout
