#!/usr/bin/env python3
"""The drafter formats checked end to end: parity with vLLM's speculators itself, and every refusal as a user meets it.

    python perf/drafter_formats.py parity   [--target DIR] [--cases dflash,dspark-rnn-anchor-v4096,...]
    python perf/drafter_formats.py refusals [--target DIR] [--drafter DIR] [--cases NAME,...]

``parity`` (needs the peer venv of ``build_scripts/peer_speculators.sh``) writes ``--drafter`` over its draft
vocabulary in speculators' layout (what ``trtllm-dflash export-drafter --to speculators`` writes) and compares what
speculators 0.9.0's own modules draft from it with what we draft. Then it builds small random drafters for the target
with speculators' own classes: one DFlash drafter with a reduced draft vocabulary, and DSpark drafters with every
Markov head type, with and without ``sample_from_anchor`` and a reduced vocabulary. For each it compares the blocks
that speculators' own modules draft with those our loader drafts from the same directory, then writes the drafter out
with our writer and compares what speculators drafts from that (``perf/_lib/speculators_parity.py``). One
JSON line per case and direction: the largest logit (and confidence) difference, the largest logit, whether the
drafted tokens are equal, and for DSpark whether the Markov head changes drafts at all.

``refusals`` writes speculators-format drafters for the target (the full-vocabulary drafter, the same with its draft
vocabulary as a head of its own, and a random DSpark drafter), breaks one of them in one way per case (a config field,
a tensor, a route that cannot carry it), runs the ``trtllm-dflash`` command a user would run on it in a subprocess,
and records the exit code and the error line verbatim. The unbroken drafters run the same commands as controls.

Both exit 1 when a check fails (tokens differ; a broken drafter is not refused with exit code 2 naming the expected
field; a control does not succeed), so the JSON is also a verdict. ``--jsonl FILE`` appends the lines to FILE too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
PROMPT = "def add(a, b):"
# DSpark peer drafters: (Markov head type, sample_from_anchor, draft vocabulary size; 0 = the full one)
DSPARK_CASES = [("vanilla", 1, 4096), ("gated", 1, 0), ("rnn", 1, 4096), ("rnn", 0, 4096), ("vanilla", 0, 0)]


# ----------------------------------------------------------------------------------------------------------------------
# Parity with speculators


def parity_cases() -> dict[str, list[str]]:
    """Case name -> the peer's ``make`` arguments after the output directory."""
    cases = {"shipped-drafter": ["shipped"], "dflash": ["dflash"]}
    for head, anchor, vocab in DSPARK_CASES:
        name = f"dspark-{head}-{'anchor' if anchor else 'noanchor'}-{'v%d' % vocab if vocab else 'full'}"
        cases[name] = ["dspark", "--head-type", head, "--anchor", str(anchor), "--draft-vocab", str(vocab)]
    return cases


def run_parity(args, work: Path, emit) -> bool:
    import torch
    from safetensors.torch import load_file
    from tqdm import tqdm

    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.models import speculators
    from _lib.speculators_parity import NO_PEER, PEER_PYTHON, dflash_parity, dspark_parity, run_peer

    if not PEER_PYTHON.exists():
        print(f"drafter_formats: {NO_PEER}", file=sys.stderr)
        return False
    ok, cases = True, parity_cases()
    for name in tqdm(args.case_list, desc="parity", unit="case", file=sys.stderr):
        kind, *make = cases[name]
        case = work / name
        directions = [("we wrote, speculators drafts", case / "back")]
        if kind == "shipped":  # --drafter over its draft vocabulary, as export-drafter --to speculators writes it
            kind = "dflash"
            target, drafter = load_pair(args.target, args.drafter, dtype=torch.float32, draft_vocab="auto")
        else:
            run_peer(kind, "make", case / "peer", "--target", args.target, *make)
            target, drafter = load_pair(args.target, case / "peer" / "drafter", dtype=torch.float32)
            directions.insert(0, ("speculators wrote, we draft", case / "peer"))
        compare = dflash_parity if kind == "dflash" else dspark_parity
        speculators.write_speculators_drafter(case / "ours", drafter, target.spec, args.target, dtype=torch.float32)
        run_peer(kind, "run", case / "ours", case / "back")
        for direction, io in directions:
            got = compare(target, drafter, load_file(str(io / "peer_io.safetensors")))
            ok &= got.tokens_equal and got.markov_changes_drafts is not False
            emit({"check": "parity", "case": name, "direction": direction,
                  "draft_vocab": (drafter.draft_head.draft_vocab_size if drafter.draft_head is not None
                                  else target.spec.vocab_size),
                  "block_size": drafter.spec.block_size, **got.as_dict()})
    return ok


# ----------------------------------------------------------------------------------------------------------------------
# Refusals


@dataclass(frozen=True)
class Case:
    """One command on one drafter: ``base`` (reduced | full | dspark) changed by ``edit(config, state, dir)``;
    ``field`` is what the error must name (None: the command must succeed); a tensor's table check names it after
    the checkpoint's path (``DIR:d2t``), so ``:d2t`` stands for it here."""

    name: str
    base: str
    change: str
    command: str = "generate"
    edit: Callable[[dict, dict, Path], None] | None = None
    field: str | None = None


def _set(**over):
    return lambda cfg, state, d: cfg.update(over)


def _layer(**over):
    return lambda cfg, state, d: cfg["transformer_layer_config"].update(over)


def _drop(*names):
    return lambda cfg, state, d: [state.pop(n) for n in names]


def _roll_t2d(cfg, state, d):
    import torch

    state["t2d"] = torch.roll(state["t2d"], 1)


def _shift_d2t(cfg, state, d):
    state["d2t"] = state["d2t"] + 10**6


def _embedding_tap(cfg, state, d):
    cfg["aux_hidden_state_layer_ids"] = [0, *cfg["aux_hidden_state_layer_ids"][1:]]


def _full_vocab_config(cfg, state, d):
    cfg["draft_vocab_size"] = cfg["transformer_layer_config"]["vocab_size"]


def _draft_vocab_file(cfg, state, d):
    import numpy as np

    from trtllm_dflash.models import draft_vocab

    draft_vocab.write(d / draft_vocab.DRAFT_VOCAB_FILE, np.arange(0, 8192), {})


CASES = [
    # controls: the unbroken drafters through every route that carries them
    Case("control-reduced-generate", "reduced", "none"),
    Case("control-full-generate", "full", "none"),
    Case("control-dspark-generate", "dspark", "none"),
    Case("control-reduced-make-repo-torch", "reduced", "none", "make-repo-torch"),
    Case("control-dspark-make-repo-torch", "dspark", "none", "make-repo-torch"),
    Case("control-full-convert", "full", "none", "convert"),
    Case("control-full-export-z-lab", "full", "none", "export-z-lab"),
    # speculators DFlash config fields
    Case("dspark-field-on-dflash", "reduced", "config: markov_rank = 256", edit=_set(markov_rank=256),
         field="drafter.markov_rank"),
    Case("dspark-architecture-on-dflash", "reduced", 'config: architectures = ["DSparkDraftModel"]',
         edit=_set(architectures=["DSparkDraftModel"]), field="drafter.architectures"),
    Case("dflash2", "reduced", 'config: speculators_model_type = "dflash2"',
         edit=_set(speculators_model_type="dflash2"), field="drafter.speculators_model_type"),
    Case("eagle3", "reduced", 'config: speculators_model_type = "eagle3"', edit=_set(speculators_model_type="eagle3"),
         field="drafter.speculators_model_type"),
    Case("medusa", "reduced", 'config: speculators_model_type = "medusa"', edit=_set(speculators_model_type="medusa"),
         field="drafter.speculators_model_type"),
    Case("dflash-sample-from-anchor", "reduced", "config: sample_from_anchor = true",
         edit=_set(sample_from_anchor=True), field="drafter.sample_from_anchor"),
    Case("no-mask-token", "reduced", "config: mask_token_id = null", edit=_set(mask_token_id=None),
         field="drafter.mask_token_id"),
    Case("embedding-tap", "reduced", "config: aux_hidden_state_layer_ids[0] = 0", edit=_embedding_tap,
         field="drafter.aux_hidden_state_layer_ids[0]"),
    Case("target-hidden-size", "reduced", "config: target_hidden_size = 2048", edit=_set(target_hidden_size=2048),
         field="drafter.target_hidden_size"),
    Case("attention-bias", "reduced", "config: transformer_layer_config.attention_bias = true",
         edit=_layer(attention_bias=True), field="drafter.transformer_layer_config.attention_bias"),
    Case("hidden-act", "reduced", 'config: transformer_layer_config.hidden_act = "gelu"',
         edit=_layer(hidden_act="gelu"), field="drafter.transformer_layer_config.hidden_act"),
    Case("layer-model-type", "reduced", 'config: transformer_layer_config.model_type = "gemma3"',
         edit=_layer(model_type="gemma3"), field="drafter.transformer_layer_config.model_type"),
    Case("draft-vocab-too-large", "reduced", "config: draft_vocab_size = 200000", edit=_set(draft_vocab_size=200000),
         field="drafter.draft_vocab_size"),
    Case("other-verifier-vocab", "reduced", "config: transformer_layer_config.vocab_size = 50000",
         edit=_layer(vocab_size=50000), field="drafter.transformer_layer_config.vocab_size"),
    Case("full-vocab-config-reduced-weights", "reduced", "config: draft_vocab_size = the verifier's vocab_size",
         edit=_full_vocab_config, field="drafter.draft_vocab_size"),
    # speculators DFlash tensors
    Case("no-vocab-maps", "reduced", "weights: d2t and t2d removed", edit=_drop("d2t", "t2d"), field="drafter.d2t"),
    Case("no-own-head", "reduced", "weights: lm_head.weight removed", edit=_drop("lm_head.weight"),
         field="drafter.lm_head.weight"),
    Case("t2d-disagrees", "reduced", "weights: t2d rolled by one", edit=_roll_t2d, field=":t2d"),
    Case("d2t-out-of-range", "reduced", "weights: d2t + 1e6", edit=_shift_d2t, field=":d2t"),
    # DSpark config fields
    Case("markov-head-type", "dspark", 'config: markov_head_type = "lstm"', edit=_set(markov_head_type="lstm"),
         field="drafter.markov_head_type"),
    Case("confidence-without-markov", "dspark", "config: markov_rank = 0 (confidence_head_with_markov true)",
         edit=_set(markov_rank=0), field="drafter.confidence_head_with_markov"),
    Case("negative-markov-rank", "dspark", "config: markov_rank = -1", edit=_set(markov_rank=-1),
         field="drafter.markov_rank"),
    Case("dspark-fields-as-dflash", "dspark", 'config: speculators_model_type = "dflash"',
         edit=_set(speculators_model_type="dflash"), field="drafter.markov_rank"),
    Case("dflash2-convolution", "dspark", "config: conv_kernel_size = 4", edit=_set(conv_kernel_size=4),
         field="drafter.conv_kernel_size"),
    Case("dflash2-selector", "dspark", "config: selector_rank = 8", edit=_set(selector_rank=8),
         field="drafter.selector_rank"),
    Case("sample-from-anchor-type", "dspark", 'config: sample_from_anchor = "yes"', edit=_set(sample_from_anchor="yes"),
         field="drafter.sample_from_anchor"),
    # routes that cannot carry a drafter
    Case("dspark-draft-vocab-file", "dspark", "a draft_vocab.json beside a Markov head", edit=_draft_vocab_file,
         field="--draft-vocab"),
    Case("convert-reduced", "reduced", "none", "convert", field="drafter.draft_vocab_size"),
    Case("convert-dspark", "dspark", "none", "convert", field="drafter.speculators_model_type"),
    Case("trtllm-pytorch-reduced", "reduced", "none", "make-repo-trtllm-pytorch", field="drafter.draft_vocab_size"),
    Case("trtllm-pytorch-speculators-dir", "full", "none", "make-repo-trtllm-pytorch", field="--drafter"),
    Case("trtllm-engine-dspark", "dspark", "none", "make-repo-trtllm-engine", field="drafter.speculators_model_type"),
    Case("z-lab-reduced", "reduced", "none", "export-z-lab", field="drafter.draft_vocab_size"),
    Case("z-lab-dspark", "dspark", "none", "export-z-lab", field="drafter.speculators_model_type"),
]


def command_line(case: Case, target: str, drafter: Path, out: Path) -> list[str]:
    """The ``trtllm-dflash`` arguments of ``case.command``; outputs go under ``out``."""
    pair = ["--target", target, "--drafter", str(drafter)]
    commands = {
        "generate": ["generate", *pair, "--prompt", PROMPT, "--max-new-tokens", "4"],
        "convert": ["convert", *pair, "--out", str(out / "ckpt")],
        "export-z-lab": ["export-drafter", *pair, "--to", "z-lab", "--out", str(out / "z-lab")],
        "make-repo-torch": ["make-repo", *pair, "--backend", "torch", "--out", str(out / "repo")],
        "make-repo-trtllm-pytorch": ["make-repo", *pair, "--backend", "trtllm-pytorch", "--checkpoint", target,
                                     "--out", str(out / "repo")],
        "make-repo-trtllm-engine": ["make-repo", *pair, "--backend", "trtllm-engine", "--engines", str(out / "engines"),
                                    "--out", str(out / "repo")],
    }
    return commands[case.command]


def write_bases(target_dir: str, drafter_dir: str, work: Path) -> dict[str, Path]:
    """The three unbroken speculators-format drafters for the target, in float32."""
    import torch

    from trtllm_dflash.checkpoints import load_pair, use_draft_vocab
    from trtllm_dflash.models import speculators
    from _lib.speculators_parity import random_dspark_drafter

    def write(name: str, model) -> Path:
        return speculators.write_speculators_drafter(work / "bases" / name, model, target.spec, target_dir,
                                                     dtype=torch.float32)

    target, drafter = load_pair(target_dir, drafter_dir, dtype=torch.float32, draft_vocab="full")
    bases = {"full": write("full", drafter)}
    if use_draft_vocab(target, drafter, drafter_dir, "auto").draft_head is None:
        raise SystemExit(f"drafter_formats: {drafter_dir} has no draft_vocab.json: run `trtllm-dflash draft-vocab`")
    bases["reduced"] = write("reduced", drafter)
    bases["dspark"] = write("dspark", random_dspark_drafter(target.spec, dtype=torch.float32))
    return bases


def broken_copy(case: Case, base: Path, out: Path) -> Path:
    """``base`` with ``case.edit`` applied, in ``out/drafter`` (the base itself when there is no edit)."""
    if case.edit is None:
        return base
    from safetensors.torch import load_file, save_file

    drafter = out / "drafter"
    drafter.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((base / "config.json").read_text())
    state = load_file(str(base / "model.safetensors"))
    case.edit(cfg, state, drafter)
    (drafter / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(drafter / "model.safetensors"))
    return drafter


def verdict(case: Case, rc: int, message: str) -> bool:
    if case.field is None:
        return rc == 0
    return rc == 2 and f"{case.field}=" in message


def run_refusals(args, work: Path, emit) -> bool:
    from tqdm import tqdm

    bases = write_bases(args.target, args.drafter, work)
    exe = [sys.executable, "-m", "trtllm_dflash"]
    ok = True
    by_name = {c.name: c for c in CASES}
    for case in tqdm([by_name[n] for n in args.case_list], desc="refusals", unit="case", file=sys.stderr):
        out = work / case.name
        shutil.rmtree(out, ignore_errors=True)
        drafter = broken_copy(case, bases[case.base], out)
        argv = command_line(case, args.target, drafter, out)
        done = subprocess.run([*exe, *argv], cwd=REPO, capture_output=True, text=True, timeout=600)
        lines = [ln for ln in done.stderr.splitlines() if ln.startswith("trtllm-dflash ")]
        message = lines[-1] if lines else done.stderr.strip()[-2000:]
        passed = verdict(case, done.returncode, message)
        ok &= passed
        emit({"check": "refusal" if case.field else "control", "case": case.name, "drafter": case.base,
              "change": case.change, "command": "trtllm-dflash " + " ".join(_shown(argv, args.target, work)),
              "exit_code": done.returncode, "expected_field": case.field, "passed": passed,
              "message": _shown([message], args.target, work)[0] if case.field else None})
    return ok


def _shown(parts: list[str], target: str, work: Path) -> list[str]:
    """The command and message with this run's paths replaced by placeholders (TARGET, WORK)."""
    return [p.replace(str(work), "WORK").replace(target, "TARGET") for p in parts]


# ----------------------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("check", choices=("parity", "refusals"))
    p.add_argument("--target", default=None, help="target directory (default: the demo target)")
    p.add_argument("--drafter", default=None, help="a full-vocabulary drafter with a draft_vocab.json (default: the "
                                                   "demo drafter)")
    p.add_argument("--cases", default="all", help="comma list of case names (default all)")
    p.add_argument("--work", default=None, help="keep the drafters written here (default: a temporary directory)")
    p.add_argument("--jsonl", default=None, help="also append every JSON line to this file")
    args = p.parse_args(argv)
    known = list(parity_cases()) if args.check == "parity" else [c.name for c in CASES]
    args.case_list = known if args.cases == "all" else args.cases.split(",")
    unknown = [c for c in args.case_list if c not in known]
    if unknown:
        p.error(f"--cases {','.join(unknown)!r}: not a {args.check} case; choose from {', '.join(known)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from trtllm_dflash.assets import pair_or_demo

    args.target, args.drafter = pair_or_demo(args.target, args.drafter)
    sink = open(args.jsonl, "a") if args.jsonl else None

    def emit(doc: dict) -> None:
        line = json.dumps(doc)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()

    with tempfile.TemporaryDirectory(prefix="drafter-formats-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        ok = (run_parity if args.check == "parity" else run_refusals)(args, work, emit)
    if sink:
        sink.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
