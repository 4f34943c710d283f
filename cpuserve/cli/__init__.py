"""The `cpuserve` command line: one sub-command per job, user errors as one line on stderr."""

from __future__ import annotations

import argparse
import logging
import sys

from cpuserve import __version__
from cpuserve.cli import bench_args, generate, models
from cpuserve.cli.common import platform_plan
from cpuserve.errors import CpuserveError


def _cmd_serve(args: argparse.Namespace) -> int:
    from cpuserve.server.serve import serve

    return serve(args, platform_plan)


def _cmd_cluster(args: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise CpuserveError("cpuserve cluster needs Ray Serve: pip install 'cpuserve[cluster]'") from None
    from cpuserve.cluster.app import run_cluster

    return run_cluster(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpuserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"cpuserve {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True)

    generate.add_parser(sub)

    from cpuserve.server.serve_flags import add_serve_args

    srv = sub.add_parser("serve", help="serve a model over the OpenAI API (a drop-in for `vllm serve`)")
    add_serve_args(srv)
    srv.set_defaults(func=_cmd_serve)

    from cpuserve.cluster.app import add_cluster_args

    clu = sub.add_parser(
        "cluster", help="serve a model from N replicas on a Ray cluster behind one OpenAI-compatible ingress"
    )
    add_serve_args(clu)
    add_cluster_args(clu)
    clu.set_defaults(func=_cmd_cluster)

    models.add_doctor_parser(sub)
    bench_args.add_parser(sub)
    models.add_quantize_parser(sub)
    models.add_convert_parser(sub)
    return parser


def dashed_flags(argv: list[str]) -> list[str]:
    """Each `--flag_name` (or `--flag_name=value`) spelled `--flag-name`, as vLLM's parser reads
    them (`vllm serve --max_model_len 512` works there); values are left as they are."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(dashed_flags(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="[cpuserve] %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except CpuserveError as exc:
        if args.debug:
            raise
        print(f"cpuserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cpuserve: interrupted", file=sys.stderr)
        return 130
