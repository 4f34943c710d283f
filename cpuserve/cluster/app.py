"""The Ray Serve application (N engine replicas behind one ingress) and `cpuserve cluster`, which runs it.

`cpuserve cluster MODEL --replicas N [serve flags]` connects to the Ray cluster this machine belongs
to (`ray start --head` here, `ray start --address HEAD:6379` on each machine that joins), or starts
a one-machine Ray when there is none, and serves until SIGTERM/SIGINT. The same application is
what `serve run cpuserve.cluster.app:build model=... replicas=2` (or a Serve config file naming
`cpuserve.cluster.app:build`) deploys.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import threading
from typing import Any

from cpuserve.cluster import APP_NAME
from cpuserve.errors import CpuserveError

log = logging.getLogger("cpuserve")

ONGOING_MARGIN = 32  # requests past an engine's own limits that still reach it (and get its 503)
# Set by each replica for itself (cluster/cores.py): never copied from the driver.
# The API key travels once, as --api-key in the replicas' flags (replica_argv).
PER_REPLICA_ENV = {"CPUSERVE_THREADS_BIND", "VLLM_CPU_OMP_THREADS_BIND", "CPUSERVE_NUM_THREADS", "VLLM_API_KEY"}


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--replicas", type=int, default=1, help="engine replicas to start with (default 1)")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscale down to this many (default: --replicas)")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many (default: --replicas)")
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=16.0,
        help="autoscaling aims at this many requests in flight per replica (queued ones count)",
    )
    g.add_argument("--threads-per-replica", type=int, default=1, help="cores (and Ray CPUs) each replica takes")
    g.add_argument(
        "--prefix-imbalance",
        type=int,
        default=4,
        help="send a request to the replica holding its prompt's prefix unless that replica has this many more "
        "requests in flight than the least-loaded one",
    )
    g.add_argument(
        "--address",
        default=None,
        help="the Ray cluster to join (default: $RAY_ADDRESS, else the one `ray start` made on this machine, "
        "else a new one-machine Ray)",
    )


def serve_argv(args: argparse.Namespace) -> list[str]:
    """The serve flags in `args` written back as a command line (the replicas parse it as `cpuserve serve`)."""
    from cpuserve.server.serve_flags import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    argv: list[str] = []
    seen: set[str] = set()  # a dest two flags set (--disable-log-requests, --enable-log-requests): its first
    for action in parser._actions:
        if action.dest == "help" or action.dest in seen:
            continue
        seen.add(action.dest)
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        if not action.option_strings:
            argv.append(str(value))
        elif isinstance(action, argparse.BooleanOptionalAction):
            argv.append(f"--{'' if value else 'no-'}{action.option_strings[0].removeprefix('--')}")
        elif action.nargs == 0:
            argv.append(action.option_strings[0])
        elif isinstance(value, list) and action.nargs in ("+", "*"):
            argv += [action.option_strings[0], *map(str, value)]
        elif isinstance(value, list):  # one JSON value (the CORS lists)
            argv += [action.option_strings[0], json.dumps(value)]
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def replica_env() -> dict[str, str]:
    """cpuserve's and the reference's settings from this shell, for replicas on any machine."""
    return {k: v for k, v in os.environ.items() if k.startswith(("CPUSERVE_", "VLLM_")) and k not in PER_REPLICA_ENV}


def replica_argv(args: argparse.Namespace) -> tuple[list[str], argparse.Namespace, str | None]:
    """The replicas' serve flags, as they will parse them (checked here first), and the API key.

    The key from this shell's VLLM_API_KEY is written into the flags: replicas on other machines
    do not see this environment.
    """
    from cpuserve.cluster.replica import serve_args
    from cpuserve.server.serve_flags import check_serve_args, local_tokenizer

    argv = serve_argv(args)
    parsed = serve_args(argv)
    check_serve_args(parsed)
    local_tokenizer(parsed.tokenizer)  # here, not in each replica after Ray has started
    http_only = ("uvicorn_log_level", "root_path", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs")
    http_only += ("allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials", "disable_fastapi_docs")
    default = serve_args([])
    for name in http_only:
        if getattr(parsed, name) != getattr(default, name):
            raise CpuserveError(
                f"--{name.replace('_', '-')}: replicas run no HTTP server of their own (Ray Serve's proxy serves HTTP)"
            )
    api_key = parsed.api_key or os.environ.get("VLLM_API_KEY") or None
    if api_key and not parsed.api_key:
        argv += ["--api-key", api_key]
    return argv, parsed, api_key


def engine_options(args: argparse.Namespace, parsed: argparse.Namespace) -> dict[str, Any]:
    """The engine deployment's Ray Serve options: replica count or autoscaling, CPUs, router, health."""
    from ray.serve.config import RequestRouterConfig

    lo = args.min_replicas if args.min_replicas is not None else args.replicas
    hi = args.max_replicas if args.max_replicas is not None else args.replicas
    if not 0 < lo <= args.replicas <= hi:
        raise CpuserveError(
            f"replicas: need 1 <= --min-replicas ({lo}) <= --replicas ({args.replicas}) <= --max-replicas ({hi})"
        )
    if args.threads_per_replica < 1:
        raise CpuserveError("--threads-per-replica must be at least 1")
    scaling: dict[str, Any] = {"num_replicas": args.replicas}
    if lo != hi:
        scaling = {
            "autoscaling_config": {
                "min_replicas": lo,
                "max_replicas": hi,
                "initial_replicas": args.replicas,
                "target_ongoing_requests": args.target_ongoing_requests,
            }
        }
    return {
        "name": "cpuserve-engine",
        "ray_actor_options": {"num_cpus": args.threads_per_replica, "runtime_env": {"env_vars": replica_env()}},
        # Above what the engine itself takes (--max-num-seqs running, --max-waiting-requests queued), so
        # a full engine answers its own 503 at once and the ingress tries another replica; Ray's queue
        # in front of them all is bounded too (past it: BackPressureError, 503 from the ingress).
        "max_ongoing_requests": parsed.max_num_seqs + parsed.max_waiting_requests + ONGOING_MARGIN,
        "max_queued_requests": parsed.max_waiting_requests,
        "request_router_config": RequestRouterConfig(
            request_router_class="cpuserve.cluster.router.PrefixAwareRouter",
            request_router_kwargs={"imbalance": args.prefix_imbalance},
            request_routing_stats_period_s=1.0,
            request_routing_stats_timeout_s=10.0,
        ),
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": parsed.shutdown_timeout,
        **scaling,
    }


def build_application(args: argparse.Namespace) -> Any:
    """The Serve application: the engine deployment (autoscaled, prefix-routed) and the ingress."""
    from ray import serve

    from cpuserve.cluster.ingress import Ingress
    from cpuserve.cluster.replica import EngineReplica

    argv, parsed, api_key = replica_argv(args)
    engines = serve.deployment(EngineReplica, **engine_options(args, parsed))
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name="cpuserve-ingress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000,  # it only forwards; the engines' limits are the real ones
        graceful_shutdown_timeout_s=parsed.shutdown_timeout + 10,  # outlives the engines' drain
    )
    return ingress.bind(engines.bind(argv, args.threads_per_replica), api_key, parsed.max_request_bytes)


def build(config: dict[str, Any]) -> Any:
    """`serve run cpuserve.cluster.app:build model=PATH replicas=2 serve_args='--max-num-seqs 32'`
    (or a Serve config file's `args`): each key a flag of `cpuserve cluster`, true for a switch."""
    from cpuserve.server.serve_flags import add_serve_args

    parser = argparse.ArgumentParser(prog="cpuserve.cluster.app:build", exit_on_error=False)
    add_serve_args(parser)
    add_cluster_args(parser)
    argv = shlex.split(str(config.get("serve_args", "")))
    if config.get("model"):
        argv.insert(0, str(config["model"]))
    for key, value in config.items():
        if key in ("model", "serve_args") or value is False or value is None:
            continue
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise CpuserveError(f"cpuserve.cluster.app:build: {exc}") from None
    if unknown:
        raise CpuserveError(f"cpuserve.cluster.app:build: unrecognized arguments: {' '.join(unknown)}")
    return build_application(args)


PROXY_WAIT_S = 90.0  # Ray restarts a proxy that missed its health checks (seen taking >10 s on 2 busy cores)


def _proxy_answers(host: str, port: int, wait: float = PROXY_WAIT_S) -> bool:
    """Whether Ray Serve's proxy answers where we said it would (its route table, /-/routes) within
    `wait` seconds: a proxy Ray is restarting answers again, one that listens elsewhere never does."""
    import time
    import urllib.request

    probe = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    deadline, waiting = time.monotonic() + wait, False
    while True:
        try:
            with urllib.request.urlopen(f"http://{probe}:{port}/-/routes", timeout=5) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        if not waiting:
            log.info("Ray Serve's proxy does not answer on %s:%d yet: asking for up to %.0f s", probe, port, wait)
            waiting = True
        time.sleep(1.0)


# Ray Serve gives its HTTP proxy 3 checks of 5 s to start, then kills it and `serve.start` fails. On
# a 2-core machine that is busy (the test suite's other lane, a replica loading) its Python worker
# took longer. The Serve controller reads this variable: it is started with 30 s a check (or the
# value in cpuserve's environment), on a Ray we start and on one we join (serve.start waits 60 s).
PROXY_READY_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_READY_S = "30"


def run_cluster(args: argparse.Namespace) -> int:
    """Deploy on the Ray cluster and serve until SIGTERM/SIGINT; then delete the app (replicas drain)."""
    import ray
    from ray import serve

    app = build_application(args)
    address = args.address or os.environ.get("RAY_ADDRESS")
    started_here = False
    if address is None:
        try:
            ray.init(address="auto", logging_level=logging.WARNING)
        except ConnectionError:
            log.info("no Ray cluster on this machine: starting a one-machine Ray")
            os.environ.setdefault("RAY_worker_niceness", "0")  # engines at normal priority (replica.py)
            ray.init(logging_level=logging.WARNING)
            started_here = True
    else:
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except ConnectionError as exc:
            raise CpuserveError(f"no Ray cluster at {address}: {exc}") from None
    resources = ray.cluster_resources()
    log.info(
        "Ray cluster: %d node(s), %g CPUs; %d replica(s) of %d thread(s)",
        len([n for n in ray.nodes() if n.get("Alive")]),
        resources.get("CPU", 0),
        args.replicas,
        args.threads_per_replica,
    )
    proxy_ready = {PROXY_READY_ENV: os.environ.get(PROXY_READY_ENV, PROXY_READY_S)}
    serve.start(
        http_options={"host": args.host, "port": args.port},
        controller_options={"runtime_env": {"env_vars": proxy_ready}},
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    except Exception as exc:
        serve.delete(APP_NAME)  # nothing half-deployed left on a cluster we joined
        raise CpuserveError(f"the application did not deploy: {exc}") from None
    if not _proxy_answers(args.host, args.port):
        serve.delete(APP_NAME)
        raise CpuserveError(
            f"Ray Serve on this cluster does not listen on {args.host}:{args.port}: it was started before with "
            "other HTTP options, which Ray keeps (`serve shutdown` there, or give its --host/--port)"
        )
    log.info(
        "listening on http://%s:%d (OpenAI API under /v1; /health and /metrics cover every replica)",
        args.host,
        args.port,
    )
    stop.wait()
    log.info("stopping: replicas finish their requests (up to %.0f s)", args.shutdown_timeout)
    serve.delete(APP_NAME)
    if started_here:
        serve.shutdown()
        ray.shutdown()
    return 0
