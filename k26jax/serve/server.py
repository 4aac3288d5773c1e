"""`k26jax serve`: load a checkpoint, compile and warm the engine, serve over uvicorn until SIGTERM / Ctrl-C.

On SIGTERM or SIGINT the server stops accepting connections, serves the requests in flight for up to
--drain-timeout seconds, fails what is left with a clear error, and exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import jax
import uvicorn

from k26jax import autobudget, engine
from k26jax.api import load
from k26jax.serve import multihost
from k26jax.serve.app import ServerConfig, create_app
from k26jax.serve.metrics import Metrics
from k26jax.serve.scheduler import Scheduler, buckets

GIL_SWITCH_S = 5e-4  # sys.setswitchinterval in the serving process (see `serve`)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose exit signal first starts the scheduler's drain."""

    def __init__(self, config, sched: Scheduler, drain_timeout: float):
        super().__init__(config)
        self.sched, self.drain_timeout = sched, drain_timeout

    def handle_exit(self, sig, frame):
        if not self.sched.draining:
            self.sched.begin_drain(self.drain_timeout)
        super().handle_exit(sig, frame)


def step_config(args, cfg, dcfg) -> engine.StepConfig:
    """The server's step: per-slot sampling, logprobs with --max-logprobs alternatives, an output capacity of
    --max-len (each slot's own limit is its request's max_tokens)."""
    return engine.StepConfig(
        method=args.method,
        budget=32 if args.budget == "auto" else args.budget,
        max_new_tokens=args.max_len,
        eos_ids=tuple(cfg.eos_token_ids),
        block_size=dcfg.block_size if dcfg is not None else 8,
        sampling=True,
        logprobs=True,
        top_logprobs=args.max_logprobs,
    )


def load_decoder(args):
    """(Decoder, params, drafter params, tokenizer) for the checkpoint the `serve` arguments name."""
    from k26jax.cli import placement

    model = load(args.ckpt, drafter=args.drafter, dtype=args.dtype, **placement(args))
    cfg = model.cfg
    if args.method != "ar" and model.drafter_cfg is None:
        raise ValueError(f"--method {args.method} needs a drafter: pass --drafter DIR (or use --method ar)")
    if args.max_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-len {args.max_len} is beyond max_position_embeddings ({cfg.max_position_embeddings})")
    dcfg = model.drafter_cfg if args.method != "ar" else None
    sc = step_config(args, cfg, dcfg)
    if args.budget == "auto":
        dec = autobudget.AutoDecoder(cfg, dcfg, sc, model.impls, args.auto_candidates or autobudget.CANDIDATES)
    else:
        dec = engine.Decoder(cfg, dcfg, sc, model.impls)
    return dec, model.params, model.drafter_params if dcfg is not None else None, model.tokenizer


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening) before the checkpoint loads: a busy port or a bad host fails
    at once, not after minutes of loading and compiling. Port 0 takes a free one."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot serve there ({e.strerror})") from None
    return sock


def start(args, dec: engine.Decoder | autobudget.AutoDecoder, params, dparams, tokenizer, name: str, sock):
    """Warm the engine (compile every insert bucket and the step), start its thread; (scheduler, uvicorn config).
    sock: `bind`'s."""
    if args.max_batch < 1 or args.max_queue < 0:
        raise ValueError(f"--max-batch {args.max_batch} / --max-queue {args.max_queue}: need >= 1 / >= 0")
    if args.max_len < dec.sc.depth + 3:
        raise ValueError(
            f"--max-len {args.max_len}: too short for a prompt, a token and the draft depth {dec.sc.depth}"
        )
    metrics = Metrics(dec.sc.depth + 1)  # before the warm-up, so its compilations are counted
    sched = Scheduler(
        dec, params, dparams, max_batch=args.max_batch, max_len=args.max_len, max_queue=args.max_queue, metrics=metrics
    )
    started = time.perf_counter()
    sched.warm_up()
    port = sock.getsockname()[1]
    print(
        f"[k26jax] serving {name} on http://{args.host}:{port}: method={args.method}"
        + (f", budget={args.budget}" if args.method == "ddtree" else "")
        + f", {args.max_batch} slots, max_len {args.max_len}, prompt buckets {buckets(args.max_len)}; "
        f"warm-up {time.perf_counter() - started:.1f}s, {metrics.compiled} compilations; "
        f"device={jax.devices()[0].device_kind}",
        file=sys.stderr,
        flush=True,
    )
    sched.start()
    server_cfg = ServerConfig(
        model_name=name,
        max_len=args.max_len,
        depth=dec.sc.depth,
        vocab_size=dec.cfg.vocab_size,
        eos_ids=dec.sc.eos_ids,
        max_logprobs=args.max_logprobs,
        api_key=args.api_key or os.environ.get("K26JAX_API_KEY") or None,
    )
    config = uvicorn.Config(
        create_app(sched, tokenizer, server_cfg),
        host=args.host,
        port=port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.drain_timeout + 2,
        lifespan="off",
    )
    return sched, config


def serve(sched: Scheduler, config, drain_timeout: float, sock: socket.socket) -> int:
    """Run uvicorn on sock until SIGTERM / SIGINT, draining the scheduler first; 0 after a clean stop."""
    # The engine thread waits for each step with the GIL released and needs it back the moment the step ends,
    # while the HTTP thread may be running Python (streaming chunks); CPython hands the GIL over only after the
    # switch interval, 5 ms by default: long against a decode step.
    sys.setswitchinterval(GIL_SWITCH_S)
    server = DrainingServer(config, sched, drain_timeout)
    # uvicorn re-raises the exit signal after its graceful shutdown; this handler makes that a clean exit
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        sched.stop()
    print("[k26jax] server stopped", file=sys.stderr, flush=True)
    return 0


def run(args) -> int:
    """`k26jax serve`. Several processes (k26jax.distributed): process 0 serves HTTP and leads, the others follow
    its device calls (serve/multihost.py)."""
    sock = bind(args.host, args.port) if jax.process_index() == 0 else None
    dec, params, dparams, tokenizer = load_decoder(args)
    if jax.process_index() > 0:
        print(f"[k26jax] process {jax.process_index()}: following process 0's steps", file=sys.stderr, flush=True)
        return multihost.follow(dec, params, dparams)
    leader = multihost.Leader(dec) if jax.process_count() > 1 else None
    name = args.served_model_name or os.path.basename(os.path.normpath(args.ckpt))
    sched, config = start(args, leader or dec, params, dparams, tokenizer, name, sock)
    try:
        return serve(sched, config, args.drain_timeout, sock)
    finally:
        if leader is not None:
            leader.stop()
