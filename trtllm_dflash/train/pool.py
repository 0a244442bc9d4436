"""A large training-prompt pool from every installed Python package (no downloads): the scale-up of train/prompts.py.

train/prompts.py mines top-level functions and class/module docstrings of eight packages. Here every
package in the interpreter's site-packages and the stdlib is read, methods count as functions too, and every
documentation paragraph (not only the first) of modules, classes, functions and methods becomes a chat prompt. Each
mined item is used once, with one seeded template, so the count is of distinct content, not of template variants.
Every prompt is checked against HumanEval and MT-Bench with the same ``EvalIndex`` as the training CLI; rejected
prompts are counted in the summary.

    python -m trtllm_dflash.train.pool --out artifacts/pool/pool.jsonl --summary perf/results/drafter-pool/summary.json

``--passes 2`` (or 3) appends, after the unchanged first-pass rows, every item again under a different task (id suffix
``#p2``): tests of a function or a plan-then-implement answer for code; a blog post, a dialogue, key terms, quiz
questions or a plain-words rewrite for documentation, in the spirit of MT-Bench's writing / role-play / extraction /
STEM categories (our own wording; every prompt still goes through the overlap check). A drafter that has seen the
first pass of every item gets new target responses from the same content.
"""

from __future__ import annotations

import argparse
import ast
import collections
import hashlib
import json
import os
import random
import re
import sys
import sysconfig
from pathlib import Path

from trtllm_dflash.datasets import read_jsonl
from trtllm_dflash.train.prompts import (
    CHAT_TASKS, CHAT_TEMPLATES, CODE_TASKS, CODE_TEMPLATE, CODE_VARIANTS, EvalIndex, _python_files, _stub,
)

MAX_PASSES = 1 + min(len(CODE_TASKS), len(CHAT_TASKS))


def jsonl_ids(paths) -> set[str]:
    """The ``id`` of every row of these JSONL(.gz) files (e.g. a drafter's ``training_prompts.jsonl.gz``): prompts to
    leave out of a pool sample, so that a drafter trained on them gets new ones."""
    return {row["id"] for f in paths for row in read_jsonl(f)}


def package_roots() -> list[tuple[str, Path]]:
    """(name, directory) of the stdlib and of every package directory in site-packages, sorted by name."""
    roots = [("stdlib", Path(sysconfig.get_paths()["stdlib"]))]
    site = Path(sysconfig.get_paths()["purelib"])
    for d in sorted(site.iterdir()):
        if d.is_dir() and (d / "__init__.py").is_file() and not d.name.startswith(("_", "test")):
            roots.append((d.name, d))
    return roots


def _paragraphs(doc: str) -> list[str]:
    out = []
    for para in doc.strip().split("\n\n"):
        text = " ".join(para.split())
        if 80 <= len(text) <= 700 and not re.search(r"[{}<>|=]{3}|\.\. |:(func|class|meth):|>>>", text):
            out.append(text)
    return out


def mine_file(path: Path, root: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """([(name, stub)], [(name, paragraph)]) of one source file."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
        return [], []
    module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
    stubs, paras = [], []
    doc = ast.get_docstring(tree)
    if doc:
        paras += [(module, p) for p in _paragraphs(doc)]

    def visit(body, prefix: str, depth: int) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                d = ast.get_docstring(node)
                if not d:
                    continue
                name = f"{prefix}{node.name}"
                if isinstance(node, ast.FunctionDef):
                    stub = _stub(node, d)
                    if stub:
                        stubs.append((name, stub))
                paras.extend((name, p) for p in _paragraphs(d))
                if isinstance(node, ast.ClassDef) and depth == 0:
                    visit(node.body, f"{node.name}.", 1)

    visit(tree.body, "", 0)
    return [(module + ":" + n, s) for n, s in stubs], [(module + ":" + n, p) for n, p in paras]


def build_pool(seed: int = 0, index: EvalIndex | None = None, progress=None, passes: int = 1,
               roots: list[tuple[str, Path]] | None = None) -> tuple[list[dict], dict]:
    """Every distinct mined item as one prompt, in a seeded order (then, for ``passes`` > 1, every item again under
    another task per pass); plus a summary (counts per source, rejections). ``roots`` defaults to ``package_roots()``."""
    if not 1 <= passes <= MAX_PASSES:
        raise ValueError(f"passes={passes}: must be between 1 and {MAX_PASSES} (one task template per item and pass)")
    index = index or EvalIndex.build()
    seen: set[str] = set()
    items: list[tuple[str, str, str, str]] = []  # (kind, source, name, content)
    per_source = collections.Counter()
    roots = package_roots() if roots is None else roots
    for n, (source, root) in enumerate(roots):
        for path in _python_files(root):
            stubs, paras = mine_file(path, root)
            for kind, found in (("code", stubs), ("chat", paras)):
                for name, content in found:
                    if content not in seen:
                        seen.add(content)
                        items.append((kind, source, name, content))
                        per_source[source] += 1
        if progress is not None:
            progress(n + 1, len(roots), len(items))
    rng = random.Random(seed)
    rng.shuffle(items)
    rows, rejected = [], collections.Counter()

    def add(kind: str, source: str, name: str, text: str, suffix: str) -> None:
        short = name.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
        why = index.overlap(text, short if kind == "code" else None)
        if why is not None:
            rejected[why.split(" ")[0] + " " + why.split(" ")[1]] += 1
            return
        rows.append({"id": f"{kind}/{source}/{name}{suffix}", "prompt": text, "chat": True})

    for kind, source, name, content in items:  # pass 1: exactly the rows of a one-pass pool
        if kind == "code":
            text = (CODE_TEMPLATE if rng.random() < 0.8 else rng.choice(CODE_VARIANTS)).format(code=content)
        else:
            short = name.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
            text = rng.choice(CHAT_TEMPLATES[:3]).format(text=content, name=short, module=name.split(":", 1)[0])
        add(kind, source, name, text, "")
    later = random.Random(f"{seed}/later-passes")
    orders = [later.sample(range(n), n) for n in (len(CODE_TASKS if it[0] == "code" else CHAT_TASKS) for it in items)
              ] if passes > 1 else []
    for p in range(2, passes + 1):
        for i in later.sample(range(len(items)), len(items)):
            kind, source, name, content = items[i]
            tasks = CODE_TASKS if kind == "code" else CHAT_TASKS
            add(kind, source, name, tasks[orders[i][p - 2]].format(code=content, text=content), f"#p{p}")
    digest = hashlib.sha256("\n\x00".join(r["prompt"] for r in rows).encode()).hexdigest()[:16]
    kinds = collections.Counter(r["id"].split("/", 1)[0] for r in rows)
    summary = {"num_prompts": len(rows), "num_distinct_texts": len({r["prompt"] for r in rows}),
               "by_kind": dict(kinds), "num_sources": len(per_source),
               "top_sources": dict(per_source.most_common(25)), "rejected_overlap": dict(rejected),
               "digest": digest, "seed": seed, "passes": passes, "python": sys.version.split()[0],
               "eval_sets_checked": ["HumanEval (164 entry points + word 8-grams)", "MT-Bench (80 questions, 8-grams)"]}
    return rows, summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="pool JSONL to write (atomically)")
    p.add_argument("--summary", default=None, help="also write the summary JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--passes", type=int, default=1, choices=range(1, MAX_PASSES + 1),
                   help="1: each mined item once; 2-3: each item again under another task per pass (id suffix #pN)")
    args = p.parse_args(argv)
    from tqdm import tqdm

    bar = tqdm(desc="mining packages", unit="pkg", file=sys.stderr)

    def progress(done, total, n):
        bar.total = total
        bar.set_postfix(items=n, refresh=False)
        bar.update(done - bar.n)

    rows, summary = build_pool(args.seed, progress=progress, passes=args.passes)
    bar.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, out)
    summary["command"] = "python -m trtllm_dflash.train.pool " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(args.summary).with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
        os.replace(tmp, args.summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
