"""Regenerated responses at scale: batched greedy decoding with no per-row Python work, written as a sharded,
resumable, deterministic on-disk dataset of token ids plus the target's own top-k next-token logits.

Unlike ``data.generate_with_taps`` (which keeps every tap of every token in memory: 3.5 KB per token for SmolLM2's
three taps, 17 GB for 5M tokens), this keeps only ids and top-k logits; taps come afterwards from one teacher-forced
forward per chunk (``tap_shards``), which is cheap on a GPU and yields the training shards ``data.read_shard`` reads.
Where that second forward is not cheap (a CPU, where it costs as much as the decode), ``regenerate(tap_layers=...)``
keeps the taps the decode computes anyway, one chunk at a time, for the caller to write as the training shard.

Layout of ``out_dir`` (one chunk of prompts per shard; a shard is written atomically, so a killed run resumes at the
first missing one; chunk membership depends only on the prompts and the seed, so a rerun is bit-identical on the same
device):

    meta.json              settings the shards were made with (a mismatch is an error, not a silent mix)
    regen-00000.safetensors
        ids          [N] int64       prompt + response tokens, concatenated over the chunk's samples
        cu_seqlens   [n + 1] int64
        prompt_lens  [n] int64
        topk_ids     [N, k] int32    row j: the target's k most likely next tokens after ids[: j + 1] (response rows
        topk_logits  [N, k] bf16     P − 1 .. S − 2 only; other rows zero): the self-distillation targets
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from trtllm_dflash.datasets import Prompt
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.train.data import TAPS_TOP_K, Sample, pack_sequences, save_atomic, write_shard


@dataclass(frozen=True, slots=True)
class Regenerated:
    ids: torch.Tensor  # [S] int64 prompt + response (stop token kept)
    prompt_len: int
    topk_ids: torch.Tensor  # [S, k] int32
    topk_logits: torch.Tensor  # [S, k] bf16
    taps: torch.Tensor | None = None  # [S, K·H] bf16, row j the taps of ids[j], last row zero (``data`` layout)

    def as_sample(self) -> Sample:
        return Sample(self.ids, self.taps, self.prompt_len, self.topk_ids, self.topk_logits)


@torch.inference_mode()
def regenerate(target: TargetModel, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: tuple[int, ...],
               top_k: int = 8, check_every: int = 8, compact: float = 0.75,
               tap_layers: tuple[int, ...] = ()) -> list[Regenerated]:
    """Greedy responses of every prompt, decoded together, with one host sync per ``check_every`` steps and none per
    row: finished rows keep stepping (masked) until at most ``compact`` of the stepped rows are unfinished, then only
    the unfinished ones are stepped (``rows=`` into the same cache; a row's tokens do not depend on the others).
    With ``tap_layers``, each sample also carries the taps the prefill and the decode steps computed (bf16; the
    teacher-forced ``tap_shards`` pass then has nothing left to do)."""
    dev, n = target.device, len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=dev)  # [n]
    p_max = int(lens.max())
    cache = target.new_cache(n, p_max + max_new_tokens + 1)
    ids = torch.zeros(n, p_max, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, device=dev)
    hidden, prompt_taps = target(ids, cache, tap_layers=tap_layers)
    if tap_layers:  # step_taps[:, s]: the taps of response token s, computed when it is fed back at step s + 1
        prompt_taps = prompt_taps.to(torch.bfloat16)
        step_taps = torch.zeros(n, max_new_tokens, prompt_taps.shape[2], dtype=torch.bfloat16, device=dev)
    cache.commit(None, lens)
    logits = target.logits(hidden[torch.arange(n, device=dev), lens - 1]).float()  # [n, V]
    stops = torch.tensor(stop_token_ids or (-1,), device=dev)
    out = torch.zeros(n, max_new_tokens, dtype=torch.long, device=dev)
    top_v = torch.zeros(n, max_new_tokens, top_k, dtype=torch.bfloat16, device=dev)
    top_i = torch.zeros(n, max_new_tokens, top_k, dtype=torch.int32, device=dev)
    new_len = torch.zeros(n, dtype=torch.long, device=dev)  # response tokens so far (stop token included)
    done = torch.zeros(n, dtype=torch.bool, device=dev)
    steps, active = 0, None  # active: the cache rows still stepped (None = all); finished rows are dropped
    for step in range(max_new_tokens):
        idx = slice(None) if active is None else active
        v, i = logits.topk(top_k, dim=-1)
        top_v[idx, step], top_i[idx, step] = v.to(torch.bfloat16), i.to(torch.int32)
        nxt = i[:, 0]  # greedy = top-1
        out[idx, step] = nxt
        new_len[idx] += (~done[idx]).long()
        done[idx] |= torch.isin(nxt, stops)
        steps = step + 1
        if step == max_new_tokens - 1:
            break
        if steps % check_every == 0:
            live = (~done).nonzero()[:, 0]
            if len(live) == 0:
                break
            if len(live) <= compact * (n if active is None else len(active)):  # step only the unfinished rows
                active, nxt = live, out[live, step]
        hidden, taps = target(nxt[:, None], cache, rows=active, tap_layers=tap_layers)
        if tap_layers:
            step_taps[slice(None) if active is None else active, step] = taps[:, 0].to(torch.bfloat16)
        cache.commit(active, torch.ones_like(nxt))
        logits = target.logits(hidden[:, 0]).float()
    res = []
    lens_l, new_l = lens.tolist(), new_len.tolist()
    out, top_v, top_i = out[:, :steps].cpu(), top_v[:, :steps].cpu(), top_i[:, :steps].cpu()
    for r, p in enumerate(prompts):
        m, pl = new_l[r], lens_l[r]
        tk_i = torch.zeros(pl + m, top_k, dtype=torch.int32)
        tk_v = torch.zeros(pl + m, top_k, dtype=torch.bfloat16)
        tk_i[pl - 1 : pl - 1 + m], tk_v[pl - 1 : pl - 1 + m] = top_i[r, :m], top_v[r, :m]
        taps = None
        if tap_layers:  # ids[: -1] = prompt + response[: m - 1] are tapped; the last row stays zero
            taps = torch.zeros(pl + m, prompt_taps.shape[2], dtype=torch.bfloat16)
            taps[:pl], taps[pl : pl + m - 1] = prompt_taps[r, :pl].cpu(), step_taps[r, : m - 1].cpu()
        res.append(Regenerated(torch.cat([torch.tensor(p), out[r, :m]]), pl, tk_i, tk_v, taps))
    return res


def training_shard_name(regen_name: str) -> str:
    """The training shard (taps added) of regen shard ``regen_name``: regen-00012.safetensors -> shard-00012..."""
    return regen_name.replace("regen-", "shard-")


def write_regen_shard(path: Path, samples: list[Regenerated]) -> None:
    save_atomic(pack_sequences(samples, ("topk_ids", "topk_logits")), path)


def read_regen_shard(path: Path) -> list[Regenerated]:
    t = load_file(str(path))
    cu = t["cu_seqlens"].tolist()
    return [Regenerated(t["ids"][a:b], int(pl), t["topk_ids"][a:b], t["topk_logits"][a:b])
            for a, b, pl in zip(cu[:-1], cu[1:], t["prompt_lens"].tolist())]


def iter_regen(out_dir: Path) -> Iterator[Regenerated]:
    """Every sample of ``out_dir``, one shard in memory at a time, in shard order."""
    for path in sorted(Path(out_dir).glob("regen-*.safetensors")):
        yield from read_regen_shard(path)


def plan_chunks(prompt_lens: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """Chunks of prompts of similar length (less padding), in a seeded order so any prefix of shards is a fair
    sample of the whole mix."""
    order = sorted(range(len(prompt_lens)), key=lambda i: (prompt_lens[i], i))
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    perm = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(seed)).tolist()
    return [chunks[i] for i in perm]


def build_regen(target: TargetModel, encoded: list[list[int]], out_dir: Path, *, max_new_tokens: int,
                stop_token_ids: tuple[int, ...], batch_size: int, top_k: int = 8, seed: int = 0,
                max_shards: int | None = None, progress=None) -> list[Path]:
    """Regenerate ``encoded`` prompts chunk by chunk into ``out_dir``; resumes by shard; returns the shard paths."""
    meta = {"max_new_tokens": max_new_tokens, "num_prompts": len(encoded), "batch_size": batch_size, "top_k": top_k,
            "seed": seed, "stop_token_ids": list(stop_token_ids)}
    chunks = plan_chunks([len(e) for e in encoded], batch_size, seed)[:max_shards]
    return write_chunk_shards(out_dir, meta, chunks, lambda chunk: regenerate(
        target, [encoded[i] for i in chunk], max_new_tokens, stop_token_ids, top_k), progress)


def write_chunk_shards(out_dir: Path, meta: dict, chunks: list[list[int]], make, progress=None) -> list[Path]:
    """One ``regen-NNNNN`` shard per chunk, ``make(chunk)`` -> its samples; a shard already on disk is kept (resume),
    and ``meta.json`` must match the settings it was made with."""
    out_dir.mkdir(parents=True, exist_ok=True)
    meta_path = out_dir / "meta.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()) != meta:
        raise ValueError(f"{out_dir} holds data made with other settings {meta_path.read_text()}; use a new dir")
    meta_path.write_text(json.dumps(meta) + "\n")
    paths = []
    for c, chunk in enumerate(chunks):
        path = out_dir / f"regen-{c:05d}.safetensors"
        paths.append(path)
        if not path.is_file():
            write_regen_shard(path, make(chunk))
        if progress is not None:
            progress(c + 1, len(chunks))
    return paths


@torch.no_grad()
def with_taps(target: TargetModel, samples: list[Sample], tap_layers: tuple[int, ...]) -> list[Sample]:
    """``samples`` with their taps computed now (one padded teacher-forced forward; bf16, the last row zero, as on
    disk): the online alternative to ``tap_shards`` when the target is cheap to run (a GPU). The taps stay on the
    target's device, where ``objective.collate`` gathers them (a round trip through the host cost a GPU step two
    copies of every tap and a wait for the forward)."""
    s_max = max(len(x.ids) for x in samples)
    width = max(1, s_max - 1)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    for j, x in enumerate(samples):
        ids[j, : len(x.ids) - 1] = x.ids[:-1]
    # a cache exactly as wide as the step, so the static forward (no read of the cache's lengths back to the host)
    # attends over the same keys as the dynamic one would
    _, taps = target(ids.to(target.device, non_blocking=True), target.new_cache(len(samples), width),
                     tap_layers=tap_layers, static=True)
    taps = taps.to(torch.bfloat16)
    out = []
    for j, x in enumerate(samples):
        t = torch.cat([taps[j, : len(x.ids) - 1], taps.new_zeros(1, taps.shape[2])])
        out.append(Sample(x.ids, t, x.prompt_len, x.topk_ids, x.topk_logits, x.labels))
    return out


def samples_without_taps(regen_paths: list[Path]) -> list[Sample]:
    """Regenerated samples (ids + top-k, no taps) for training with ``with_taps``: ~40 bytes per token in memory
    instead of the 3.5 KB of cached taps."""
    return [Sample(r.ids, None, r.prompt_len, r.topk_ids, r.topk_logits) for p in regen_paths
            for r in read_regen_shard(p)]


@torch.inference_mode()
def tap_shards(target: TargetModel, regen_paths: list[Path], out_dir: Path, tap_layers: tuple[int, ...],
               batch_size: int = 32, progress=None) -> list[Path]:
    """Training shards (``data.write_shard`` layout) for regenerated samples: taps from one teacher-forced forward of
    each padded chunk; resumes by shard."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, src in enumerate(regen_paths):
        dst = out_dir / training_shard_name(src.name)
        paths.append(dst)
        if not dst.is_file():
            regen = read_regen_shard(src)
            samples = []
            for i in range(0, len(regen), batch_size):
                part = regen[i : i + batch_size]
                s_max = max(len(r.ids) for r in part)
                ids = torch.zeros(len(part), s_max - 1, dtype=torch.long)
                for j, r in enumerate(part):
                    ids[j, : len(r.ids) - 1] = r.ids[:-1]
                _, taps = target(ids.to(target.device), target.new_cache(len(part), s_max), tap_layers=tap_layers)
                taps = taps.to(torch.bfloat16).cpu()  # [b, S_max − 1, K·H]
                for j, r in enumerate(part):
                    t = torch.cat([taps[j, : len(r.ids) - 1], torch.zeros(1, taps.shape[2], dtype=taps.dtype)])
                    samples.append(Sample(r.ids, t, r.prompt_len, r.topk_ids, r.topk_logits))
            write_shard(dst, samples)
        if progress is not None:
            progress(n + 1, len(regen_paths))
    return paths


def build_taps_cache(
    target: TargetModel,
    tokenizer,
    prompts: list[Prompt],
    out_dir: Path,
    *,
    tap_layers: tuple[int, ...],
    max_new_tokens: int,
    max_prompt_len: int,
    stop_token_ids: tuple[int, ...],
    batch_size: int,
    max_shards: int | None = None,
    progress=None,
) -> list[Path]:
    """Regenerate responses for ``prompts`` in chunks of ``batch_size`` (the first ``max_shards`` chunks only, if
    given) and cache their taps with the target's top-k next-token logits (``regenerate``: what ``--distill`` and
    ``--tv`` train against); resumes by chunk."""
    from trtllm_dflash.runtime.text import encode_prompt

    out_dir.mkdir(parents=True, exist_ok=True)
    # top_k: shards written without the target's top-k (before the cache kept it) are refused, not mixed in
    meta = {"tap_layers": list(tap_layers), "max_new_tokens": max_new_tokens, "num_prompts": len(prompts),
            "top_k": TAPS_TOP_K}
    meta_path = out_dir / "meta.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()) != meta:
        raise ValueError(f"{out_dir} holds taps for different settings {meta_path.read_text()}; use a new --out")
    meta_path.write_text(json.dumps(meta) + "\n")
    encoded = [encode_prompt(tokenizer, p.text, p.chat) for p in prompts]
    keep = [e for e in encoded if len(e) <= max_prompt_len]
    chunks = plan_chunks([len(e) for e in keep], batch_size, seed=0)[:max_shards]
    paths = []
    for c, chunk in enumerate(chunks):
        path = out_dir / f"shard-{c:05d}.safetensors"
        paths.append(path)
        if not path.is_file():
            prompts_ids = [keep[i] for i in chunk]
            regen = regenerate(target, prompts_ids, max_new_tokens, stop_token_ids, TAPS_TOP_K, tap_layers=tap_layers)
            write_shard(path, [r.as_sample() for r in regen])
        if progress is not None:
            progress(sum(len(ch) for ch in chunks[: c + 1]), len(keep))
    return paths
