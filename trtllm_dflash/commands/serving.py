"""``make-repo``, ``serve`` and ``client``: render the Triton repository, run a real Triton server on it, talk to it."""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading


def add_make_repo_arguments(parser: argparse.ArgumentParser) -> None:
    from trtllm_dflash.commands.common import add_draft_vocab_argument, add_ngram_argument, block_size_arg
    from trtllm_dflash.serve.triton.render import BACKENDS, RepoConfig

    d = RepoConfig("", "")
    parser.add_argument("--target", default=None,
                        help="Hugging Face target directory (tokenizer, specs; torch and trtllm-engine need it; "
                             "trtllm-pytorch defaults to --checkpoint)")
    parser.add_argument("--drafter", required=True,
                        help="DFlash drafter directory: z-lab, speculators DFlash or DSpark (docs/drafters.md)")
    parser.add_argument("--backend", choices=BACKENDS, default="torch",
                        help="torch: step models in PyTorch; trtllm-engine: the TensorRT-LLM 1.2.1 engines of "
                             "--engines; trtllm-pytorch: TensorRT-LLM >= 1.3's own DFlash (LLM API) on --checkpoint")
    parser.add_argument("--engines", default="", help="trtllm-engine: output directory of `trtllm-dflash build`")
    parser.add_argument("--checkpoint", default="",
                        help="trtllm-pytorch: modelopt unified-HF checkpoint or the plain HF target directory")
    parser.add_argument("--out", required=True, help="directory to render the repository into")
    parser.add_argument("--block-size", type=block_size_arg, default=None,
                        help="draft block size, or 'auto' (the dflash loop picks per request and step how many "
                             "drafts pay off on the machine that renders the repository; the default with --backend "
                             "torch; the other backends' default: the drafter's block size)")
    parser.add_argument("--max-block-size", type=int, default=None,
                        help="with --block-size auto: the longest block (default: the drafter's block size)")
    add_ngram_argument(parser, ", a torch or trtllm-engine backend")
    parser.add_argument("--tree", action="store_true",
                        help="the dflash loop verifies a tree per step (torch backend): the drafter's block, its "
                             "runner-up tokens and prompt lookup's and the datastore's proposals in one target_verify "
                             "call, the longest accepted path kept, as `generate --tree` (greedy or sampled, "
                             "lossless). Pays where a wide verify costs about a narrow one (a GPU at small batch), not "
                             "on a CPU; with --block-size auto a step takes the tree only where the cost model says "
                             "it pays")
    parser.add_argument("--datastore", default="auto", metavar="FILE|auto|none",
                        help="with --tree: a retrieval datastore for the tree's lookup chains (`trtllm-dflash "
                             "datastore`); auto (default): the drafter directory's datastore.dflash if it has one")
    add_draft_vocab_argument(parser)
    parser.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help="requests per batched step")
    parser.add_argument("--instances", type=int, default=d.instances, help="instances of stateless/BLS models")
    parser.add_argument("--max-seq-len", type=int, default=d.max_seq_len, help="tokens per sequence (prompt + new)")
    parser.add_argument("--max-sequences", type=int, default=d.max_sequences, help="live sequences per step model")
    parser.add_argument("--queue-delay-us", type=int, default=d.queue_delay_us, help="dynamic batcher delay")
    parser.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s, help="free idle sequence state")
    parser.add_argument("--torch-threads", type=int, default=d.torch_threads,
                        help="threads per CPU step model (0 = auto: every core for one sequence, one thread each "
                        "once sequences overlap)")
    parser.add_argument("--no-coalesce", dest="coalesce", action="store_false",
                        help="send each sequence's step calls on their own instead of coalescing the live sequences' "
                             "calls of one kind into one batched step-model call (the default)")
    parser.add_argument("--max-queue", type=int, default=d.max_queue,
                        help="requests (per entry model) that may wait for a sequence slot once --max-sequences are "
                             "live; more are refused at once with UNAVAILABLE (RESOURCE_EXHAUSTED message)")
    parser.add_argument("--queue-timeout-s", type=float, default=d.queue_timeout_s,
                        help="longest wait for a sequence slot before the request is refused")
    parser.add_argument("--io-nice", type=int, default=d.io_nice,
                        help="CPU only: niceness of the server's own threads and of the models that only move "
                             "requests (loops, tokenizers), so the step models' forwards get the cores first "
                             "(0 = equal priority)")
    parser.add_argument("--tensorrt-llm-unary", dest="tensorrt_llm_decoupled", action="store_false",
                        help="render the tensorrt_llm model (TensorRT-LLM's token-level model) non-decoupled, as its "
                             "decoupled_mode false, for clients that call unary ModelInfer (its example client "
                             "without --streaming): one response per request, so no streaming, one row and one "
                             "sequence per request")
    parser.add_argument("--no-trtllm-names", dest="trtllm_names", action="store_false",
                        help="do not render dflash again as ensemble and tensorrt_llm_bls, the names TensorRT-LLM's "
                             "deployments give their text-level models (its example client's --model-name choices, "
                             "its quick start's /v2/models/ensemble/generate); saves their two processes")
    parser.add_argument("--cuda-graphs", default=d.cuda_graphs, choices=["auto", "off", "on", "rehearse"],
                        help="the torch step models replay their verify and draft forwards as CUDA graphs (auto, the "
                             "default: on a CUDA device, not elsewhere; on: CUDA or an error; rehearse: the same "
                             "static forwards on any device, without the capture); the drafting plugin's kernels run "
                             "on CUDA whatever this says")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")


def make_repo_main(args: argparse.Namespace) -> int:
    from trtllm_dflash.commands.common import resolve_ngram
    from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
    from trtllm_dflash.specs import DrafterSpec

    from trtllm_dflash.errors import require

    target = args.target or (args.checkpoint if args.backend == "trtllm-pytorch" else None)
    require(target is not None, "--target", None, f"is required by --backend {args.backend}",
            "pass the Hugging Face target directory")
    block = args.block_size or ("auto" if args.backend == "torch" else DrafterSpec.load(args.drafter).block_size)
    ngram = resolve_ngram(args.ngram, block, args.backend)
    cfg = RepoConfig(target, args.drafter, args.backend, block, args.max_batch_size, args.instances,
                     args.max_seq_len, args.max_sequences, args.queue_delay_us, args.idle_timeout_s, args.torch_threads,
                     coalesce=args.coalesce, max_queue=args.max_queue, queue_timeout_s=args.queue_timeout_s,
                     engines_dir=args.engines, checkpoint_dir=args.checkpoint, max_block_size=args.max_block_size,
                     io_nice=args.io_nice, ngram=ngram, tree=args.tree,
                     tensorrt_llm_decoupled=args.tensorrt_llm_decoupled, trtllm_names=args.trtllm_names,
                     cuda_graphs=args.cuda_graphs,
                     datastore=args.datastore,
                     draft_vocab=args.draft_vocab)
    out = make_repo(cfg, args.out, force=args.force)
    print(json.dumps({"repo": str(out), "models": sorted(p.name for p in out.iterdir() if p.is_dir())}))
    return 0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", required=True, help="a repository rendered by make-repo")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--log", default=None, help="server log file (default: discard)")
    parser.add_argument("--on-model-failure", choices=("reload", "unload", "exit"), default="reload",
                        help="when a model's python stub dies (killed, crashed), the model is unloaded at once (its "
                             "readiness and the server's turn false; requests in flight fail naming it), then: "
                             "reload it (default; its live sequences are lost), leave it unloaded for an operator "
                             "(POST /v2/repository/models/<model>/load), or stop the server and exit 1 (for "
                             "systemd or Kubernetes to restart)")


def serve_main(args: argparse.Namespace) -> int:
    from trtllm_dflash.serve.triton.server import TritonServer, check_backend_available

    check_backend_available(args.repo)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = TritonServer(args.repo, args.http_port, args.grpc_port, args.metrics_port, args.host, args.log)
    try:
        server.start()
        print(json.dumps({"grpc": server.grpc_url, "http": f"{args.host}:{server.http_port}",
                          "metrics": server.metrics_url}), flush=True)
        while not stop.is_set() and server.proc is not None and server.proc.poll() is None:
            stop.wait(1.0)
            for model, pids in server.dead_models().items():
                print(json.dumps({"event": "model_died", "model": model, "stub_pids": sorted(pids),
                                  "action": args.on_model_failure}), file=sys.stderr, flush=True)
                server.unload(model)
                if args.on_model_failure == "exit":
                    return 1
                if args.on_model_failure == "reload":
                    server.reload(model)
                    print(json.dumps({"event": "model_reloaded", "model": model}), file=sys.stderr, flush=True)
        return 0 if stop.is_set() else 1
    finally:
        server.stop()


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    from trtllm_dflash.commands.common import add_bias_argument, add_penalty_arguments

    parser.add_argument("--url", default="127.0.0.1:8001", help="gRPC endpoint")
    parser.add_argument("--model", default="dflash", help="ensemble to call: dflash or baseline")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="stream text deltas")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is (default: chat template)")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--min-tokens", type=int, default=None,
                        help="no stop ends the answer before this many tokens (TensorRT-LLM's min_tokens)")
    add_penalty_arguments(parser)
    parser.add_argument("--logprobs", action="store_true",
                        help="also ask for each token's log-probability (TensorRT-LLM's return_log_probs)")
    parser.add_argument("--bad-word", action="append", default=[], metavar="TEXT",
                        help="text never generated (TensorRT-LLM's bad_words; repeat for more)")
    add_bias_argument(parser)
    parser.add_argument("--num-return-sequences", type=int, default=1, metavar="N",
                        help="N sequences of the prompt, sequence i sampled with --seed + i (TensorRT-LLM's "
                             "num_return_sequences; greedy: N equal ones); printed one after the other")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def client_main(args: argparse.Namespace) -> int:
    from trtllm_dflash.client.grpc import DFlashClient, GenerateParams
    from trtllm_dflash.commands.common import bias_words
    from trtllm_dflash.errors import require

    n = args.num_return_sequences
    require(n >= 1, "--num-return-sequences", n, "must be at least 1")
    params = GenerateParams(args.prompt, args.max_tokens, args.stream, not args.raw, args.temperature, args.top_k,
                            args.top_p, args.seed, min_tokens=args.min_tokens,
                            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, logprobs=args.logprobs,
                            bad_words=tuple(args.bad_word), num_return_sequences=n,
                            embedding_bias=bias_words(args.bias))
    with DFlashClient(args.url) as client:
        stream_text = not args.json and n == 1  # several sequences arrive interleaved: printed when done
        on_chunk = (lambda c: print(c.text, end="", flush=True)) if stream_text else None
        done = client.generate_sequences(args.model, params, on_chunk)
    results = []
    for i, seq in enumerate(done):
        stats = {"model": args.model, "ttft_ms": round(seq.ttft_ms, 1),
                 "tokens_per_second": round(seq.tokens_per_second, 2),
                 "mean_acceptance_length": round(seq.mean_acceptance_length, 3), "num_new_tokens": len(seq.token_ids),
                 **({"cum_log_prob": round(math.fsum(seq.logprobs), 4)} if args.logprobs else {}),
                 **({"sequence_index": i} if n > 1 else {})}
        results.append({"text": seq.text, "token_ids": seq.token_ids, "acceptance_lengths": seq.acceptance_lengths,
                        **({"logprobs": seq.logprobs} if args.logprobs else {}), **stats})
        if not args.json:
            if not stream_text:
                print(f"--- sequence {i} ---\n{seq.text}")
            print()
            print(json.dumps(stats), file=sys.stderr)
    if args.json:
        print(json.dumps(results[0] if n == 1 else {"sequences": results}))
    return 0
