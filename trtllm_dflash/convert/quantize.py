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

Calibration path (``CalibrationPath``, printed by the CLI and recorded in the manifest): on CUDA, modelopt's own
recipe config (``FP8_DEFAULT_CFG`` / ``NVFP4_DEFAULT_CFG``) calibrates on the GPU; on CPU, modelopt 0.47's NVFP4
quantizers cannot run a forward pass (environment.md §3.6), so every recipe is calibrated with ``FP8_DEFAULT_CFG``'s
"max" input quantizers, which record the same per-tensor input amax NVFP4's global activation scale is made of ("own
amax"). Either way the weights are quantized by ``quant.py`` (NVFP4 packing bit-exact with modelopt's
``NVFP4QTensor.quantize``).

The drafter is copied unchanged unless ``quantize_drafter``: then the same recipe quantizes its ``attention.dense``,
``mlp.fc``, ``mlp.gate`` and ``mlp.proj``, while the fused ``attention.qkv`` (it holds the K/V projections that KV
injection applies to the target's context features) and ``drafter.context_proj`` (the fc feeding them) stay in the
checkpoint dtype (``exclude_modules``). SGLang does the same with the K/V projections: its ``DFlashAttention`` builds
``qkv_proj`` with ``quant_config=None`` so that ``kv_proj_only`` can slice the raw K/V rows
(sgl-project/sglang ``python/sglang/srt/models/dflash.py``); SGLang does quantize ``fc``, we keep it unquantized too
because its output is what every layer's K/V projection reads. The drafter's activation scales are calibrated on the
calibration sequences' target taps (one target pass, shared with the target's calibration): per sequence, drafts at
``DRAFTER_CALIB_CUTS`` cut points, each with the taps before the cut injected as context, as the runtime does.
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
from trtllm_dflash.convert.loader import load_trtllm_drafter_state, load_trtllm_target_state, read_config
from trtllm_dflash.errors import ArtifactError, ConfigError, require
from trtllm_dflash.models.drafter import DrafterModel
from trtllm_dflash.models.layers import plain_linears
from trtllm_dflash.models.target import SCRATCH_POSITIONS, TargetModel
from trtllm_dflash.models.weights import load_into, write_json, write_state_dict
from trtllm_dflash.specs import DrafterSpec, TargetSpec

log = logging.getLogger(__name__)

QUANTIZED_LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
DRAFTER_QUANTIZED_LINEARS = ("attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
DRAFTER_EXCLUDE_MODULES = ["drafter.context_proj", "drafter.layers.*.attention.qkv"]
DRAFTER_CALIB_CUTS = 4  # drafts per calibration sequence


class KvCacheQuant(enum.Enum):
    FP8 = "fp8"


class QuantRecipe(enum.Enum):
    FP8 = "fp8"
    NVFP4 = "nvfp4"

    @property
    def quant_algo(self) -> str:  # TRT-LLM QuantAlgo name
        return self.name


class CalibDevice(enum.Enum):
    AUTO = "auto"  # cuda when available
    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True, slots=True)
class QuantizeConfig:
    src_dir: Path  # a `convert` output (manifest.json, target/, drafter/)
    out_dir: Path
    recipe: QuantRecipe
    kv_cache: KvCacheQuant | None = None
    force: bool = False
    quantize_drafter: bool = False  # also quantize the drafter (K/V projections and context_proj excluded)
    calib_device: CalibDevice = CalibDevice.AUTO
    export_hf: Path | None = None  # also write the target as a modelopt unified HF checkpoint here (hf_export.py)


@dataclass(frozen=True, slots=True)
class CalibrationPath:
    device: str  # "cpu" | "cuda"
    modelopt_config: str  # the mtq config whose input quantizers recorded the activation amax
    description: str  # one line for the user

    @classmethod
    def choose(cls, recipe: QuantRecipe, requested: CalibDevice) -> "CalibrationPath":
        cuda = torch.cuda.is_available()
        require(requested is not CalibDevice.CUDA or cuda, "calib_device", "cuda", "no CUDA device is available",
                "pass --calib-device cpu (or auto)")
        device = "cuda" if cuda and requested is not CalibDevice.CPU else "cpu"
        if device == "cuda":
            name = f"{recipe.name}_DEFAULT_CFG"
            text = f"CUDA modelopt: mtq.quantize(model, mtq.{name}) calibrates the input amax on the GPU"
        else:
            name = "FP8_DEFAULT_CFG"
            text = "CPU: mtq.FP8_DEFAULT_CFG max calibration gives the per-tensor input amax"
            if recipe is QuantRecipe.NVFP4:
                text = ("CPU own-amax + modelopt packing: per-tensor input amax from mtq.FP8_DEFAULT_CFG max "
                        "calibration (modelopt 0.47's NVFP4 quantizers need CUDA for a forward pass), NVFP4 weights "
                        "packed by quant.py, bit-exact with modelopt's NVFP4QTensor.quantize")
        return cls(device, name, f"{recipe.value} calibration path: {text}")


def _linear_of(dst: str, linears: tuple[str, ...] = QUANTIZED_LINEARS) -> str | None:
    """'transformer.layers.3.mlp.fc.weight' -> 'transformer.layers.3.mlp.fc' if it is one of ``linears``."""
    prefix = dst.removesuffix(".weight")
    return prefix if dst.endswith(".weight") and prefix.endswith(linears) else None


def _scale_group(linear: str) -> str:
    """mlp.fc and mlp.gate of one layer share scales; every other linear is its own group."""
    if linear.endswith((".fc", ".gate")):
        return linear.removesuffix(".fc").removesuffix(".gate") + ".fc|gate"
    return linear


def _mtq():
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as exc:
        raise ConfigError("recipe", "fp8/nvfp4", f"calibration needs nvidia-modelopt ({exc})",
                          "pip install nvidia-modelopt==0.47.0 requests") from exc
    return mtq


def _input_amax(model) -> dict[str, torch.Tensor]:
    amax = {}
    for name, module in model.named_modules():
        q = getattr(module, "input_quantizer", None)
        if q is not None and getattr(q, "amax", None) is not None:
            amax[name] = q.amax.detach().float().reshape(()).cpu()
    return amax


def calibrate(model: TargetModel, calib: list[torch.Tensor], modelopt_config: str = "FP8_DEFAULT_CFG",
              tap_layers: tuple[int, ...] = ()):
    """Over the calibration sequences (each [S_i], on the model's device): (HF linear module name -> fp32 [] absolute
    max of its input, per decoder layer the absolute max of the cached K and V, per sequence the taps [S_i, taps *
    hidden] of ``tap_layers`` (empty list without them)). Calibration mode does not quantize, so the taps are the
    unquantized model's."""
    mtq = _mtq()
    kv_amax = [0.0] * model.spec.num_hidden_layers
    taps: list[torch.Tensor] = []

    def forward_loop(m):
        taps.clear()
        for ids in calib:  # one sequence per forward: lengths differ
            cache = m.new_cache(1, ids.shape[0])
            write = cache.write

            def recording_write(layer, rows, positions, k, v, row_idx=None, write=write):
                kv_amax[layer] = max(kv_amax[layer], float(k.abs().max()), float(v.abs().max()))
                write(layer, rows, positions, k, v, row_idx)

            cache.write = recording_write
            _, tapped = m(ids[None], cache, tap_layers=tap_layers)
            if tap_layers:
                taps.append(tapped[0])

    mtq.quantize(plain_linears(model), getattr(mtq, modelopt_config), forward_loop)
    return _input_amax(model), kv_amax, taps


def calibrate_drafter(drafter: DrafterModel, embedding: torch.Tensor, calib: list[torch.Tensor],
                      taps: list[torch.Tensor], modelopt_config: str = "FP8_DEFAULT_CFG") -> dict[str, torch.Tensor]:
    """z-lab linear module name -> fp32 [] input amax, from drafts at ``DRAFTER_CALIB_CUTS`` cut points c of each
    sequence: context = taps[:c] injected, block = [ids[c], MASK × (B − 1)] (the runtime's step at start = c).
    ``embedding``: the target's [vocab, hidden] table."""
    mtq = _mtq()
    spec = drafter.spec

    def forward_loop(d):
        for ids, t in zip(calib, taps):
            n = ids.shape[0]
            for c in sorted({max(1, n * (k + 1) // (DRAFTER_CALIB_CUTS + 1)) for k in range(DRAFTER_CALIB_CUTS)}):
                if c >= n:
                    continue
                cache = d.new_cache(1, c + spec.block_size)
                d.inject(t[None, :c], torch.tensor([c], device=t.device), cache)
                block = torch.full((1, spec.block_size), spec.mask_token_id, device=ids.device)
                block[0, 0] = ids[c]
                d.draft(torch.nn.functional.embedding(block, embedding), cache)

    mtq.quantize(plain_linears(drafter), getattr(mtq, modelopt_config), forward_loop)
    return _input_amax(drafter)


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


def _group_amax(entries: list[wm.Entry], state, input_amax, linears: tuple[str, ...] = QUANTIZED_LINEARS):
    """Quantized linear -> (weight amax, input amax), fp32 [], each the maximum over the linear's scale group (fused
    q/k/v; mlp.fc with mlp.gate)."""
    w_amax: dict[str, torch.Tensor] = {}
    a_amax: dict[str, torch.Tensor] = {}
    groups: dict[str, str] = {}
    for e in entries:
        linear = _linear_of(e.dst, linears)
        if linear is None:
            continue
        g = groups[linear] = _scale_group(linear)
        wa = torch.stack([state[s].float().abs().amax() for s in e.src]).amax()
        aa = torch.stack([input_amax[s.removesuffix(".weight")] for s in e.src]).amax()
        w_amax[g] = torch.maximum(w_amax.get(g, wa), wa)
        a_amax[g] = torch.maximum(a_amax.get(g, aa), aa)
    return {linear: (w_amax[g], a_amax[g]) for linear, g in groups.items()}


def _scales(entries: list[wm.Entry], state, input_amax, recipe: QuantRecipe,
            linears: tuple[str, ...] = QUANTIZED_LINEARS) -> dict[str, dict[str, torch.Tensor]]:
    """Quantized linear -> {"weights": global weight scale, "activation": activation scale} (shared per group)."""
    out = {}
    for linear, (w, a) in _group_amax(entries, state, input_amax, linears).items():
        if recipe is QuantRecipe.FP8:
            out[linear] = {"weights": (w / quant.FP8_MAX).reshape(1), "activation": (a / quant.FP8_MAX).reshape(1)}
        else:
            out[linear] = {"weights": quant.nvfp4_global_scale(w),
                           "activation": (a / (quant.E2M1_MAX * quant.FP8_MAX)).reshape(())}
    return out


def _module_amax(entries: list[wm.Entry], state, input_amax) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF linear module name -> (weight amax, input amax) of its scale group, for the unified HF export."""
    group = _group_amax(entries, state, input_amax)
    return {src.removesuffix(".weight"): group[e.dst.removesuffix(".weight")]
            for e in entries if _linear_of(e.dst) is not None for src in e.src}


def quantize_rank_tensors(entries, state, scales, recipe: QuantRecipe, tp: int, rank: int,
                          dtype: torch.dtype, linears: tuple[str, ...] = QUANTIZED_LINEARS) -> dict[str, torch.Tensor]:
    tensors, seen = {}, set()
    for e in entries:
        piece = wm.shard(e, [state[s] for s in e.src], tp, rank)
        linear = _linear_of(e.dst, linears)
        if linear is None:
            piece = piece.to(dtype).contiguous()
            if piece.data_ptr() in seen:  # tied tensors: safetensors wants separate storage
                piece = piece.clone()
            seen.add(piece.data_ptr())
            tensors[e.dst] = piece
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
             kv_cache: str | KvCacheQuant | None = None, quantize_drafter: bool = False,
             calib_device: str | CalibDevice = "auto", export_hf=None) -> Path:
    """Quantize ``src_dir`` (a ``convert`` output) into ``out_dir``. ``calib_ids``: token ids, a tensor
    [num_seqs, seq_len] or a list of 1-D tensors. ``kv_cache``: None or "fp8". ``quantize_drafter``: the drafter too
    (module docstring). ``calib_device``: auto | cpu | cuda. ``export_hf``: a directory for the unified HF checkpoint
    of the target (hf_export.py), or None."""
    return run_quantize(quantize_config(src_dir, out_dir, recipe, force, kv_cache, quantize_drafter, calib_device,
                                        export_hf), calib_ids)


def quantize_config(src_dir, out_dir, recipe, force=False, kv_cache=None, quantize_drafter=False,
                    calib_device="auto", export_hf=None) -> QuantizeConfig:
    """Validated ``QuantizeConfig`` from plain values (ConfigError naming the field otherwise)."""
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
    try:
        device = CalibDevice(calib_device)
    except ValueError:
        raise ConfigError("calib_device", calib_device, "must be auto, cpu or cuda", "pass --calib-device cpu") from None
    return QuantizeConfig(Path(src_dir), Path(out_dir), recipe, kv, force, bool(quantize_drafter), device,
                          None if export_hf is None else Path(export_hf))


def _check_nvfp4_widths(entries, tp: int, linears) -> None:
    for e in entries:
        if _linear_of(e.dst, linears) is not None:
            width = wm.rank_shape(e, tp)[1]
            require(width % quant.NVFP4_BLOCK == 0, "tp", tp, f"gives {e.dst} {width} input features per rank, "
                    f"not a multiple of the NVFP4 block ({quant.NVFP4_BLOCK})", "use a smaller --tp")


def _quant_block(base: dict, recipe: QuantRecipe, exclude: list[str], kv_cache: KvCacheQuant | None) -> dict:
    out = base | {"quant_algo": recipe.quant_algo, "exclude_modules": exclude,
                  "kv_cache_quant_algo": None if kv_cache is None else kv_cache.name}
    if recipe is QuantRecipe.NVFP4:
        out["group_size"] = quant.NVFP4_BLOCK
    return out


@dataclass(frozen=True)
class _Source:
    """A ``convert`` output checked for quantization, with what the later phases read from it: its manifest (path
    and contents), the target's TRT-LLM config, the calibration ids and path, and the Hugging Face target directory
    ``export_hf`` reads (None without it)."""

    manifest_path: Path
    manifest: dict
    tcfg: dict
    calib: list[torch.Tensor]
    path: CalibrationPath
    hf_dir: Path | None


def _check_source(cfg: QuantizeConfig, calib_ids) -> _Source:
    """Refuse what would fail or overwrite before any model is loaded: an existing output (unless ``force``), a
    source without a manifest or already quantized, and an ``export_hf`` whose HF target is gone."""
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
    path = CalibrationPath.choose(recipe, cfg.calib_device)
    source = json.loads(src_manifest.read_text())
    hf_dir = None
    if cfg.export_hf is not None:
        staging.refuse_existing(cfg.export_hf, cfg.force)
        hf_dir = Path((source.get("config") or {}).get("target_dir") or "")
        if not (hf_dir / "config.json").is_file():
            raise ArtifactError(src_manifest, f"records target_dir={str(hf_dir)!r}, which holds no config.json",
                                "--export-hf needs the Hugging Face target the checkpoint was converted from")
    log.info("%s", path.description)
    return _Source(src_manifest, source, tcfg, calib, path, hf_dir)


@dataclass(frozen=True)
class _Part:
    """One model of the checkpoint as quantization reads it: its weights (TRT-LLM names), spec, TRT-LLM config,
    tensor-parallel size and weight-map entries."""

    state: dict[str, torch.Tensor]
    spec: TargetSpec | DrafterSpec
    config: dict
    tp: int
    entries: list[wm.Entry]


@dataclass(frozen=True)
class _Target(_Part):
    """The target's ``_Part`` with its checkpoint dtype, which the unquantized tensors of its ranks and the HF export
    keep."""

    dtype: torch.dtype


def _load_target(cfg: QuantizeConfig, src: _Source) -> _Target:
    """The source's target, after checking the calibration ids are in its vocabulary and (NVFP4) that every rank's
    input widths fill whole NVFP4 blocks."""
    state, spec = load_trtllm_target_state(cfg.src_dir / "target")
    bad = [int(t.max()) for t in src.calib if int(t.max()) >= spec.vocab_size or int(t.min()) < 0]
    require(not bad, "calib_ids", f"max id {max(bad) if bad else 0}", f"must be in [0, vocab_size={spec.vocab_size})",
            "tokenize the calibration text with the target's tokenizer")
    tp, dtype = configs.tp_size(src.tcfg, cfg.src_dir / "target" / "config.json"), configs.DTYPES[src.tcfg["dtype"]]
    entries = configs.target_entries(spec, tp, lm_head_from_embedding=False,
                                     use_parallel_embedding=bool(src.tcfg.get("use_parallel_embedding")))
    if cfg.recipe is QuantRecipe.NVFP4:
        _check_nvfp4_widths(entries, tp, QUANTIZED_LINEARS)
    return _Target(state, spec, src.tcfg, tp, entries, dtype)


def _load_drafter(cfg: QuantizeConfig) -> _Part:
    """The source's drafter, for ``quantize_drafter``: refused if already quantized, and (NVFP4) checked like the
    target's widths."""
    dstate, dspec, dcfg = load_trtllm_drafter_state(cfg.src_dir / "drafter")
    require((dcfg.get("quantization") or {}).get("quant_algo") is None, "drafter.quantization.quant_algo",
            dcfg["quantization"]["quant_algo"], "the source drafter is already quantized",
            "quantize the unquantized `convert` output")
    dtp = configs.tp_size(dcfg, cfg.src_dir / "drafter" / "config.json")
    dentries = configs.drafter_entries(dspec)
    if cfg.recipe is QuantRecipe.NVFP4:
        _check_nvfp4_widths(dentries, dtp, DRAFTER_QUANTIZED_LINEARS)
    return _Part(dstate, dspec, dcfg, dtp, dentries)


@dataclass(frozen=True)
class _Calibration:
    """What calibration measured and the scales made of it: the target's per-linear input amax, the cached K/V amax
    per layer, and the quantization scales of the target and (with ``quantize_drafter``) the drafter."""

    input_amax: dict[str, torch.Tensor]
    kv_amax: list[float]
    scales: dict
    drafter_scales: dict | None


def _calibrate(cfg: QuantizeConfig, src: _Source, target: _Target, drafter: _Part | None) -> _Calibration:
    """Run the calibration sequences through the target (recording the drafter's taps when it is quantized too),
    then the drafter on those taps, one model in memory at a time; warn of layers whose K/V saturate an unscaled FP8
    KV cache; compute the scales."""
    device = torch.device(src.path.device)
    spec = target.spec
    model = TargetModel(spec, dtype=torch.float32, device=device)
    load_into(model, target.state, cfg.src_dir / "target",
              ignore=("lm_head.weight",) if spec.tie_word_embeddings else ())
    on_device = [t.to(device) for t in src.calib]
    taps_from = drafter.spec.target_layer_ids if cfg.quantize_drafter else ()
    with torch.no_grad():
        input_amax, kv_amax, taps = calibrate(model.eval(), on_device, src.path.modelopt_config, taps_from)
    del model
    dscales = None
    if cfg.quantize_drafter:
        dmodel = DrafterModel(drafter.spec, dtype=torch.float32, device=device,
                              max_positions=spec.max_position_embeddings + SCRATCH_POSITIONS)
        load_into(dmodel, drafter.state, cfg.src_dir / "drafter")
        with torch.no_grad():
            d_amax = calibrate_drafter(dmodel.eval(), target.state["model.embed_tokens.weight"].float().to(device),
                                       on_device, taps, src.path.modelopt_config)
        del dmodel, taps
        dscales = _scales(drafter.entries, drafter.state, d_amax, cfg.recipe, DRAFTER_QUANTIZED_LINEARS)
    if cfg.kv_cache is not None:
        for layer, amax in enumerate(kv_amax):
            if amax > quant.FP8_MAX:
                log.warning("layer %d: cached K/V reach |x|=%.1f > 448; the unscaled FP8 KV cache saturates there",
                            layer, amax)
    scales = _scales(target.entries, target.state, input_amax, cfg.recipe)
    return _Calibration(input_amax, kv_amax, scales, dscales)


def _write_target(tmp: Path, cfg: QuantizeConfig, target: _Target, cal: _Calibration) -> None:
    """``tmp/target``: the config with its quantization block, and each rank's quantized tensors (with the FP8 KV
    cache's unit scales when ``kv_cache`` is set)."""
    recipe, tcfg = cfg.recipe, target.config
    (tmp / "target").mkdir()
    qcfg = dict(tcfg)
    qcfg["quantization"] = _quant_block(tcfg["quantization"], recipe, ["lm_head"], cfg.kv_cache)
    write_json(qcfg, tmp / "target" / "config.json")
    for rank in tqdm(range(target.tp), desc=f"{recipe.value} target ranks", unit="rank", disable=None):
        tensors = quantize_rank_tensors(target.entries, target.state, cal.scales, recipe, target.tp, rank,
                                        target.dtype)
        if cfg.kv_cache is not None:
            for layer in range(target.spec.num_hidden_layers):
                for kind in ("k", "v", "kv"):
                    tensors[f"transformer.layers.{layer}.attention.{kind}_cache_scaling_factor"] = torch.ones(1)
        write_state_dict(tensors, tmp / "target" / f"rank{rank}.safetensors")


def _write_drafter(tmp: Path, cfg: QuantizeConfig, drafter: _Part | None, cal: _Calibration) -> None:
    """``tmp/drafter``: quantized like the target (its excluded modules kept) with ``quantize_drafter``, else the
    source's drafter copied unchanged."""
    if not cfg.quantize_drafter:
        shutil.copytree(cfg.src_dir / "drafter", tmp / "drafter")
        return
    dcfg = drafter.config
    (tmp / "drafter").mkdir()
    qdcfg = dict(dcfg)
    qdcfg["quantization"] = _quant_block(dcfg["quantization"], cfg.recipe, list(DRAFTER_EXCLUDE_MODULES), None)
    write_json(qdcfg, tmp / "drafter" / "config.json")
    ddtype = configs.DTYPES[dcfg["dtype"]]
    for rank in range(drafter.tp):
        write_state_dict(quantize_rank_tensors(drafter.entries, drafter.state, cal.drafter_scales, cfg.recipe,
                                               drafter.tp, rank, ddtype, DRAFTER_QUANTIZED_LINEARS),
                         tmp / "drafter" / f"rank{rank}.safetensors")


def _manifest(tmp: Path, cfg: QuantizeConfig, src: _Source, cal: _Calibration) -> dict:
    """The output's manifest: the config, how it was calibrated (on which ids), the source manifest it derives from
    and the hashes of what ``tmp`` holds."""
    path, calib = src.path, src.calib
    return {
        "format": mf.FORMAT,
        "trtllm_checkpoint_contract": mf.TRTLLM_CONTRACT,
        "config": mf.jsonable(cfg) | {"src_dir": str(cfg.src_dir.resolve())},
        "calibration": {"algorithm": f"max (modelopt {path.modelopt_config} input quantizers)",
                        "device": path.device, "path": path.description,
                        "num_seqs": len(calib), "num_tokens": sum(t.numel() for t in calib),
                        "ids_sha256": hashlib.sha256(torch.cat(calib).numpy().tobytes()).hexdigest(),
                        "kv_amax_per_layer": cal.kv_amax},
        "source_manifest_sha256": mf.sha256_file(src.manifest_path),
        "resolved": src.manifest.get("resolved"),
        "inputs": src.manifest.get("inputs"),
        "outputs": {what: mf.hash_tree(tmp / what) for what in ("target", "drafter")},
        "tools": mf.tool_versions(),
        "git": mf.git_state(),
        "created_unix_s": round(time.time()),
    }


def _export_hf(cfg: QuantizeConfig, src: _Source, target: _Target, cal: _Calibration) -> None:
    """The target as a modelopt unified HF checkpoint in ``cfg.export_hf`` (hf_export.py), pointing back at the
    TRT-LLM checkpoint just written."""
    from trtllm_dflash.convert.hf_export import export_hf

    export_hf(src.hf_dir, target.state, _module_amax(target.entries, target.state, cal.input_amax), cfg.recipe.name,
              cfg.kv_cache is not None, target.dtype, cfg.export_hf, cfg.force,
              {"calibration": src.path.description, "trtllm_checkpoint": str(cfg.out_dir.resolve()),
               "trtllm_checkpoint_manifest_sha256": mf.sha256_file(cfg.out_dir / mf.MANIFEST)})


def run_quantize(cfg: QuantizeConfig, calib_ids) -> Path:
    """Quantize ``cfg.src_dir`` into ``cfg.out_dir`` (see ``quantize``): check the source, load the models, calibrate,
    write the output in a staging directory that replaces ``out_dir`` only when complete, then export the HF target."""
    src = _check_source(cfg, calib_ids)
    target = _load_target(cfg, src)
    drafter = _load_drafter(cfg) if cfg.quantize_drafter else None
    t0 = time.perf_counter()
    cal = _calibrate(cfg, src, target, drafter)
    with staging.staged_output(cfg.out_dir, cfg.force) as tmp:
        _write_target(tmp, cfg, target, cal)
        _write_drafter(tmp, cfg, drafter, cal)
        write_json(_manifest(tmp, cfg, src, cal), tmp / mf.MANIFEST)
    if cfg.export_hf is not None:
        _export_hf(cfg, src, target, cal)
    log.info("quantized %s -> %s (%s, kv cache %s, drafter %s) in %.1f s", cfg.src_dir, cfg.out_dir, cfg.recipe.value,
             cfg.kv_cache, cfg.recipe.value if cfg.quantize_drafter else "copied", time.perf_counter() - t0)
    return cfg.out_dir
