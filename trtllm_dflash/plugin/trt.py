"""TensorRT registration of the drafting kernels as ahead-of-time "quickly deployable plugins" in namespace ``dflash``.

Why ``tensorrt.plugin`` (``@trtp.register`` + ``@trtp.aot_impl``) and not TRT-LLM's plugin generator
(trtllm_triton.md §3.4):
- ``aot_impl`` embeds the compiled kernel (PTX) **in the engine**. The engine then runs from C++ — the Triton
  ``tensorrtllm`` backend, ``trtexec`` — with no Python and no plugin library to ``LD_PRELOAD``. §3.4 notes that
  Triton loads custom plugin libraries only through ``LD_PRELOAD`` with register-on-load, and that TRT-LLM's Python
  plugins (``PluginBase``) need a Python process at runtime, which the C++ backend does not have.
- TRT-LLM's PluginGen (``plugin_gen.py``) and the manual out-of-tree route compile the same Triton kernels into a
  ``.so`` of C++ creators that must be built against matching TensorRT/TRT-LLM headers per container version and then
  preloaded into ``tritonserver``; the manual route's known gotchas (a ``link.py`` dispatcher that can silently skip a
  launch) are exactly what we would have to debug on a GPU we do not have.
- Cost of this choice: attributes are **not** serialized with an AOT implementation, so everything per model (eps,
  softmax scale, causal flag, window, head counts) is baked into the PTX as Triton constexprs at build time; and
  no TRT-LLM example wires a QDP layer into a TRT-LLM ``Module`` graph, so using these ops inside a TRT-LLM engine
  (rather than a plain TensorRT network) is unverified.

Three ops, each mirroring a ``dispatch`` function:
``dflash::kv_rope``          kv [T, L·2·n_kv·hd], pos [T], k_norm [L, hd], cos/sin [P, hd]
                             -> k, v [L, T, n_kv, hd]: k_norm + RoPE of the fused GEMM output. TensorRT outputs
                             cannot alias an input, so the op writes dense K/V; the scatter into the cache slots
                             is the cache owner's job (TRT-LLM's KV manager, or ``kv_inject`` outside TensorRT).
``dflash::block_attention``  q [Tq, nh, hd], k_block/v_block [Tq, n_kv, hd], k_cache/v_cache [R, S, n_kv, hd],
                             cu_seqlens_q [n + 1], rows [n], ctx_lens [n] -> out [Tq, nh, hd]
``dflash::accept``           draft_ids [D], cu_num_drafts [n + 1], target_ids [D + n]
                             -> accepted_lengths [n], bonus_ids [n], emitted_ids [n, max_num_drafts + 1]

The shape and dtype contracts are plain functions (tested without TensorRT); ``compile_ptx`` builds each kernel for a
GPU architecture with Triton alone (tested on CPU); only ``register`` imports ``tensorrt``, lazily.

Launch ABI: TensorRT launches an AOT kernel with (input pointers, extra int args, output pointers), which is the
order of every kernel's parameters in ``triton_kernels``. Triton >= 3.3 appends two scratch pointers that TensorRT
does not pass; these kernels request no scratch memory (``compile_ptx`` asserts it), so the pointers are never read.
Not run against a real TensorRT here: no GPU and no ``tensorrt`` wheel in this environment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trtllm_dflash.errors import require

NAMESPACE = "dflash"
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
INDEX_DTYPES = ("int32", "int64")
_TRITON_PTR = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32", "int32": "*i32", "int64": "*i64"}


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# ---------------------------------------------------------------------------------------------------------------------
# Contracts: per-model constants, output shapes, dtype rules, launch grids


@dataclass(frozen=True, slots=True)
class KvRopeConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eps: float

    def validate(self) -> None:
        require(self.head_dim % 2 == 0, "head_dim", self.head_dim, "must be even (RoPE rotates pairs)")
        require(self.num_layers >= 1 and self.num_kv_heads >= 1, "num_layers/num_kv_heads",
                (self.num_layers, self.num_kv_heads), "must be >= 1")


@dataclass(frozen=True, slots=True)
class BlockAttentionConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_q_len: int  # tokens: the largest block any sequence sends (block_size)
    causal: bool = False
    window: int | None = None  # tokens; None = unlimited

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def validate(self) -> None:
        require(self.num_heads % self.num_kv_heads == 0, "num_heads", self.num_heads,
                f"must be a multiple of num_kv_heads ({self.num_kv_heads})")
        require(self.window is None or self.window >= 1, "window", self.window, "must be >= 1 or None")
        require(self.max_q_len >= 1, "max_q_len", self.max_q_len, "must be >= 1")


def kv_rope_output_shapes(kv: tuple[int, ...], cfg: KvRopeConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """kv [T, L·2·n_kv·hd] -> (k, v), each [L, T, n_kv, hd]."""
    cfg.validate()
    width = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    require(len(kv) == 2 and kv[1] == width, "kv.shape", kv, f"must be [num_tokens, {width}] (L·2·n_kv·hd)")
    out = (cfg.num_layers, kv[0], cfg.num_kv_heads, cfg.head_dim)
    return out, out


def kv_rope_output_dtypes(kv: str, pos: str, k_norm: str, cos: str) -> tuple[str, str]:
    """K/V come out in the GEMM output's float dtype; positions are an index type; the tables may differ in dtype."""
    require(kv in FLOAT_DTYPES, "kv.dtype", kv, f"must be one of {FLOAT_DTYPES}")
    require(pos in INDEX_DTYPES, "pos.dtype", pos, f"must be one of {INDEX_DTYPES}")
    require(k_norm in FLOAT_DTYPES and cos in FLOAT_DTYPES, "k_norm/cos dtype", (k_norm, cos), "must be float")
    return kv, kv


def kv_rope_grid(num_tokens: int, cfg: KvRopeConfig) -> tuple[tuple[int, int, int], int]:
    """(grid, BLOCK_T): the same tiling ``triton_kernels.knorm_rope_store`` uses."""
    block_t = max(1, min(_pow2(num_tokens), 4096 // (_pow2(cfg.num_kv_heads) * _pow2(cfg.head_dim // 2)), 64))
    return (max(1, -(-num_tokens // block_t)), cfg.num_layers, 1), block_t


def block_attention_output_shape(q: tuple[int, ...], k_block: tuple[int, ...], k_cache: tuple[int, ...],
                                 cfg: BlockAttentionConfig) -> tuple[int, ...]:
    """q [Tq, nh, hd], k_block [Tq, n_kv, hd], k_cache [R, S, n_kv, hd] -> out [Tq, nh, hd]."""
    cfg.validate()
    require(tuple(q[1:]) == (cfg.num_heads, cfg.head_dim), "q.shape", q, f"must be [Tq, {cfg.num_heads}, "
            f"{cfg.head_dim}]")
    require(tuple(k_block) == (q[0], cfg.num_kv_heads, cfg.head_dim), "k_block.shape", k_block,
            f"must be [{q[0]}, {cfg.num_kv_heads}, {cfg.head_dim}]")
    require(len(k_cache) == 4 and tuple(k_cache[2:]) == (cfg.num_kv_heads, cfg.head_dim), "k_cache.shape", k_cache,
            f"must be [rows, max_len, {cfg.num_kv_heads}, {cfg.head_dim}]")
    return tuple(q)


def block_attention_output_dtype(q: str, k_block: str, k_cache: str, cu_seqlens_q: str) -> str:
    require(q in FLOAT_DTYPES, "q.dtype", q, f"must be one of {FLOAT_DTYPES}")
    require(k_block == q and k_cache == q, "k_block/k_cache dtype", (k_block, k_cache),
            f"must equal q's ({q}); cast the cache or use a matching KV dtype")
    require(cu_seqlens_q == "int32", "cu_seqlens_q.dtype", cu_seqlens_q, "must be int32")
    return q


def block_attention_tiles(cfg: BlockAttentionConfig, interpret: bool = False) -> dict[str, int]:
    """BLOCK_M/N/D: the same choice ``triton_kernels.block_attention`` makes."""
    group = cfg.num_heads // cfg.num_kv_heads
    return dict(BLOCK_M=max(16, min(128, _pow2(cfg.max_q_len * group))),
                BLOCK_N=16 if cfg.head_dim > 64 or interpret else 32, BLOCK_D=max(16, _pow2(cfg.head_dim)))


def block_attention_grid(num_seqs: int, cfg: BlockAttentionConfig) -> tuple[int, int, int]:
    group = cfg.num_heads // cfg.num_kv_heads
    block_m = block_attention_tiles(cfg)["BLOCK_M"]
    return num_seqs, cfg.num_kv_heads, -(-(cfg.max_q_len * group) // block_m)


def accept_output_shapes(draft_ids: tuple[int, ...], cu_num_drafts: tuple[int, ...], target_ids: tuple[int, ...],
                         max_num_drafts: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """-> accepted_lengths [n], bonus_ids [n], emitted_ids [n, max_num_drafts + 1]."""
    require(len(draft_ids) == 1 and len(cu_num_drafts) == 1, "draft_ids/cu_num_drafts rank",
            (draft_ids, cu_num_drafts), "must both be 1-D")
    n = cu_num_drafts[0] - 1
    require(n >= 0, "cu_num_drafts.shape", cu_num_drafts, "must be [num_seqs + 1]")
    require(tuple(target_ids) == (draft_ids[0] + n,), "target_ids.shape", target_ids,
            f"must be [total_drafts + num_seqs] = [{draft_ids[0] + n}]")
    require(max_num_drafts >= 0, "max_num_drafts", max_num_drafts, "must be >= 0")
    return (n,), (n,), (n, max_num_drafts + 1)


def accept_output_dtypes(draft_ids: str, cu_num_drafts: str, target_ids: str) -> tuple[str, str, str]:
    require(draft_ids == "int64" and target_ids == "int64", "draft_ids/target_ids dtype", (draft_ids, target_ids),
            "must be int64 token ids")
    require(cu_num_drafts == "int32", "cu_num_drafts.dtype", cu_num_drafts, "must be int32")
    return "int64", "int64", "int64"


# ---------------------------------------------------------------------------------------------------------------------
# Ahead-of-time compilation (Triton only; no TensorRT, no GPU needed)


@dataclass(frozen=True, slots=True)
class CompiledKernel:
    name: str  # PTX entry point
    ptx: str
    num_warps: int  # block_x = 32 · num_warps
    shared_mem: int  # bytes of dynamic shared memory


def _signature(fn, types: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in constexprs else types.get(name, "i32")
    return sig


def compile_ptx(op: str, cfg, dtype: str = "bfloat16", arch: int = 90) -> CompiledKernel:
    """Compile one op's kernel for ``sm_{arch}`` with the per-model constants of ``cfg`` baked in.

    ``op``: "kv_rope" (cfg: KvRopeConfig), "block_attention" (BlockAttentionConfig) or "accept" (cfg: max_num_drafts).
    Must run in a process without ``TRITON_INTERPRET=1`` (the interpreter replaces the JIT functions).
    """
    import triton
    from triton.backends.compiler import GPUTarget

    from trtllm_dflash.plugin import triton_kernels as K

    ptr = _TRITON_PTR[dtype]
    if op == "kv_rope":
        cfg.validate()
        fn = K._knorm_rope_store_kernel
        _, block_t = kv_rope_grid(64, cfg)
        consts = dict(EPS=float(cfg.eps), DENSE=True, NUM_KV=cfg.num_kv_heads, HEAD_DIM=cfg.head_dim,
                      HALF=cfg.head_dim // 2, BLOCK_T=block_t, BLOCK_KV=_pow2(cfg.num_kv_heads),
                      BLOCK_HALF=_pow2(cfg.head_dim // 2))
        types = dict(kv_ptr=ptr, row_ptr="*i64", pos_ptr="*i64", knorm_ptr=ptr, cos_ptr=ptr, sin_ptr=ptr,
                     kc_ptr=ptr, vc_ptr=ptr)
    elif op == "block_attention":
        cfg.validate()
        fn = K._block_attention_kernel
        consts = dict(SM_SCALE=cfg.sm_scale, GROUP=cfg.num_heads // cfg.num_kv_heads, HEAD_DIM=cfg.head_dim,
                      CAUSAL=bool(cfg.causal), USE_WINDOW=cfg.window is not None,
                      DOT_F32=dtype == "float32", **block_attention_tiles(cfg))
        types = dict(q_ptr=ptr, kb_ptr=ptr, vb_ptr=ptr, kc_ptr=ptr, vc_ptr=ptr, o_ptr=ptr, cu_q_ptr="*i32",
                     rows_ptr="*i64", ctx_ptr="*i64")
    elif op == "accept":
        fn = K._accept_kernel
        consts = dict(PLACEHOLDER=-1, BLOCK=max(16, _pow2(int(cfg) + 1)))
        types = dict(draft_ptr="*i64", cu_d_ptr="*i32", target_ptr="*i64", acc_ptr="*i64", bonus_ptr="*i64",
                     emitted_ptr="*i64")
    else:
        raise ValueError(f"unknown op {op!r}")
    src = triton.compiler.ASTSource(fn=fn, signature=_signature(fn, types, consts), constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    scratch = getattr(compiled.metadata, "global_scratch_size", 0) or 0
    require(scratch == 0, f"{op} global scratch", scratch, "must be 0: TensorRT does not pass Triton's scratch pointer")
    return CompiledKernel(compiled.metadata.name, compiled.asm["ptx"], compiled.metadata.num_warps,
                          compiled.metadata.shared)


# ---------------------------------------------------------------------------------------------------------------------
# TensorRT registration (needs the tensorrt wheel, >= 10.7 for tensorrt.plugin AOT)


def _dtype_name(trt, dt) -> str:
    names = {trt.float16: "float16", trt.bfloat16: "bfloat16", trt.float32: "float32", trt.int32: "int32",
             trt.int64: "int64"}
    return names[dt]


def register(kv: KvRopeConfig, attn: BlockAttentionConfig, max_num_drafts: int, arch: int = 90) -> list[str]:
    """Register ``dflash::kv_rope``, ``dflash::block_attention`` and ``dflash::accept`` for one drafter's constants.

    Returns the plugin ids. Call once per process before building a network that uses them (``trtp.op.dflash.*``).
    Dynamic dimensions (tokens, sequences) stay symbolic; per-model constants come from the configs, not from
    attributes, because attributes are not serialized with AOT implementations.
    """
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as e:
        raise ImportError(f"registering the {NAMESPACE}:: plugins needs TensorRT >= 10.7 with tensorrt.plugin "
                          "(inside NVIDIA's TensorRT / TRT-LLM containers)") from e
    kv.validate()
    attn.validate()
    _register_kv_rope(trt, trtp, kv, arch)
    _register_block_attention(trt, trtp, attn, arch)
    _register_accept(trt, trtp, max_num_drafts, arch)
    return [f"{NAMESPACE}::{name}" for name in ("kv_rope", "block_attention", "accept")]


def _sym_int_args(trtp, args: list) -> object:
    """The extra int arguments of an AOT launch, as the ``SymIntExprs`` TensorRT passes after the input pointers."""
    extra = trtp.SymIntExprs(len(args))
    for i, a in enumerate(args):
        extra[i] = trtp.SymInt32(a)
    return extra


def _register_kv_rope(trt, trtp, kv: KvRopeConfig, arch: int) -> None:
    """``dflash::kv_rope``: its shape/dtype description and its AOT implementation (the PTX of ``kv_rope`` for
    ``kv``'s constants, one program per block of tokens and layer)."""

    @trtp.register(f"{NAMESPACE}::kv_rope")
    def _kv_rope_desc(kv_in: trtp.TensorDesc, row: trtp.TensorDesc, pos: trtp.TensorDesc, k_norm: trtp.TensorDesc,
                      cos: trtp.TensorDesc, sin: trtp.TensorDesc) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
        kv_rope_output_dtypes(_dtype_name(trt, kv_in.dtype), _dtype_name(trt, pos.dtype),
                              _dtype_name(trt, k_norm.dtype), _dtype_name(trt, cos.dtype))
        shape = (kv.num_layers, kv_in.shape_expr[0], kv.num_kv_heads, kv.head_dim)  # [L, T, n_kv, hd]
        return trtp.from_shape_expr(shape, dtype=kv_in.dtype), trtp.from_shape_expr(shape, dtype=kv_in.dtype)

    @trtp.aot_impl(f"{NAMESPACE}::kv_rope")
    def _kv_rope_aot(kv_in, row, pos, k_norm, cos, sin, outputs, tactic):
        k = compile_ptx("kv_rope", kv, _dtype_name(trt, kv_in.dtype), arch)
        _, block_t = kv_rope_grid(64, kv)
        t = kv_in.shape_expr[0]
        launch = trtp.KernelLaunchParams(grid_x=(t + block_t - 1) // block_t, grid_y=kv.num_layers,
                                         block_x=32 * k.num_warps, shared_mem=k.shared_mem)
        per_tok = kv.num_kv_heads * kv.head_dim
        # int args after the input pointers: num_tokens, stride_kv_t, stride_rope_p, then the dense output's
        # strides (layer, row (unused when DENSE), token, head)
        args = [t, kv_in.shape_expr[1], cos.shape_expr[1], t * per_tok, 0, per_tok, kv.head_dim]
        return k.name, k.ptx, launch, _sym_int_args(trtp, args)


def _register_block_attention(trt, trtp, attn: BlockAttentionConfig, arch: int) -> None:
    """``dflash::block_attention``: its description (the output is shaped like q) and its AOT implementation (one
    program per sequence, KV head and query tile)."""

    @trtp.register(f"{NAMESPACE}::block_attention")
    def _attn_desc(q: trtp.TensorDesc, k_block: trtp.TensorDesc, v_block: trtp.TensorDesc,
                   k_cache: trtp.TensorDesc, v_cache: trtp.TensorDesc, cu_seqlens_q: trtp.TensorDesc,
                   rows: trtp.TensorDesc, ctx_lens: trtp.TensorDesc) -> trtp.TensorDesc:
        block_attention_output_dtype(_dtype_name(trt, q.dtype), _dtype_name(trt, k_block.dtype),
                                     _dtype_name(trt, k_cache.dtype), _dtype_name(trt, cu_seqlens_q.dtype))
        return q.like()

    @trtp.aot_impl(f"{NAMESPACE}::block_attention")
    def _attn_aot(q, k_block, v_block, k_cache, v_cache, cu_seqlens_q, rows, ctx_lens, outputs, tactic):
        k = compile_ptx("block_attention", attn, _dtype_name(trt, q.dtype), arch)
        _, _, grid_z = block_attention_grid(1, attn)
        launch = trtp.KernelLaunchParams(grid_x=cu_seqlens_q.shape_expr[0] - 1, grid_y=attn.num_kv_heads,
                                         grid_z=grid_z, block_x=32 * k.num_warps, shared_mem=k.shared_mem)
        hd, s = attn.head_dim, k_cache.shape_expr[1]
        # window, then contiguous strides of q, k_block, the cache (row, position, head) and out
        args = [attn.window or 0, attn.num_heads * hd, hd, attn.num_kv_heads * hd, hd,
                s * attn.num_kv_heads * hd, attn.num_kv_heads * hd, hd, attn.num_heads * hd, hd]
        return k.name, k.ptx, launch, _sym_int_args(trtp, args)


def _register_accept(trt, trtp, max_num_drafts: int, arch: int) -> None:
    """``dflash::accept``: its description (accepted lengths, bonus ids and emitted ids per sequence, int64) and its
    AOT implementation (one program per sequence)."""

    @trtp.register(f"{NAMESPACE}::accept")
    def _accept_desc(draft_ids: trtp.TensorDesc, cu_num_drafts: trtp.TensorDesc, target_ids: trtp.TensorDesc
                     ) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        accept_output_dtypes(_dtype_name(trt, draft_ids.dtype), _dtype_name(trt, cu_num_drafts.dtype),
                             _dtype_name(trt, target_ids.dtype))
        n = cu_num_drafts.shape_expr[0] - 1
        return (trtp.from_shape_expr((n,), dtype=trt.int64), trtp.from_shape_expr((n,), dtype=trt.int64),
                trtp.from_shape_expr((n, max_num_drafts + 1), dtype=trt.int64))

    @trtp.aot_impl(f"{NAMESPACE}::accept")
    def _accept_aot(draft_ids, cu_num_drafts, target_ids, outputs, tactic):
        k = compile_ptx("accept", max_num_drafts, "int64", arch)
        launch = trtp.KernelLaunchParams(grid_x=cu_num_drafts.shape_expr[0] - 1, block_x=32 * k.num_warps,
                                         shared_mem=k.shared_mem)
        return k.name, k.ptx, launch, _sym_int_args(trtp, [max_num_drafts + 1])  # the width of emitted_ids
