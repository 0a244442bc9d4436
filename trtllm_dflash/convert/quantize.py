"""``quantize``: a converted checkpoint (``convert``'s OUT) -> the same layout with an FP8 or NVFP4 target.

Calibration: nvidia-modelopt's ``mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop)`` on our PyTorch target (CPU
is fine, environment.md §3.6) records each linear's input absolute max ("max" calibration); weight maxima are read off
the weights. Quantization of the weights is this package's own code (``quant.py``), checked bit-exactly against
modelopt's NVFP4 packing. The TRT-LLM tensors per quantized linear ``<p>`` (qkv, dense, fc, gate, proj; embedding,
norms and lm_head stay in the checkpoint dtype, ``exclude_modules: ["lm_head"]``), as modelopt 0.47.0's
``export_tensorrt_llm_checkpoint`` writes them (tests/data/trtllm_1_2_1/quantized_checkpoint.json):

  FP8    <p>.weight float8_e4m3fn [out, in];  <p>.weights_scaling_factor fp32 [1] = amax_w / 448;
         <p>.activation_scaling_factor fp32 [1] = amax_in / 448
  NVFP4  <p>.weight uint8 [out, in/2];  <p>.weights_scaling_factor float8_e4m3fn [out, in/16];
         <p>.weights_scaling_factor_2 fp32 [] = amax_w / (6 * 448);  <p>.activation_scaling_factor fp32 [] =
         amax_in / (6 * 448)

Scales are per full (unsharded) tensor and identical on every rank. Fused QKV takes the max over q, k, v; ``mlp.fc``
and ``mlp.gate`` share one weight and one activation scale (TRT-LLM fuses them at build time), as modelopt does.
NVFP4 blocks never straddle ranks: each rank's input width must be a multiple of 16.

FP8 KV cache (``kv_cache="fp8"``, config ``kv_cache_quant_algo: FP8``): per layer
``attention.{k,v,kv}_cache_scaling_factor`` fp32 [1] = 1.0, which is what modelopt 0.47.0 writes with ``FP8_KV_CFG``
(K/V are cast to e4m3 unscaled). Calibration measures the cached K (after k_norm and RoPE) and V per layer; their
maxima go to the manifest, and a layer whose |K| or |V| exceeds 448 (where the cast saturates) is logged as a WARNING.

The drafter is copied unquantized (quantizing DFlashDrafterForTRTLLM is not done yet).
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from trtllm_dflash import staging
from trtllm_dflash.convert import configs, quant
from trtllm_dflash.convert import manifest as mf
from trtllm_dflash.convert import weight_map as wm
from trtllm_dflash.convert.loader import load_trtllm_target_state, read_config
from trtllm_dflash.errors import ArtifactError, ConfigError, require
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.models.weights import load_into, write_json, write_state_dict

log = logging.getLogger(__name__)

QUANTIZED_LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")


class KvCacheQuant(enum.Enum):
    FP8 = "fp8"


class QuantRecipe(enum.Enum):
    FP8 = "fp8"
    NVFP4 = "nvfp4"

    @property
    def quant_algo(self) -> str:  # TRT-LLM QuantAlgo name
        return self.name


@dataclass(frozen=True, slots=True)
class QuantizeConfig:
    src_dir: Path  # a `convert` output (manifest.json, target/, drafter/)
    out_dir: Path
    recipe: QuantRecipe
    kv_cache: KvCacheQuant | None = None
    force: bool = False


def _linear_of(dst: str) -> str | None:
    """'transformer.layers.3.mlp.fc.weight' -> 'transformer.layers.3.mlp.fc' if it is a quantized linear."""
    prefix = dst.removesuffix(".weight")
    return prefix if dst.endswith(".weight") and prefix.endswith(QUANTIZED_LINEARS) else None


def _scale_group(linear: str) -> str:
    """mlp.fc and mlp.gate of one layer share scales; every other linear is its own group."""
    if linear.endswith((".fc", ".gate")):
        return linear.removesuffix(".fc").removesuffix(".gate") + ".fc|gate"
    return linear


def calibrate(model: TargetModel, calib: list[torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Over the calibration sequences (each [S_i]): (HF linear module name -> fp32 [] absolute max of its input,
    per decoder layer the absolute max of the cached K and V)."""
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as exc:
        raise ConfigError("recipe", "fp8/nvfp4", f"calibration needs nvidia-modelopt ({exc})",
                          "pip install nvidia-modelopt==0.47.0 requests") from exc

    kv_amax = [0.0] * model.spec.num_hidden_layers

    def forward_loop(m):
        for ids in calib:  # one sequence per forward: lengths differ
            cache = m.new_cache(1, ids.shape[0])
            write = cache.write

            def recording_write(layer, rows, positions, k, v, write=write):
                kv_amax[layer] = max(kv_amax[layer], float(k.abs().max()), float(v.abs().max()))
                write(layer, rows, positions, k, v)

            cache.write = recording_write
            m(ids[None], cache)

    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop)
    amax = {}
    for name, module in model.named_modules():
        q = getattr(module, "input_quantizer", None)
        if q is not None and getattr(q, "amax", None) is not None:
            amax[name] = q.amax.detach().float().reshape(())
    return amax, kv_amax


def calibration_ids(dataset: str, tokenizer_dir: Path, num_seqs: int, seq_len: int) -> list[torch.Tensor]:
    """Token ids [S_i <= seq_len] of the first ``num_seqs`` prompts of ``dataset`` (datasets.load_prompts: humaneval,
    mtbench or a JSONL file), tokenized as plain text by the target's tokenizer."""
    from transformers import AutoTokenizer

    from trtllm_dflash.datasets import load_prompts

    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as exc:
        raise ArtifactError(tokenizer_dir, f"no usable tokenizer ({exc})", "pass --tokenizer DIR") from exc
    out = [torch.tensor(tok(p.text)["input_ids"][:seq_len], dtype=torch.long) for p in load_prompts(dataset, num_seqs)]
    return [ids for ids in out if ids.numel() > 0]


def _normalize_calib(calib_ids) -> list[torch.Tensor]:
    """[num_seqs, seq_len] tensor or list of 1-D tensors -> list of int64 [S_i]."""
    shown = tuple(calib_ids.shape) if isinstance(calib_ids, torch.Tensor) else type(calib_ids).__name__
    if isinstance(calib_ids, torch.Tensor) and calib_ids.dim() == 2:
        calib_ids = list(calib_ids)
    ok = isinstance(calib_ids, (list, tuple)) and len(calib_ids) > 0 and all(
        isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() > 0 and not t.is_floating_point() for t in calib_ids)
    require(ok, "calib_ids", shown, "must be an integer tensor [num_seqs, seq_len] or a list of 1-D integer tensors")
    return [t.long() for t in calib_ids]


def _scales(entries: list[wm.Entry], state, input_amax, recipe: QuantRecipe) -> dict[str, dict[str, torch.Tensor]]:
    """Quantized linear -> {"weights": global weight scale, "activation": activation scale} (shared per group)."""
    w_amax: dict[str, torch.Tensor] = {}
    a_amax: dict[str, torch.Tensor] = {}
    groups: dict[str, str] = {}
    for e in entries:
        linear = _linear_of(e.dst)
        if linear is None:
            continue
        g = groups[linear] = _scale_group(linear)
        wa = torch.stack([state[s].float().abs().amax() for s in e.src]).amax()
        aa = torch.stack([input_amax[s.removesuffix(".weight")] for s in e.src]).amax()
        w_amax[g] = torch.maximum(w_amax.get(g, wa), wa)
        a_amax[g] = torch.maximum(a_amax.get(g, aa), aa)
    out = {}
    for linear, g in groups.items():
        if recipe is QuantRecipe.FP8:
            out[linear] = {"weights": (w_amax[g] / quant.FP8_MAX).reshape(1),
                           "activation": (a_amax[g] / quant.FP8_MAX).reshape(1)}
        else:
            out[linear] = {"weights": quant.nvfp4_global_scale(w_amax[g]),
                           "activation": (a_amax[g] / (quant.E2M1_MAX * quant.FP8_MAX)).reshape(())}
    return out


def quantize_rank_tensors(entries, state, scales, recipe: QuantRecipe, tp: int, rank: int,
                          dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = {}
    for e in entries:
        piece = wm.shard(e, [state[s] for s in e.src], tp, rank)
        linear = _linear_of(e.dst)
        if linear is None:
            tensors[e.dst] = piece.to(dtype).contiguous()
            continue
        s = scales[linear]
        if recipe is QuantRecipe.FP8:
            tensors[e.dst] = quant.fp8_quantize(piece, s["weights"]).contiguous()
            tensors[f"{linear}.weights_scaling_factor"] = s["weights"].clone()
        else:
            packed, block = quant.nvfp4_quantize(piece, s["weights"])
            tensors[e.dst] = packed.contiguous()
            tensors[f"{linear}.weights_scaling_factor"] = block.contiguous()
            tensors[f"{linear}.weights_scaling_factor_2"] = s["weights"].clone()
        tensors[f"{linear}.activation_scaling_factor"] = s["activation"].clone()
    return tensors


def quantize(src_dir, out_dir, recipe: str | QuantRecipe, calib_ids, force: bool = False,
             kv_cache: str | KvCacheQuant | None = None) -> Path:
    """Quantize ``src_dir`` (a ``convert`` output) into ``out_dir``. ``calib_ids``: token ids, a tensor
    [num_seqs, seq_len] or a list of 1-D tensors. ``kv_cache``: None or "fp8"."""
    try:
        recipe = QuantRecipe(recipe)
    except ValueError:
        raise ConfigError("recipe", recipe, f"must be one of {[r.value for r in QuantRecipe]}",
                          "pass fp8 or nvfp4") from None
    try:
        kv = None if kv_cache is None else KvCacheQuant(kv_cache)
    except ValueError:
        raise ConfigError("kv_cache", kv_cache, "must be fp8 or absent",
                          "pass --kv-cache fp8 or leave it out") from None
    return run_quantize(QuantizeConfig(Path(src_dir), Path(out_dir), recipe, kv, force), calib_ids)


def run_quantize(cfg: QuantizeConfig, calib_ids) -> Path:
    recipe = cfg.recipe
    staging.refuse_existing(cfg.out_dir, cfg.force)
    src_manifest = cfg.src_dir / mf.MANIFEST
    if not src_manifest.is_file():
        raise ArtifactError(cfg.src_dir, "has no manifest.json", "pass a directory written by `trtllm-dflash convert`")
    tcfg = read_config(cfg.src_dir / "target")
    require((tcfg.get("quantization") or {}).get("quant_algo") is None, "target.quantization.quant_algo",
            tcfg["quantization"]["quant_algo"], "the source checkpoint is already quantized",
            "quantize the unquantized `convert` output")
    calib = _normalize_calib(calib_ids)

    state, spec = load_trtllm_target_state(cfg.src_dir / "target")
    bad = [int(t.max()) for t in calib if int(t.max()) >= spec.vocab_size or int(t.min()) < 0]
    require(not bad, "calib_ids", f"max id {max(bad) if bad else 0}", f"must be in [0, vocab_size={spec.vocab_size})",
            "tokenize the calibration text with the target's tokenizer")
    tp, dtype = configs.tp_size(tcfg, cfg.src_dir / "target" / "config.json"), configs.DTYPES[tcfg["dtype"]]
    entries = configs.target_entries(spec, tp, lm_head_from_embedding=False,
                                     use_parallel_embedding=bool(tcfg.get("use_parallel_embedding")))
    if recipe is QuantRecipe.NVFP4:
        for e in entries:
            if _linear_of(e.dst) is not None:
                width = wm.rank_shape(e, tp)[1]
                require(width % quant.NVFP4_BLOCK == 0, "tp", tp, f"gives {e.dst} {width} input features per rank, "
                        f"not a multiple of the NVFP4 block ({quant.NVFP4_BLOCK})", "use a smaller --tp")

    t0 = time.perf_counter()
    model = TargetModel(spec, dtype=torch.float32)
    load_into(model, state, cfg.src_dir / "target", ignore=("lm_head.weight",) if spec.tie_word_embeddings else ())
    with torch.no_grad():
        input_amax, kv_amax = calibrate(model.eval(), calib)
    del model
    if cfg.kv_cache is not None:
        for layer, amax in enumerate(kv_amax):
            if amax > quant.FP8_MAX:
                log.warning("layer %d: cached K/V reach |x|=%.1f > 448; the unscaled FP8 KV cache saturates there",
                            layer, amax)
    scales = _scales(entries, state, input_amax, recipe)

    with staging.staged_output(cfg.out_dir, cfg.force) as tmp:
        (tmp / "target").mkdir()
        qcfg = dict(tcfg)
        qcfg["quantization"] = tcfg["quantization"] | {
            "quant_algo": recipe.quant_algo, "exclude_modules": ["lm_head"],
            "kv_cache_quant_algo": None if cfg.kv_cache is None else cfg.kv_cache.name}
        if recipe is QuantRecipe.NVFP4:
            qcfg["quantization"]["group_size"] = quant.NVFP4_BLOCK
        write_json(qcfg, tmp / "target" / "config.json")
        for rank in tqdm(range(tp), desc=f"{recipe.value} target ranks", unit="rank", disable=None):
            tensors = quantize_rank_tensors(entries, state, scales, recipe, tp, rank, dtype)
            if cfg.kv_cache is not None:
                for layer in range(spec.num_hidden_layers):
                    for kind in ("k", "v", "kv"):
                        tensors[f"transformer.layers.{layer}.attention.{kind}_cache_scaling_factor"] = torch.ones(1)
            write_state_dict(tensors, tmp / "target" / f"rank{rank}.safetensors")
        shutil.copytree(cfg.src_dir / "drafter", tmp / "drafter")
        source = json.loads(src_manifest.read_text())
        write_json({
            "format": mf.FORMAT,
            "trtllm_checkpoint_contract": mf.TRTLLM_CONTRACT,
            "config": mf.jsonable(cfg) | {"src_dir": str(cfg.src_dir.resolve())},
            "calibration": {"algorithm": "max (modelopt FP8_DEFAULT_CFG input quantizers)",
                            "num_seqs": len(calib), "num_tokens": sum(t.numel() for t in calib),
                            "ids_sha256": hashlib.sha256(torch.cat(calib).numpy().tobytes()).hexdigest(),
                            "kv_amax_per_layer": kv_amax},
            "source_manifest_sha256": mf.sha256_file(src_manifest),
            "resolved": source.get("resolved"),
            "inputs": source.get("inputs"),
            "outputs": {what: mf.hash_tree(tmp / what) for what in ("target", "drafter")},
            "tools": mf.tool_versions(),
            "git": mf.git_state(),
            "created_unix_s": round(time.time()),
        }, tmp / mf.MANIFEST)
    log.info("quantized %s -> %s (%s, kv cache %s) in %.1f s", cfg.src_dir, cfg.out_dir, recipe.value,
             cfg.kv_cache, time.perf_counter() - t0)
    return cfg.out_dir
