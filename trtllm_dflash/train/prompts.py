"""Training prompts mined from real offline text: the Python sources installed on this machine.

Code prompts: top-level functions with a docstring (stdlib and installed packages) become "complete this function"
requests holding only the signature and docstring, the shape of a HumanEval task. Chat prompts: docstring paragraphs
of modules and classes become questions (explain, summarise, give an example).

The evaluation sets (HumanEval's 164 tasks, MT-Bench's 80 questions) must not leak in. ``check_no_overlap`` rejects a
training prompt that shares a function name with a HumanEval entry point or any normalised word 8-gram with an
evaluation prompt; ``mine_prompts`` drops such prompts and the CLI re-checks the final set.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from trtllm_dflash.datasets import Prompt

CODE_TEMPLATE = "Complete this Python function. Reply with code only.\n```python\n{code}```"  # datasets.humaneval_prompts
CODE_VARIANTS = (
    "Implement the following Python function.\n```python\n{code}```",
    "Write the body of this function in Python.\n```python\n{code}```",
)
CHAT_TEMPLATES = (
    "Explain the following text from a Python library's documentation in simple terms:\n\n{text}",
    "Summarize this documentation paragraph in a few sentences:\n\n{text}",
    "Read this description and give a short example of how it could be used:\n\n{text}",
    "What is `{name}` in Python's `{module}` and when would you use it?",
    "Write a short, friendly explanation of `{name}` for a beginner.",
)
# Other tasks on the same mined content, for train/pool.py's later passes (one per item and pass).
CODE_TASKS = (
    "Write pytest unit tests for this Python function, based only on its signature and docstring.\n```python\n{code}```",
    "Plan in a few bullet points how to implement this function, then write the implementation.\n```python\n{code}```",
    "Implement this Python function, then show one example call and the value it returns.\n```python\n{code}```",
)
CHAT_TASKS = (
    "Write a short blog post for Python developers that introduces the idea in this documentation paragraph:\n\n{text}",
    "Turn this documentation paragraph into a short dialogue between a curious student and a teacher:\n\n{text}",
    "List the key technical terms in this text and define each in one sentence:\n\n{text}",
    "Write three quiz questions, with their answers, that check understanding of this text:\n\n{text}",
    "Rewrite this paragraph for a reader who does not program, in at most four sentences:\n\n{text}",
)
NGRAM = 8  # words; long enough that shared boilerplate ("return a list of the") does not count as overlap
DEFAULT_PACKAGES = ("numpy", "torch", "transformers", "tqdm", "jinja2", "safetensors", "huggingface_hub")
CODE_SOURCES = ("stdlib", "numpy", "jinja2", "tqdm")  # small self-contained functions, the closest to HumanEval


@dataclass(frozen=True, slots=True)
class Mined:
    name: str  # function / object name
    module: str
    source: str  # "stdlib" or the package name
    code: str  # signature + docstring (code prompts) or the paragraph (chat prompts)


def _source_roots(packages: tuple[str, ...]) -> list[tuple[str, Path]]:
    roots = [("stdlib", Path(sysconfig.get_paths()["stdlib"]))]
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.append((name, Path(spec.submodule_search_locations[0])))
    return roots


def _python_files(root: Path) -> list[Path]:
    skip = ("test", "site-packages", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "__pycache__")
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(any(s in part for s in skip) for part in rel[:-1]) or rel[-1].startswith("test"):
            continue
        files.append(path)
    return files


def _stub(fn: ast.FunctionDef, doc: str) -> str | None:
    """``def name(args) -> ret:`` plus the docstring, indented as in the source; None if unsuitable."""
    if fn.name.startswith("_") or fn.decorator_list or len(fn.body) < 2:
        return None
    if not fn.args.args and not fn.args.posonlyargs:
        return None
    lines = doc.strip().splitlines()
    if not 1 <= len(lines) <= 25 or len(doc) < 30 or len(doc) > 1200 or ">>>" in doc and len(lines) > 20:
        return None
    try:
        signature = ast.unparse(fn.args)
    except Exception:  # noqa: BLE001 - exotic syntax: skip the function
        return None
    ret = f" -> {ast.unparse(fn.returns)}" if fn.returns is not None else ""
    body = "\n".join(("    " + ln.strip()) if ln.strip() else "" for ln in lines)
    return f'def {fn.name}({signature}){ret}:\n    """{body.strip()}\n    """\n'


def mine_sources(packages: tuple[str, ...] = DEFAULT_PACKAGES) -> tuple[list[Mined], list[Mined]]:
    """(function stubs, documentation paragraphs) from the stdlib and ``packages``, in a deterministic order."""
    stubs: dict[str, Mined] = {}
    paragraphs: dict[str, Mined] = {}
    for source, root in _source_roots(packages):
        for path in _python_files(root):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
            for node in tree.body:
                doc = ast.get_docstring(node) if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None
                if isinstance(node, ast.FunctionDef) and doc:
                    stub = _stub(node, doc)
                    if stub and stub not in stubs:
                        stubs[stub] = Mined(node.name, module, source, stub)
                if isinstance(node, ast.ClassDef) and doc and not node.name.startswith("_"):
                    _add_paragraph(paragraphs, node.name, module, source, doc)
            mod_doc = ast.get_docstring(tree)
            if mod_doc:
                _add_paragraph(paragraphs, module.rsplit(".", 1)[-1], module, source, mod_doc)
    return list(stubs.values()), list(paragraphs.values())


def _add_paragraph(out: dict[str, Mined], name: str, module: str, source: str, doc: str) -> None:
    para = doc.strip().split("\n\n")[0]
    text = " ".join(para.split())
    if 80 <= len(text) <= 700 and not re.search(r"[{}<>|=]{3}|\.\. |:(func|class|meth):|>>>", text) and text not in out:
        out[text] = Mined(name, module, source, text)


def normalized_words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(text: str, n: int = NGRAM) -> set[str]:
    words = normalized_words(text)
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


@dataclass(frozen=True, slots=True)
class EvalIndex:
    """What a training prompt must not share with the evaluation sets."""

    entry_points: frozenset[str]  # HumanEval function names
    ngrams: frozenset[str]  # normalised word 8-grams of every evaluation prompt (template wrappers removed)

    @classmethod
    def build(cls) -> "EvalIndex":
        from trtllm_dflash.datasets import humaneval_problems, mtbench_prompts

        problems = humaneval_problems()
        grams: set[str] = set()
        for p in problems:
            grams |= ngrams(p["prompt"])
        for q in mtbench_prompts():
            grams |= ngrams(q.text)
        return cls(frozenset(p["entry_point"] for p in problems), frozenset(grams))

    def overlap(self, text: str, name: str | None = None) -> str | None:
        """Why ``text`` overlaps the evaluation sets, or None."""
        if name is not None and name in self.entry_points:
            return f"function name {name!r} is a HumanEval entry point"
        for word in re.findall(r"def ([A-Za-z_][A-Za-z0-9_]*)\(", text):
            if word in self.entry_points:
                return f"defines HumanEval entry point {word!r}"
        shared = ngrams(_strip_templates(text)) & self.ngrams
        if shared:
            return f"shares the word {NGRAM}-gram {sorted(shared)[0]!r} with an evaluation prompt"
        return None


def _strip_templates(text: str) -> str:
    """Our own instruction wrappers are not content; only what was mined is compared."""
    for t in (CODE_TEMPLATE, *CODE_VARIANTS, *CODE_TASKS, *CHAT_TASKS):
        head = t.split("{code}")[0].split("{text}")[0]
        if text.startswith(head):
            return text[len(head) :]
    return text


def mine_prompts(num_code: int, num_chat: int, seed: int = 0, index: EvalIndex | None = None) -> list[Prompt]:
    """``num_code`` code prompts and ``num_chat`` chat prompts, sampled deterministically, none overlapping eval."""
    index = index or EvalIndex.build()
    stubs, paragraphs = mine_sources()
    stubs = [m for m in stubs if m.source in CODE_SOURCES]
    rng = random.Random(seed)
    rng.shuffle(stubs)
    rng.shuffle(paragraphs)
    out: list[Prompt] = []
    for m in stubs:
        if len([p for p in out if p.id.startswith("code/")]) >= num_code:
            break
        template = CODE_TEMPLATE if rng.random() < 0.8 else rng.choice(CODE_VARIANTS)
        text = template.format(code=m.code)
        if index.overlap(text, m.name) is None:
            out.append(Prompt(f"code/{m.module}.{m.name}", text, True))
    num_code_found = len(out)
    for m in paragraphs:
        if len(out) - num_code_found >= num_chat:
            break
        text = rng.choice(CHAT_TEMPLATES).format(text=m.code, name=m.name, module=m.module)
        if index.overlap(text) is None:
            out.append(Prompt(f"chat/{m.module}.{m.name}", text, True))
    return out


def prompts_digest(prompts: list[Prompt]) -> str:
    return hashlib.sha256("\n\x00".join(p.text for p in prompts).encode()).hexdigest()[:16]
