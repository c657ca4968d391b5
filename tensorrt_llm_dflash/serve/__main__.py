"""``python -m tensorrt_llm_dflash.serve``: an OpenAI-compatible server (docs/serving.md).

    python -m tensorrt_llm_dflash.serve                                   # embedded SmolLM2 + demo drafter
    python -m tensorrt_llm_dflash.serve --speculative_decoding_mode none  # plain AR, same runtime
    python -m tensorrt_llm_dflash.serve --target_model_dir /models/Qwen3-8B \\
        --draft_model_dir /models/Qwen3-8B-DFlash-b16 --dtype bfloat16 --device cuda --port 8000
    python -m tensorrt_llm_dflash.serve --engine_dir engines/qwen3-8b-dflash \\
        --tokenizer_dir /models/Qwen3-8B --port 8000                      # a TensorRT-LLM engine (--backend trt)

Model flags follow examples/run.py. Every flag is checked, and the port bound, before any model
loads: a bad flag or a port in use exits with status 2 and one line naming it.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.util
import logging
import queue
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from .. import cli
from ..errors import DFlashError
from ..precision import guarantee, low_precision_warning
from ..tree import MAX_DDTREE_BUDGET

#: api.DEFAULT_MAX_BODY_BYTES in MiB (api imports FastAPI, which the flags are checked without).
DEFAULT_MAX_BODY_MB = 16

DTYPES = ["float32", "bfloat16", "float16", "float64"]
#: The embedded target's name in /v1/models when --served_model_name is not given.
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_BATCH_SIZE = 256
MAX_QUEUE = 1 << 20
LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


def host(text: str) -> str:
    """A host name or address to bind (checked by resolving it, before any model loads)."""
    try:
        socket.getaddrinfo(text, None)
    except (socket.gaierror, UnicodeError) as err:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be resolved: {err}") from None
    return text


def served_name(text: str) -> str:
    if not text.strip() or text != text.strip():
        raise argparse.ArgumentTypeError(f"must be a non-empty name without surrounding spaces, got {text!r}")
    return text


def build_parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(prog="python -m tensorrt_llm_dflash.serve", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="Exactness by --dtype: " + "; ".join(guarantee(d) for d in DTYPES) + ".")
    model = ap.add_argument_group("model (as examples/run.py)")
    model.add_argument("--speculative_decoding_mode", choices=["none", "dflash"], default="dflash")
    model.add_argument("--backend", choices=["pytorch", "trt"], default=None,
                       help="pytorch: the graph-ready runtime (CUDA graphs on CUDA, eager on the CPU); trt: a "
                            "TensorRT-LLM engine built with --speculative_decoding_mode dflash (implied by "
                            "--engine_dir; its rows are the engine's --max_batch_size, its tree a fixed budget)")
    model.add_argument("--engine_dir", type=cli.existing_dir, default=None,
                       help="TensorRT-LLM engine dir (implies --backend trt; docs/trtllm_engine.md)")
    model.add_argument("--tokenizer_dir", type=cli.existing_path, default=None,
                       help="tokenizer for --engine_dir (default: the engine dir)")
    model.add_argument("--target_model_dir", type=cli.existing_path, default=None,
                       help="HF causal-LM dir or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    model.add_argument("--draft_model_dir", type=cli.existing_dir, default=None,
                       help="DFlash drafter dir (default: the shipped demo drafter, for the embedded target)")
    model.add_argument("--ddtree_budget", type=cli.integer(0, MAX_DDTREE_BUDGET), default=None,
                       help="a fixed DDTree node budget; 0 = DFlash chain (default: the cost-aware tree on the "
                            "device, its tree size chosen each step from the measured cost of each size)")
    model.add_argument("--no_lookup", action="store_true", help="cost-aware tree: no prompt-lookup branches")
    model.add_argument("--size_choice", choices=["ahead", "in_step"], default=None,
                       help="cost-aware tree: choose each step's tree size before it from the previous step's "
                            "estimates (ahead; no host read inside a step) or inside it from its own (in_step; "
                            "default: in_step on a CPU, ahead on CUDA)")
    model.add_argument("--dtype", choices=DTYPES, default="float32",
                       help="float32/float64: greedy (temperature 0) answers equal the target's own greedy output")
    model.add_argument("--device", type=cli.device, default=None, help="cpu or cuda (default: cuda if available)")
    model.add_argument("--threads", type=cli.threads, default=None, help="torch CPU threads")
    server = ap.add_argument_group("server")
    server.add_argument("--host", type=host, default="127.0.0.1",
                        help="address to listen on (default: loopback only; 0.0.0.0 for every interface)")
    server.add_argument("--port", type=cli.integer(0, 65535), default=8000, help="0 = any free port (printed)")
    server.add_argument("--served_model_name", type=served_name, default=None,
                        help="the model's name in the API (default: the target directory's name)")
    server.add_argument("--max_batch_size", type=cli.integer(1, MAX_BATCH_SIZE), default=None,
                        help="rows decoded together: one batched decoder, every step one forward pass over the rows "
                             "in flight (the cost-aware tree picks its size for the batch; docs/serving.md); "
                             "default 1, or the engine's --max_batch_size with --backend trt (at most that)")
    server.add_argument("--max_queue", type=cli.integer(0, MAX_QUEUE), default=64,
                        help="requests that may wait for a row; past max_batch_size + max_queue in flight, new "
                             "requests get 429")
    server.add_argument("--max_model_len", type=cli.integer(1), default=None,
                        help="prompt + output tokens per request (default: the target's positions, less one "
                             "step's writes past the last)")
    server.add_argument("--max_body_mb", type=cli.integer(1, 1024), default=DEFAULT_MAX_BODY_MB,
                        help="largest request body in MiB; a larger one gets 413 (default %(default)s)")
    server.add_argument("--shutdown_timeout", type=cli.integer(1, 3600), default=10,
                        help="seconds Ctrl-C / SIGTERM lets requests in flight finish; the rest get 503 (default "
                             "%(default)s)")
    server.add_argument("--log_level", choices=LOG_LEVELS, default="info")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.backend is None:
        args.backend = "trt" if args.engine_dir is not None else "pytorch"
    if args.backend == "trt":
        check_engine_args(ap, args)
    else:
        for flag, given in (("--engine_dir", args.engine_dir is not None),
                            ("--tokenizer_dir", args.tokenizer_dir is not None)):
            if given:
                cli.refuse(ap, flag, "applies to --backend trt (a TensorRT-LLM engine)")
        if args.max_batch_size is None:
            args.max_batch_size = 1
    speculative = args.speculative_decoding_mode == "dflash"
    if not speculative:
        for flag, given in (("--draft_model_dir", args.draft_model_dir is not None),
                            ("--ddtree_budget", args.ddtree_budget is not None), ("--no_lookup", args.no_lookup),
                            ("--size_choice", args.size_choice is not None)):
            if given:
                cli.refuse(ap, flag, "needs --speculative_decoding_mode dflash (there is no drafter in 'none')")
    for flag, given in (("--no_lookup", args.no_lookup), ("--size_choice", args.size_choice is not None)):
        if given and args.ddtree_budget is not None:
            cli.refuse(ap, flag, "applies to the cost-aware tree, not to a fixed --ddtree_budget")
    if speculative and args.target_model_dir is not None and args.draft_model_dir is None:
        cli.refuse(ap, "--draft_model_dir", "is required with --target_model_dir (the demo drafter only fits the "
                                            "embedded SmolLM2 target), or pass --speculative_decoding_mode none")
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        ap.error(f"the server needs {' and '.join(missing)}, which is not installed: pip install -r requirements.txt")
    args.socket = bind(ap, args.host, args.port)
    return args


def check_engine_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--backend trt: what the engine's config.json allows, checked before the engine (or tensorrt_llm) loads."""
    from ..errors import DFlashConfigError

    if args.engine_dir is None:
        cli.refuse(ap, "--backend", "'trt' needs --engine_dir")
    for flag, given in (("--target_model_dir", args.target_model_dir is not None),
                        ("--draft_model_dir", args.draft_model_dir is not None), ("--no_lookup", args.no_lookup),
                        ("--size_choice", args.size_choice is not None), ("--dtype", args.dtype != "float32")):
        if given:
            cli.refuse(ap, flag, "applies to --backend pytorch: an engine holds its own target, drafter and dtype")
    if args.speculative_decoding_mode != "dflash":
        cli.refuse(ap, "--speculative_decoding_mode", "a DFlash engine always drafts: serve it in 'dflash' mode "
                                                      "(--ddtree_budget 0 for the chain)")
    from ..trtllm.runner import missing_tokenizer, read_engine_config

    try:
        config = read_engine_config(args.engine_dir)
        max_draft_len = int(config["pretrained_config"]["max_draft_len"])
        engine_rows = int(config["build_config"].get("max_batch_size", 1))
    except (DFlashConfigError, KeyError, TypeError, ValueError) as err:
        cli.refuse(ap, "--engine_dir", f"{args.engine_dir} is not a DFlash engine: {err}")
    if args.ddtree_budget is not None and args.ddtree_budget > max_draft_len:
        cli.refuse(ap, "--ddtree_budget", f"{args.ddtree_budget} exceeds the engine's max_draft_len={max_draft_len}")
    if args.max_batch_size is None:
        args.max_batch_size = engine_rows
    elif args.max_batch_size > engine_rows:
        cli.refuse(ap, "--max_batch_size", f"{args.max_batch_size} exceeds the engine's max_batch_size={engine_rows} "
                                           "(trtllm-build --max_batch_size)")
    cli.require_module(ap, "--engine_dir", "tensorrt_llm",
                       "pip install -r requirements-trtllm.txt on a machine with a GPU; docs/trtllm_engine.md")
    problem = missing_tokenizer(args.engine_dir, args.tokenizer_dir)
    if problem:
        cli.refuse(ap, "--tokenizer_dir", problem)


def bind(ap: argparse.ArgumentParser, address: str, port: int) -> socket.socket:
    """Bind now, so that a port in use is refused before minutes of loading; listen once the model is ready."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as err:
        sock.close()
        cli.refuse(ap, "--port", f"cannot listen on {address}:{port}: {err.strerror or err}")
    return sock


def load_models(args: argparse.Namespace) -> tuple[Any, Any, Any, list[int]]:
    """(target model, DFlash drafter or None, tokenizer, EOS ids), with run.py's loaders and checks."""
    import torch

    from ..assets import resolve_drafter_dir
    from ..decode import stop_ids
    from ..dflash2 import DFlash2Config, check_drafter_checkpoint
    from ..drafter import load_dflash_drafter
    from ..errors import DFlashInputError
    from ..target import check_drafter_fits_target_dir, load_target, target_dims

    dtype = getattr(torch, args.dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    drafter = None
    if args.speculative_decoding_mode == "dflash":
        draft_dir = resolve_drafter_dir(args.draft_model_dir, args.target_model_dir,
                                        "serve with --speculative_decoding_mode none")
        # As run.py: the drafter's config, tensor names and shapes, its fit to the target's config.json, then its
        # weights (NaN, dtype), all before the target loads (minutes for a large one).
        config = check_drafter_checkpoint(draft_dir)
        if isinstance(config, DFlash2Config):
            raise DFlashInputError(f"--draft_model_dir {str(draft_dir)!r} is a DFlash2 drafter: the server runs "
                                   "DFlash drafters (examples/run.py runs DFlash2 ones)")
        check_drafter_fits_target_dir(config, args.target_model_dir)
        drafter = load_dflash_drafter(draft_dir, dtype=dtype, device=device)
    model, tokenizer = load_target(args.target_model_dir, dtype=dtype, device=device)
    if drafter is not None:
        drafter.config.validate_for_target(**target_dims(model))
    return model, drafter, tokenizer, stop_ids(model.generation_config.eos_token_id)


def load_engine(args: argparse.Namespace) -> tuple[Any, Any, list[int]]:
    """--backend trt: (EngineServeRunner, tokenizer, EOS ids), as examples/run.py loads an engine."""
    from tensorrt_llm._utils import mpi_rank

    from ..trtllm.runner import check_engine_world, load_engine_tokenizer
    from ..trtllm.serve_runner import EngineServeRunner

    check_engine_world(args.engine_dir)
    tokenizer, stops = load_engine_tokenizer(args.engine_dir, args.tokenizer_dir)
    runner = EngineServeRunner(args.engine_dir, ddtree_budget=args.ddtree_budget, max_batch=args.max_batch_size,
                               max_model_len=args.max_model_len, device=args.device, rank=mpi_rank())
    return runner, tokenizer, stops


def default_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.engine_dir is not None:
        return Path(args.engine_dir).resolve().name
    if args.target_model_dir is None:
        return EMBEDDED_MODEL_NAME
    path = Path(args.target_model_dir).resolve()
    return path.stem if path.is_file() else path.name


def build_server(args: argparse.Namespace, manage_engine: bool = True) -> tuple[Any, Any]:
    """(FastAPI app, engine): models loaded, the runner built and measured; with ``manage_engine`` the engine starts
    and stops with the app, on a thread of its own."""
    from .api import ServerSettings, create_app
    from .engine import Engine
    from .runner import DecoderSpec, graphed_rows

    if args.backend == "trt":
        runner, tokenizer, eos = load_engine(args)
    else:
        model, drafter, tokenizer, eos = load_models(args)
        spec = DecoderSpec(model, drafter, budget=args.ddtree_budget, lookup=not args.no_lookup,
                           size_choice=args.size_choice)
        runner = graphed_rows(spec, args.max_batch_size, args.max_model_len)
    # Two tokenizers: a fast tokenizer is not safe to share between the event loop and the engine thread.
    engine = Engine(runner, copy.deepcopy(tokenizer), max_queue=args.max_queue)
    app = create_app(engine, ServerSettings(default_model_name(args), frozenset(eos), tokenizer,
                                            max_body_bytes=args.max_body_mb << 20), manage_engine=manage_engine)
    return app, engine


def start_model_thread(args: argparse.Namespace) -> tuple[Any, Any]:
    """(app, engine), the engine taking requests: one thread loads the model, builds the runner and then runs the
    engine's step loop, so that all tensor work stays on the thread that began it (:meth:`.engine.Engine.run` says
    why that matters on a CPU). What the build raises is raised here; the caller stops the engine."""
    built: queue.Queue[tuple[Any, Any] | BaseException] = queue.Queue(maxsize=1)

    def model_thread() -> None:
        try:
            app, engine = build_server(args, manage_engine=False)
        except BaseException as err:  # noqa: BLE001 - handed to the main thread, which reports it
            built.put(err)
            return
        engine.run(ready=lambda: built.put((app, engine)))

    threading.Thread(target=model_thread, name="dflash-model", daemon=True).start()
    result = built.get()
    if isinstance(result, BaseException):
        raise result
    return result


#: Seconds before uvicorn's graceful-shutdown timeout at which the engine stops: every request still in flight then
#: gets its 503 (a stream its error event and [DONE]) while its connection is open, before uvicorn cancels it.
SHUTDOWN_ANSWER_SECONDS = 2.0


def graceful_server(config: Any, engine: Any) -> Any:
    """A ``uvicorn.Server`` whose shutdown (Ctrl-C, SIGTERM) stops taking connections, lets the requests in flight
    finish for ``timeout_graceful_shutdown - SHUTDOWN_ANSWER_SECONDS`` seconds, then stops the engine so that the
    rest are answered (503 or a stream's error event), not cut off when uvicorn cancels them at the timeout."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            async def answer_the_rest() -> None:
                await asyncio.sleep(max(self.config.timeout_graceful_shutdown - SHUTDOWN_ANSWER_SECONDS, 0.0))
                await asyncio.to_thread(engine.stop)

            deadline = asyncio.create_task(answer_the_rest())
            try:
                await super().shutdown(sockets)
            finally:
                deadline.cancel()
            if self.force_exit:
                await self.answer_now()

        async def answer_now(self) -> None:
            """A second Ctrl-C (force quit) ends uvicorn's wait at once, and closing the event loop then cancels the
            handlers still running: a plain-text 500 for a request, a stream cut off without its error event. Stopping
            the engine first answers them (503, a stream's error event and [DONE]), for at most a few seconds."""
            await asyncio.to_thread(engine.stop, SHUTDOWN_ANSWER_SECONDS)
            give_up = asyncio.get_running_loop().time() + SHUTDOWN_ANSWER_SECONDS
            while self.server_state.tasks and asyncio.get_running_loop().time() < give_up:
                await asyncio.sleep(0.05)

    return GracefulServer(config)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sock: socket.socket = args.socket
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    try:
        import torch
        import uvicorn

        if args.threads:
            torch.set_num_threads(args.threads)
        warning = None if args.backend == "trt" else low_precision_warning(
            args.dtype, args.speculative_decoding_mode == "dflash")
        if warning:
            print(warning, file=sys.stderr)
        app, engine = start_model_thread(args)
        sock.listen(2048)
        bound_host, bound_port = sock.getsockname()[:2]
        print(f"serving {default_model_name(args)!r} ({engine.runner.description}; max_batch_size "
              f"{engine.runner.max_batch}, max_queue {engine.max_queue}, max_model_len {engine.runner.max_model_len}) "
              f"at http://{bound_host}:{bound_port}", flush=True)
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout)
        try:
            graceful_server(config, engine).run(sockets=[sock])
        except KeyboardInterrupt:
            # uvicorn shuts down cleanly on Ctrl-C (the engine answers what is still in flight), then re-raises the
            # signal; stopping a server that way is the normal way, not an error.
            print("server stopped", flush=True)
        finally:
            engine.stop()  # normally already stopped by graceful_server; an error path gets here too
    except DFlashError as err:
        cli.print_error(err)
        return 2
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
