"""The `k26jax` command line (also `python -m k26jax`): `generate` streams decoding of prompts; `serve` runs the
OpenAI-compatible server (k26jax/serve/).

A user's mistake (a bad path, flag or prompt) prints one `error: ...` line and exits 2; running out of device
memory says what to lower; Ctrl-C exits 130; `--debug` shows the traceback of anything. Tracebacks of real bugs are
kept. The library's progress (loading, verifying, compiling) is logged to stderr. Compiled programs persist in
$K26JAX_CACHE_DIR (default ~/.cache/k26jax/jax), so a second run does not compile again (--no-compile-cache: off).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from k26jax.config import ConfigError

USER_ERRORS = (ConfigError, FileNotFoundError, NotADirectoryError, ValueError)


OUR_CODE = tuple(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + pkg + os.sep for pkg in ("k26jax", "convert")
)


def _raised_by_k26jax(error: BaseException) -> bool:
    """A user's mistake is refused by k26jax's own checks (raised in k26jax's or convert's files, wherever they are
    installed); a ValueError raised inside jax or another library is a bug, and keeps its traceback."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is None or os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(OUR_CODE)


def placement(args) -> dict:
    """load()'s mesh and expert_mode from --devices and --expert-mode: a ("data", "model") mesh over the devices
    (every process's, after k26jax.distributed.initialize), none for one device; experts split over the whole mesh
    ("ep_global") when several processes share it, else over "model" ("ep")."""
    import jax

    from k26jax import sharding

    n = args.devices or jax.device_count()
    mode = args.expert_mode if args.expert_mode != "auto" else ("ep_global" if jax.process_count() > 1 else "ep")
    return dict(mesh=sharding.make_mesh(n) if n > 1 or jax.process_count() > 1 else None, expert_mode=mode)


def _setup(args):
    """Logging to stderr, the job's processes (k26jax.distributed: nothing without its environment or a launcher)
    and jax's persistent compilation cache, before anything touches a device."""
    import jax

    from k26jax import distributed

    distributed.initialize()

    logging.basicConfig(format="[k26jax] %(message)s", stream=sys.stderr)
    logging.getLogger("k26jax").setLevel(logging.DEBUG if args.debug else logging.INFO)
    cache = os.environ.get("K26JAX_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "k26jax", "jax"))
    if os.path.exists(cache) and not os.path.isdir(cache) and not args.no_compile_cache:
        logging.getLogger("k26jax").warning("K26JAX_CACHE_DIR=%s is not a directory: compiled programs not kept", cache)
    elif not args.no_compile_cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _generate(args) -> int:
    import jax

    from k26jax.api import load
    from k26jax.generation import generate
    from k26jax.tokenizer import StreamDecoder

    model = load(args.ckpt, drafter=args.drafter, dtype=args.dtype, verify=not args.no_verify, **placement(args))
    if args.method != "ar" and model.drafter_cfg is None:
        raise ValueError(f"--method {args.method} needs a DFlash drafter: pass --drafter DIR, or use --method ar")
    tok = model.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else tok.encode(p) for p in args.prompt
    ]
    budget = f", budget={args.budget}" if args.method == "ddtree" else ""
    print(f"[k26jax] method={args.method}{budget}, {len(prompts)} prompt(s)", file=sys.stderr)
    single = len(prompts) == 1
    streams = [StreamDecoder(tok) for _ in prompts]
    texts = [[] for _ in prompts]  # several prompts: each completion is printed whole at the end

    def on_tokens(i, new_ids):
        text = streams[i].feed(new_ids)
        if single:
            print(text, end="", flush=True)
        else:
            texts[i].append(text)

    profiling = jax.profiler.trace(args.profile) if args.profile else contextlib.nullcontext()
    try:
        with profiling:
            result = generate(
                model,
                prompts,
                max_new_tokens=args.max_new_tokens,
                method=args.method,
                budget=args.budget,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
                on_tokens=on_tokens,
                auto_candidates=args.auto_candidates,
            )
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ValueError(
            f"out of device memory decoding a batch of {len(prompts)} prompt(s) with up to "
            f"{max(map(len, prompts))} + {args.max_new_tokens} tokens each (method {args.method}, budget "
            f"{args.budget}): lower --max-new-tokens, the number of --prompt, or --budget"
        ) from None
    if single:
        print(streams[0].flush(), end="")
    else:
        whole = zip(args.prompt, texts, streams)
        print("\n\n".join(f"[{i}] {p!r} ->\n{''.join(parts)}{st.flush()}" for i, (p, parts, st) in enumerate(whole)))
    s = result.stats
    if s["steps"]:
        speed = (
            f"tau={s['tau']:.2f} (tokens per target pass; 1 = no speed-up), {s['tokens_per_s']:.1f} tok/s decode, "
            f"step compile {s['compile_s']:.2f}s"
        )
    else:
        speed = "no decode step ran (the prefill gives the first token)"
    print(
        f"\n[k26jax] {s['new_tokens']} tokens in {s['steps']} step{'s' * (s['steps'] != 1)}, {speed}, "
        f"prefill {s['prefill_s']:.2f}s",
        file=sys.stderr,
    )
    if "auto" in s:
        a = s["auto"]
        chunks = f"{a['chunk_steps']} steps a dispatch" if a["chunk_steps"] else "no chunk ran"
        print(
            f"[k26jax] budget auto: steps per candidate {a['choices']}, measured step ms {a['step_ms']}, {chunks}, "
            f"drafter calibration gamma {a['calibration_gamma']:.2f}",
            file=sys.stderr,
        )
    if args.profile:
        print(f"[k26jax] profile of the run in {args.profile}: open it with TensorBoard or Perfetto", file=sys.stderr)
    return 0


def _serve(args) -> int:
    try:
        from k26jax.serve import server
    except ModuleNotFoundError as e:
        raise ValueError(f"`k26jax serve` needs {e.name}: pip install 'k26jax[serve]'") from None
    return server.run(args)


DEFAULT_BUDGET = 32
BUDGET_HELP = f"DDTree nodes verified per step (default {DEFAULT_BUDGET}), or 'auto': chosen each step"


def budget_arg(text: str) -> int | str:
    """--budget: an integer in 1..MAX_BUDGET (the tree kernels' limit) or "auto"."""
    from pallas_kernels.tree_build import MAX_BUDGET

    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_BUDGET:
        raise argparse.ArgumentTypeError(f"{text!r}: use an integer in 1..{MAX_BUDGET} or 'auto'")
    return value


def candidates_arg(text: str) -> tuple:
    """--auto-candidates: autobudget.parse_candidates."""
    from k26jax.autobudget import parse_candidates

    try:
        return parse_candidates(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


AUTO_CANDIDATES_HELP = (
    "with --budget auto: what it chooses among, e.g. chain,ddtree16,ddtree32 (default: chain and ddtree8..128; "
    "each is compiled twice, so fewer start faster)"
)


def bounded(kind, low=None, high=None, above=None):
    """An argparse type: a finite kind(text) >= low (or > above) and <= high; the error names the bound."""
    parts = (
        [f">= {low}"] * (low is not None) + [f"> {above}"] * (above is not None) + [f"<= {high}"] * (high is not None)
    )

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: not {'an integer' if kind is int else 'a number'}") from None
        if value != value or abs(value) == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r}: not a finite number")
        if (
            (low is not None and value < low)
            or (above is not None and value <= above)
            or (high is not None and value > high)
        ):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {' and '.join(parts)}")
        return value

    return parse


def _placement_args(p):
    from k26jax.sharding import EXPERT_MODES

    p.add_argument(
        "--devices", type=bounded(int, 0), default=0, help="devices to shard over (default 0: all of the job's)"
    )
    p.add_argument(
        "--expert-mode",
        default="auto",
        choices=("auto", *EXPERT_MODES),
        help="routed experts: ep (split over a host's devices) or tp; auto: ep, or split over every process's "
        "devices when several processes share the job",
    )


def parser() -> argparse.ArgumentParser:
    from k26jax.api import DEFAULT_CKPT
    from k26jax.engine import MAX_TOP_LOGPROBS, METHODS

    ap = argparse.ArgumentParser(prog="k26jax", description="Kimi K2.6 in JAX with DDTree speculative decoding")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream DDTree / chain / AR decoding of prompts")
    g.add_argument("--ckpt", default=DEFAULT_CKPT, help="HF or converted checkpoint dir (default: the embedded one)")
    g.add_argument("--drafter", default=None, help="DFlash drafter dir (default: CKPT/drafter)")
    g.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the checkpoint's chat template")
    g.add_argument("--method", default="ddtree", choices=METHODS)
    g.add_argument("--budget", type=budget_arg, default=None, help=BUDGET_HELP)
    g.add_argument("--auto-candidates", type=candidates_arg, default=None, help=AUTO_CANDIDATES_HELP)
    g.add_argument("--max-new-tokens", type=bounded(int, 1), default=48)
    g.add_argument("--temperature", type=bounded(float, 0.0), default=0.0)
    g.add_argument("--top-p", type=bounded(float, above=0.0, high=1.0), default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    _placement_args(g)
    g.add_argument("--no-verify", action="store_true", help="skip checking a converted checkpoint's chunk sha256s")
    g.add_argument("--profile", default=None, metavar="DIR", help="write a jax.profiler trace of the decode to DIR")
    g.add_argument("--no-compile-cache", action="store_true", help="do not keep compiled programs on disk")
    g.add_argument("--debug", dest="debug_here", action="store_true", help="show tracebacks")
    g.set_defaults(run=_generate)

    s = sub.add_parser("serve", help="an OpenAI-compatible server with continuous batching")
    s.add_argument("--ckpt", default=DEFAULT_CKPT, help="HF or converted checkpoint dir (default: the embedded one)")
    s.add_argument("--drafter", default=None, help="DFlash drafter dir (default: CKPT/drafter)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=bounded(int, 0, 65535), default=8000, help="0: any free port")
    s.add_argument("--method", default="ddtree", choices=METHODS)
    s.add_argument("--budget", type=budget_arg, default=None, help=BUDGET_HELP)
    s.add_argument("--auto-candidates", type=candidates_arg, default=None, help=AUTO_CANDIDATES_HELP)
    s.add_argument("--max-batch", type=bounded(int, 1), default=8, help="slots decoded together")
    s.add_argument(
        "--max-len", type=bounded(int, 1), default=4096, help="cache rows per slot: prompt + completion + draft"
    )
    s.add_argument("--max-queue", type=bounded(int, 0), default=256, help="requests waiting for a slot before a 503")
    s.add_argument(
        "--max-logprobs",
        type=bounded(int, 0, MAX_TOP_LOGPROBS),
        default=20,
        help="the most top_logprobs a request may ask (<= 20; 0: none)",
    )
    s.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (default: $K26JAX_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: CKPT's name)")
    s.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    _placement_args(s)
    s.add_argument(
        "--drain-timeout", type=bounded(float, 0.0), default=30.0, help="seconds to finish requests on SIGTERM"
    )
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    s.add_argument("--no-compile-cache", action="store_true", help="do not keep compiled programs on disk")
    s.add_argument("--debug", dest="debug_here", action="store_true", help="show tracebacks")
    s.set_defaults(run=_serve)
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked: --budget belongs to --method ddtree (default 32), --profile is a directory."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.budget is None:
        args.budget = DEFAULT_BUDGET
    elif args.method != "ddtree":
        ap.error(f"--budget {args.budget}: only --method ddtree builds a tree of a budget (not {args.method})")
    if args.auto_candidates is not None and args.budget != "auto":
        ap.error("--auto-candidates: only with --budget auto")
    if getattr(args, "profile", None):
        try:
            os.makedirs(args.profile, exist_ok=True)
        except OSError as e:
            ap.error(f"--profile {args.profile}: cannot make this trace directory ({e.strerror})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.debug = args.debug or getattr(args, "debug_here", False)
    from k26jax.distributed import EXIT_PEER_LOST, PeerLostError  # after --help: it imports jax

    try:
        _setup(args)
        return args.run(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except PeerLostError as e:  # several processes, one gone: exit now, not after jax's shutdown barrier times out
        print(f"PeerLostError: {e}", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_LOST)
    except USER_ERRORS as e:
        if args.debug or not _raised_by_k26jax(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
