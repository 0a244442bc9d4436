"""A cheaper training source than regeneration: real code, teacher-forced through the target.

Regenerating a response costs one target step per token (batched greedy decoding, ``train/regen.py``); reading real
text costs one forward over the whole sequence. Here the text is the installed Python sources' own functions: the
prompt is the pool's code-completion prompt around a function's signature and docstring (``train/prompts._stub`` and
the same templates), the response is the function's real source in the fence the target itself answers with
(```` ```python ... ``` ```` then the end of turn). One teacher-forced forward gives the target's top-k next tokens
after every real prefix, stored in the regeneration shard layout (``regen.write_regen_shard``), so every consumer of
regenerated data (taps, training, distillation) reads it unchanged. ``target_labels`` turns those predictions into
hard labels: the drafter then learns what the target would say next, not what the file says.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path

import torch

from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.train.data import Sample
from trtllm_dflash.train.regen import Regenerated, plan_chunks, write_chunk_shards


def mine_functions(limit: int, seed: int, index=None) -> list[dict]:
    """Up to ``limit`` {"id", "prompt", "response"} from every installed package, in a seeded order; prompts that
    overlap HumanEval / MT-Bench are dropped (the same check as the prompt pool)."""
    from trtllm_dflash.train.pool import package_roots
    from trtllm_dflash.train.prompts import CODE_TEMPLATE, CODE_VARIANTS, EvalIndex, _python_files, _stub

    index = index or EvalIndex.build()
    found, seen = [], set()
    for source, root in package_roots():
        for path in _python_files(root):
            try:
                src = path.read_text(encoding="utf-8")
                tree = ast.parse(src)
            except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
                continue
            lines = src.splitlines()
            nodes = [(n, "") for n in tree.body]
            nodes += [(m, n.name + ".") for n in tree.body if isinstance(n, ast.ClassDef) for m in n.body]
            for node, prefix in nodes:
                if not isinstance(node, ast.FunctionDef):
                    continue
                doc = ast.get_docstring(node)
                stub = _stub(node, doc) if doc else None
                if not stub or node.end_lineno is None:
                    continue
                code = _dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))  # decorators: none (_stub)
                if code in seen or len(code) > 4000:
                    continue
                seen.add(code)
                found.append((f"text/{source}/{prefix}{node.name}", node.name, stub, code))
    rng = random.Random(seed)
    rng.shuffle(found)
    out = []
    for fid, name, stub, code in found:
        text = (CODE_TEMPLATE if rng.random() < 0.8 else rng.choice(CODE_VARIANTS)).format(code=stub)
        if index.overlap(text, name) is None and index.overlap(code, name) is None:
            out.append({"id": fid, "prompt": text, "response": f"```python\n{code}```"})
        if len(out) >= limit:
            break
    return out


def _dedent(segment: str) -> str:
    lines = segment.expandtabs().splitlines()
    indent = min((len(ln) - len(ln.lstrip()) for ln in lines if ln.strip()), default=0)
    return "\n".join(ln[indent:] for ln in lines).rstrip() + "\n"


@torch.inference_mode()
def teacher_forced(target: TargetModel, seqs: list[tuple[list[int], int]], top_k: int = 8) -> list[Regenerated]:
    """The target's top-k next tokens after every response prefix of each (ids, prompt_len), one padded forward."""
    dev, n = target.device, len(seqs)
    s_max = max(len(ids) for ids, _ in seqs)
    x = torch.zeros(n, s_max, dtype=torch.long)
    for i, (ids, _) in enumerate(seqs):
        x[i, : len(ids)] = torch.tensor(ids)
    hidden, _ = target(x.to(dev), target.new_cache(n, s_max + 1))
    out = []
    for i, (ids, p) in enumerate(seqs):
        s = len(ids)
        top_v = torch.zeros(s, top_k, dtype=torch.bfloat16)
        top_i = torch.zeros(s, top_k, dtype=torch.int32)
        v, j = target.logits(hidden[i, p - 1 : s - 1]).float().topk(top_k, dim=-1)  # rows P − 1 .. S − 2
        top_v[p - 1 : s - 1], top_i[p - 1 : s - 1] = v.cpu().to(torch.bfloat16), j.cpu().to(torch.int32)
        out.append(Regenerated(torch.tensor(ids), p, top_i, top_v))
    return out


def build_text_source(target: TargetModel, tok, rows: list[dict], out_dir: Path, *, max_new_tokens: int,
                      max_prompt_len: int, end_id: int, batch_size: int = 16, top_k: int = 8, seed: int = 0,
                      max_shards: int | None = None) -> list[Path]:
    """Shards of teacher-forced real responses (the regeneration layout); resumes by shard."""
    from trtllm_dflash.runtime.text import encode_prompt

    seqs = []
    for r in rows:
        p = encode_prompt(tok, r["prompt"], True)
        resp = list(tok.encode(r["response"], add_special_tokens=False)) + [end_id]
        if len(p) <= max_prompt_len:
            seqs.append((p + resp[:max_new_tokens], len(p)))
    meta = {"source": "text", "num": len(seqs), "max_new_tokens": max_new_tokens, "batch_size": batch_size,
            "top_k": top_k, "seed": seed}
    chunks = plan_chunks([len(s) for s, _ in seqs], batch_size, seed)[:max_shards]
    return write_chunk_shards(out_dir, meta, chunks,
                              lambda chunk: teacher_forced(target, [seqs[i] for i in chunk], top_k))


def target_labels(sample: Sample) -> Sample:
    """``sample`` whose response tokens are replaced, for labelling only, by the target's own greedy prediction after
    each real prefix (top-1 of the stored top-k); the inputs (anchor tokens, taps) stay the real text."""
    labels = sample.ids.clone()
    p, s = sample.prompt_len, len(sample.ids)
    labels[p:s] = sample.topk_ids[p - 1 : s - 1, 0].long()
    return Sample(sample.ids, sample.taps, sample.prompt_len, sample.topk_ids, sample.topk_logits, labels)
