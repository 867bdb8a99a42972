"""`ioattn serve`: an OpenAI-compatible HTTP server (uvicorn, this process) in front of an engine-core process
that loads the model and runs the `LLMEngine` (`ioattn.server.core`)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys

from ioattn.cli_args import DEFAULT_MODEL, MODEL_HELP, add_kv_cache_flags, positive_int

API_KEY_ENV = "IOATTN_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _port(text: str) -> int:
    """argparse type: a TCP port, 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {port}")
    return port


def add_serve_command(subparsers) -> argparse.ArgumentParser:
    from ioattn.server.security import ServerLimits

    serve = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    serve.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    serve.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: --model)")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: loopback only; "
                       "0.0.0.0: every interface, then set an --api-key)")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--chat-template", default=None, help="a jinja file overriding the checkpoint's chat template")
    serve.add_argument("--max-queued-requests", type=positive_int, default=None,
                       help="unfinished requests accepted at once; more are answered 429 (default 1024)")
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--device", default=None)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--num-blocks", type=int, default=None)
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    serve.add_argument("--max-num-seqs", type=int, default=256)
    serve.add_argument("--max-num-batched-tokens", type=int, default=None)
    add_kv_cache_flags(serve)
    serve.add_argument("--no-prefix-caching", action="store_true")
    serve.add_argument("--preemption-mode", default="recompute", choices=("recompute", "swap"))
    serve.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    serve.add_argument("--no-async-scheduling", action="store_true",
                       help="finish each step on the host before scheduling the next (default: overlap)")
    serve.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=1,
                       help="run the model on this many processes (GPUs), Megatron-style tensor parallelism")
    serve.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    security = serve.add_argument_group("limits and security")
    security.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                          help=f"clients must send it as `Authorization: Bearer KEY` on /v1 routes (default: "
                          f"${API_KEY_ENV}, which keeps it out of the process list; unset: no key)")
    security.add_argument("--max-request-bytes", type=positive_int, default=ServerLimits.max_body_bytes,
                          help="larger request bodies are answered 413 (default 16 MiB)")
    security.add_argument("--max-prompts-per-request", type=positive_int, default=ServerLimits.max_prompts,
                          help="prompts one /v1/completions batch may hold; more are answered 400 (default 128)")
    process = serve.add_argument_group("the engine process")
    process.add_argument("--restart-engine", action="store_true",
                         help="when the engine process dies, start a new one (default: the server exits, status 1)")
    process.add_argument("--shutdown-timeout", type=float, default=30.0,
                         help="seconds SIGTERM/SIGINT wait for running requests to finish before cancelling them")
    return serve


def build_app(args: argparse.Namespace, on_engine_exit=None):
    from ioattn.engine.config import EngineConfig
    from ioattn.server.app import create_app
    from ioattn.server.security import ServerLimits
    from ioattn.server.chat_template import ChatTemplate
    from ioattn.server.core import EngineSpec

    config = EngineConfig(
        dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size, num_blocks=args.num_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=args.preemption_mode, enforce_eager=args.enforce_eager, device=args.device,
        async_scheduling=False if args.no_async_scheduling else None, kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_scales=args.kv_cache_scales,
    )
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tensor_parallel_size}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    limits = ServerLimits(max_queued_requests=args.max_queued_requests or ServerLimits.max_queued_requests,
                          max_prompts=args.max_prompts_per_request, max_body_bytes=args.max_request_bytes,
                          api_key=args.api_key)
    spec = EngineSpec(args.model, config, args.tensor_parallel_size, log_level=args.log_level)
    return create_app(spec, served_model_name=args.served_model_name or args.model,
                      chat_template=ChatTemplate.for_model(args.model, args.chat_template), limits=limits,
                      restart_engine=args.restart_engine, on_engine_exit=on_engine_exit,
                      address=f"http://{args.host}:{args.port}")


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (0, after draining) or until the engine process dies for good (1)."""
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    status = {"code": 0}
    server = None

    def engine_exited(why: str) -> None:
        logging.getLogger("ioattn.server").error("stopping the server: %s (--restart-engine would start a new "
                                                 "engine process instead)", why)
        status["code"] = 1
        server.should_exit = True

    try:
        app = build_app(args, on_engine_exit=engine_exited)
    except (ValueError, OSError) as error:  # a bad model, dtype, size or template file: argparse's way out
        print(f"ioattn serve: error: {error}", file=sys.stderr)
        return 2
    if args.host not in LOOPBACK and not args.api_key:
        logging.getLogger("ioattn.server").warning(
            "listening on %s without an API key: anyone who can reach this address can use the server (set "
            "%s or --api-key)", args.host, API_KEY_ENV)
    # What this process holds (torch, the tokenizer) lives as long as it: frozen, it leaves the cyclic GC's full
    # collections (the engine process does the same with its own).
    gc.collect()
    gc.freeze()
    # A long keep-alive spares load generators reconnects.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=30,
                            backlog=4096, timeout_graceful_shutdown=args.shutdown_timeout)
    server = uvicorn.Server(config)
    # uvicorn drains on SIGTERM/SIGINT, then raises the signal again for the handlers it found: quiet ones, so a
    # drained server exits 0 instead of dying by the signal it already handled.
    quiet = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in quiet.items():
            signal.signal(sig, handler)
    if not server.started:  # the engine could not start (the log says why)
        return 1
    return status["code"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ioattn")
    add_serve_command(parser.add_subparsers(dest="command", required=True))
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
