#!/usr/bin/env python3
"""τ of tree-verify shapes (``runtime.tree.TreeShape``) replayed on the target's greedy outputs, with their size.

A tree verify's τ depends only on which proposals it checks, so it can be replayed exactly (``train.audit``: the same
walk the decoder takes, proved equal to decoding on the real pair in tests/train/test_train_audit.py) from the drafter's
top choices at every anchor, computed once per output, for any number of shapes. This is how the decoder's default
tree (``TreeShape.for_block``) was picked; what a shape costs is its node count (the verify's width), which costs about
nothing where a verify is launch-bound (a GPU at small batch) and in proportion on a CPU.

    python perf/tree_shapes.py --datasets humaneval,mtbench --limit 40 --out perf/results/tree/shapes-40.json

With a retrieval datastore (``--datastore``; by default the drafter directory's ``datastore.dflash``) the
default tree with its proposals is replayed too. Greedy outputs are ``trtllm-dflash learning-curve eval``'s cached ones
(``--work``), made first if missing. Prints one JSON object (and writes it atomically with ``--out``; a PNG of τ
against nodes beside it, the default trees black stars; ``--plot FILE.json`` redraws it)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from trtllm_dflash.train.curve import greedy_reference, load_target, write_json


def shapes(k: int) -> dict[str, object]:
    """Named shapes with ``k`` drafts per chain: the drafter alone, prompt lookup inside it (``ngram``, not a tree:
    one chain chosen per step), the two-branch tree, growing sets of alternates and the default's alternates with
    1 to 8 lookup chains (``runtime.tree.lookup_chains``)."""
    from trtllm_dflash.runtime.tree import TreeShape

    slot1 = ((1, 2), (1, 3))
    runner_ups = ((2, 2), (3, 2), (4, 2))
    out: dict[str, object] = {"drafter": TreeShape(k, (), lookup=False), "ngram": "ngram",
                              "two-branch (drafter + lookup)": TreeShape(k)}
    for name, alts in (("+ slot 1 rank 2", ((1, 2),)), ("+ slot 1 ranks 2-3", slot1),
                       ("+ slot 1 ranks 2-3, slots 2-4 rank 2", slot1 + runner_ups),
                       ("+ slot 1 ranks 2-5, slots 2-4 rank 2", slot1 + ((1, 4), (1, 5)) + runner_ups),
                       ("+ slot 1 ranks 2-8, slots 2-4 rank 2",
                        slot1 + tuple((1, r) for r in range(4, 9)) + runner_ups),
                       ("+ slot 1 ranks 2-5, slots 2-6 rank 2, slot 2 rank 3",
                        slot1 + ((1, 4), (1, 5), (2, 3), (5, 2), (6, 2)) + runner_ups)):
        alts = tuple((s, r) for s, r in alts if s <= k)
        for cap in (None, 8, 4):
            out[f"{name}{'' if cap is None else f', {cap} nodes'}"] = TreeShape(k, alts, alternate_len=cap)
    default = TreeShape.for_block(k)
    for chains in (1, 3, 8):  # the default's alternates with other numbers of lookup chains
        out[f"default alternates, {chains} lookup chain{'s' if chains > 1 else ''}"] = \
            dataclasses.replace(default, lookup=chains, grafts=())
    out.update(grafted_variants("default", default))
    return out


def grafted_variants(name: str, default) -> dict[str, object]:
    """``default`` as it is, without grafted lookup chains and with grafts at main-chain depths 1 and 2."""
    return {f"{name}, no grafts": dataclasses.replace(default, grafts=()),
            f"{name}, grafts at depths 1-2": dataclasses.replace(default, grafts=(1, 2)),
            f"{name} (TreeShape.for_block{', datastore=True' if 'datastore' in name else ''})": default}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default=str(REPO / "trtllm_dflash/data/drafters/smollm2-135m-instruct-dflash"))
    p.add_argument("--target", default=None, help="HF target directory (default: the demo target)")
    p.add_argument("--work", default="artifacts/curve14", help="learning-curve's folder with the greedy outputs")
    p.add_argument("--datasets", default="humaneval,mtbench")
    p.add_argument("--limit", type=int, default=40, help="first prompts of each dataset")
    p.add_argument("--references-limit", type=int, default=164,
                   help="which cached greedy file to read (its first --limit rows are used)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="for making missing greedy outputs")
    p.add_argument("--datastore", default="auto", metavar="FILE|auto|none",
                   help="also the default tree with a retrieval datastore (auto: the drafter directory's, if any)")
    p.add_argument("--out", default=None, help="JSON file (written atomically), PNG beside it")
    p.add_argument("--plot", default=None, metavar="JSON", help="only redraw the PNG of an earlier --out file")
    args = p.parse_args(argv)
    if args.plot:
        result = json.loads(Path(args.plot).read_text())
        plot(result, Path(args.plot).with_suffix(".png"))
        return result

    import torch
    from tqdm import tqdm

    from trtllm_dflash.commands.common import resolve_datastore
    from trtllm_dflash.models.drafter import DrafterModel
    from trtllm_dflash.runtime.lookup import LOOKUP_MIN_N
    from trtllm_dflash.runtime.tree import TreeShape
    from trtllm_dflash.train.audit import drafter_choices, lookup_acceptance, tree_acceptance, walk, with_lookup

    _, target, tok, stops = load_target(args)
    drafter = DrafterModel.from_pretrained(args.drafter, dtype=torch.float32, device="cpu")
    k = args.block_size - 1
    named = shapes(k)
    store = resolve_datastore(args.datastore, args.drafter, tree_lookup=True)
    stored: set[str] = set()  # the shapes replayed with the datastore's proposals
    if store is not None:
        extra = grafted_variants("default + datastore", TreeShape.for_block(k, datastore=True))
        named.update(extra)
        stored.update(extra)
    top = max(s.top for s in named.values() if isinstance(s, TreeShape))
    result: dict = {"drafter": Path(args.drafter).name, "block_size": args.block_size, "limit": args.limit,
                    **({"datastore_tokens": store.num_tokens} if store is not None else {}),
                    "max_new_tokens": args.max_new_tokens, "method": "replay (train.audit walks)", "datasets": {}}
    for ds in args.datasets.split(","):
        ref_args = argparse.Namespace(**{**vars(args), "limit": args.references_limit})
        rows = greedy_reference(ref_args, target, tok, stops, ds)[: args.limit]
        taus: dict[str, list[int]] = {name: [] for name in named}
        for r in tqdm(rows, desc=f"{ds}: drafter choices ({top} per slot)"):
            ids, pl = r["prompt_ids"] + r["token_ids"], len(r["prompt_ids"])
            if len(ids) - 1 <= pl:
                continue
            choices = drafter_choices(target, drafter, ids, pl, top, args.block_size)
            lookup = lookup_acceptance(ids, pl, args.block_size, min_ngram=LOOKUP_MIN_N)
            chains: dict[tuple, list] = {}  # (lookup chains, grafts, with the datastore) -> their acceptance
            for name, shape in named.items():
                key = isinstance(shape, TreeShape) and shape.lookup and (shape.lookup, shape.grafts, name in stored)
                if key and key not in chains:
                    chains[key] = lookup_acceptance(
                        ids, pl, args.block_size, tree=TreeShape(k, lookup=key[0], grafts=key[1]),
                        datastore=store if key[2] else None, main=choices[:, :, 0])
            main_chain = tree_acceptance(named["drafter"], choices, ids, pl).tolist()
            for name, shape in named.items():
                if shape == "ngram":
                    acc = with_lookup(main_chain, lookup)
                else:
                    drafted = tree_acceptance(shape, choices, ids, pl).tolist()
                    looked = chains[(shape.lookup, shape.grafts, name in stored)] if shape.lookup else None
                    acc = with_lookup(drafted, looked, keep_longer=True) if looked else drafted
                taus[name] += walk(acc, pl, len(ids))
        result["datasets"][ds] = {
            name: {"tau": round(sum(t) / len(t), 4), "steps": len(t),
                   "verify_tokens": args.block_size if shape == "ngram" else shape.size,
                   **({} if shape == "ngram" else {"alternates": [list(a) for a in shape.alternates],
                                                   "alternate_len": shape.alternate_len, "lookup": shape.lookup,
                                                   "grafts": list(shape.grafts)})}
            for name, t in taus.items() if t for shape in [named[name]]}
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(Path(args.out), result)
        plot(result, Path(args.out).with_suffix(".png"))
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["datasets"]), figsize=(6 * len(result["datasets"]), 4.5), squeeze=False)
    for ax, (ds, rows) in zip(axes[0], result["datasets"].items()):
        for name, r in rows.items():
            default = "(TreeShape.for_block" in name  # the decoder's trees: with and without a datastore
            ax.scatter(r["verify_tokens"], r["tau"], s=160 if default else 18 if "nodes" in name else 30,
                       marker="*" if default else "o", color="black" if default else None, zorder=3 if default else 2)
            if "nodes" not in name:
                ax.annotate(name, (r["verify_tokens"], r["tau"]), fontsize=6, xytext=(3, -3),
                            textcoords="offset points")
        ax.set(title=f"{ds}: first {result['limit']} prompts, B = {result['block_size']}",
               xlabel="tokens per verify (tree nodes)", ylabel="τ (replayed)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"Tree verify shapes, drafter {result['drafter']}", fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)


if __name__ == "__main__":
    main()
