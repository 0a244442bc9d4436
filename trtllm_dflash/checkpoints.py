"""Writing checkpoints this project creates itself: randomly initialised z-lab-format drafters (the untrained demo
drafter, test fixtures) and tiny random Hugging Face targets (tests), plus loading a checked target/drafter pair."""

from __future__ import annotations

from pathlib import Path

import torch

from trtllm_dflash.models.drafter import DrafterModel
from trtllm_dflash.models.target import SCRATCH_POSITIONS, TargetModel
from trtllm_dflash.models.weights import write_drafter, write_json, write_state_dict  # noqa: F401 (re-exported)
from trtllm_dflash.specs import DrafterSpec, TargetSpec, build_target_layer_ids, check_pair


def drafter_spec_for(
    target: TargetSpec,
    *,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: tuple[int, ...] | None = None,
    intermediate_size: int | None = None,
) -> DrafterSpec:
    """A drafter shaped for ``target``: same hidden size, heads and head_dim (z-lab's dense-target recipe)."""
    ids = target_layer_ids or build_target_layer_ids(target.num_hidden_layers, num_layers)
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "block_size": block_size,
        "num_target_layers": target.num_hidden_layers,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(ids)},
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope.theta,
    }
    spec = DrafterSpec.from_hf_config(cfg)
    check_pair(target, spec)
    return spec


def random_drafter_state(spec: DrafterSpec, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    """HF-style init: linear weights ~ N(0, std), norms = 1."""
    torch.manual_seed(seed)
    model = DrafterModel(spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def write_tiny_target(out_dir: str | Path, *, family: str = "llama", seed: int = 0, vocab_size: int = 256,
                      hidden_size: int = 64, num_layers: int = 6, num_heads: int = 4, num_kv_heads: int = 2,
                      max_position_embeddings: int = 512, tie_word_embeddings: bool = False) -> Path:
    """A tiny random Llama or Qwen3 saved by Hugging Face transformers itself (the reference implementation)."""
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_theta=10000.0))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, rope_theta=1000000.0))
    else:
        raise ValueError(family)
    # HF's default init (std 0.02) gives near-uniform logits; a larger spread makes greedy choices decisive.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def load_pair(target_dir: str | Path, drafter_dir: str | Path | None, dtype=torch.float32, device="cpu",
              draft_vocab: str | Path | None = "auto"):
    """Load a target and (optionally) its drafter after cross-checking their specs (specs.check_pair).

    ``draft_vocab`` (a full-vocabulary drafter only, ``models.draft_vocab``): "auto" drafts over the drafter
    directory's ``draft_vocab.json`` where it has one, "full" or None over the target's whole vocabulary, a path over
    that file's vocabulary. A drafter with a reduced vocabulary of its own (speculators) keeps its own."""
    if drafter_dir is not None:  # a mismatched pair or a bad draft vocabulary is refused before anything loads
        drafter_spec = DrafterSpec.load(drafter_dir)
        check_pair(TargetSpec.load(target_dir), drafter_spec)
        resolve_draft_vocab(draft_vocab, drafter_dir, drafter_spec)
    target = TargetModel.from_pretrained(target_dir, dtype=dtype, device=device)
    drafter = None
    if drafter_dir is not None:
        drafter = load_drafter(target_dir, drafter_dir, dtype, device, draft_vocab, lm_head=target.lm_head.weight)
    return target, drafter


def load_drafter(target_dir: str | Path, drafter_dir: str | Path, dtype=torch.float32, device="cpu",
                 draft_vocab: str | Path | None = "auto", lm_head: torch.Tensor | None = None) -> DrafterModel:
    """The drafter of a pair alone, checked against the target's spec as ``load_pair`` checks it: for the processes
    that never run the target (the Triton drafter and kv_inject step models), which then hold no copy of it.
    ``lm_head`` ([V, H], e.g. ``runtime.steps.TargetHead``'s) is needed only for a draft vocabulary derived from the
    target's head; without it ``draft_vocab`` must resolve to the drafter's own vocabulary ("full")."""
    from trtllm_dflash.errors import require

    target_spec = TargetSpec.load(target_dir)
    drafter_spec = DrafterSpec.load(drafter_dir)
    check_pair(target_spec, drafter_spec)
    path = resolve_draft_vocab(draft_vocab, drafter_dir, drafter_spec)
    require(path is None or lm_head is not None, "draft_vocab", str(path),
            "a draft vocabulary derived from the target's head needs that head (lm_head)", "pass lm_head")
    drafter = DrafterModel.from_pretrained(drafter_dir, dtype=dtype, device=device,
                                           max_positions=target_spec.max_position_embeddings + SCRATCH_POSITIONS)
    return _apply_draft_vocab(lm_head, target_spec.vocab_size, drafter, path)


def use_draft_vocab(target: TargetModel, drafter: DrafterModel, drafter_dir, choice: str | Path | None = "auto"):
    """Give a loaded full-vocabulary ``drafter`` the draft vocabulary ``choice`` names (``load_pair``'s
    ``draft_vocab``): a head of those rows of ``target``'s LM head (``models.draft_vocab.derived_head``)."""
    path = resolve_draft_vocab(choice, drafter_dir, drafter.spec)
    return _apply_draft_vocab(target.lm_head.weight, target.spec.vocab_size, drafter, path)


def _apply_draft_vocab(lm_head, vocab_size: int, drafter: DrafterModel, path: Path | None) -> DrafterModel:
    """``drafter`` drafting over the vocabulary file ``path`` (resolved: ``resolve_draft_vocab``) through those rows
    of ``lm_head``; None leaves it as it is."""
    from trtllm_dflash.errors import ConfigError
    from trtllm_dflash.models import draft_vocab as dv

    if path is not None and drafter.dspark is not None and drafter.dspark.markov_head is not None:
        raise ConfigError("--draft-vocab", str(path), "a DSpark drafter's Markov head biases the vocabulary it was "
                          "trained over; a head derived from the target's rows would not match it",
                          "pass --draft-vocab full (or remove the file from the drafter directory)")
    if path is not None:
        drafter.draft_head = dv.derived_head(lm_head, dv.read(path, vocab_size))
    return drafter


def resolve_draft_vocab(choice: str | Path | None, drafter_dir, drafter_spec: DrafterSpec | None) -> Path | None:
    """The draft vocabulary file ``load_pair``'s ``draft_vocab`` names, or None (the drafter's own vocabulary)."""
    from trtllm_dflash.errors import ArtifactError, ConfigError
    from trtllm_dflash.models.draft_vocab import DRAFT_VOCAB_FILE

    if choice in (None, "full", "") or drafter_dir is None:
        return None
    if choice == "auto":
        path = Path(drafter_dir) / DRAFT_VOCAB_FILE
        return path if path.is_file() and drafter_spec.draft_vocab_size is None else None
    if drafter_spec.draft_vocab_size is not None:
        raise ConfigError("--draft-vocab", str(choice), f"the drafter has a draft vocabulary of its own "
                          f"({drafter_spec.draft_vocab_size} tokens, its own head)", "drop --draft-vocab")
    if not Path(choice).is_file():
        raise ArtifactError(choice, "missing (--draft-vocab)", "pass a file from `trtllm-dflash draft-vocab`, auto "
                            "or full")
    return Path(choice)
