"""`maru-dynamo graph run|render GRAPH`: run a graph on this machine, or render it for Kubernetes."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from maru_dynamo.graphs.spec import GraphSpecError, load_graph, resolve_graph_path


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: use an integer from 1 to 65535")
    return int(text)


def register(subparsers: Any) -> None:
    graph = subparsers.add_parser("graph", help="run a Maru graph locally, or render it for Kubernetes")
    gsub = graph.add_subparsers(dest="graph_command", metavar="GRAPH_COMMAND")
    graph.set_defaults(func=lambda args: (graph.print_help(), 2)[1])

    run = gsub.add_parser("run", help="start every process of a graph on this machine (loopback only)")
    run.add_argument("graph", help="graph file (graphs/agg.yaml) or bundled graph name (agg, disagg)")
    run.add_argument("--model", help="model directory, HF id or fixture name (default: the graph's)")
    run.add_argument("--http-port", type=_port, help="frontend port on 127.0.0.1 (default: a free port)")
    run.add_argument("--dry-run", action="store_true", help="print each process's command and env; start nothing")
    run.add_argument("--keep-logs", action="store_true", help="keep the work dir with the logs after a clean stop")
    run.add_argument(
        "--prometheus",
        type=_port,
        metavar="PORT",
        help="also run a Prometheus on 127.0.0.1:PORT that scrapes the graph, with the chart's alert rules",
    )
    run.set_defaults(func=cmd_run)

    restart = gsub.add_parser(
        "restart",
        help="restart processes of a running `graph run` one at a time, each back (workers: warm) before the next",
    )
    restart.add_argument(
        "targets", nargs="*", metavar="TARGET", help="a worker (worker-0, as `graph status` names it) or frontend"
    )
    restart.add_argument("--all", action="store_true", help="every worker, in the graph's order")
    restart.add_argument("--work-dir", type=Path, help="the graph's work dir (default: the one running graph)")
    restart.set_defaults(func=cmd_restart)

    status = gsub.add_parser("status", help="the processes of a running `graph run` and the instances it routes to")
    status.add_argument("--work-dir", type=Path, help="the graph's work dir (default: the one running graph)")
    status.add_argument("--json", action="store_true", help="print the status as one JSON object")
    status.set_defaults(func=cmd_status)

    render = gsub.add_parser("render", help="print the Kubernetes manifests (Helm chart deploy/k8s, real Helm engine)")
    render.add_argument("graph", help="graph file (graphs/agg.yaml) or bundled graph name (agg, disagg)")
    render.add_argument("--image", required=True, help="container image built from deploy/Dockerfile")
    render.add_argument(
        "--namespace", default="default", help="namespace of every object (default: default, as `helm template`)"
    )
    render.add_argument("--model", help="model for the workers (default: the graph's kubernetes.model)")
    render.add_argument(
        "--nats-url",
        help="NATS of the Dynamo platform (default: the graph's nats.url or "
        "the chart's nats://dynamo-platform-nats:4222)",
    )
    render.add_argument(
        "-f",
        "--values",
        action="append",
        default=[],
        metavar="FILE",
        help="chart values file layered over the graph's (deploy/k8s/README.md), repeatable",
    )
    render.set_defaults(func=cmd_render)


def _load(name: str) -> Any:
    try:
        return load_graph(resolve_graph_path(name))
    except GraphSpecError as exc:
        sys.exit(f"maru-dynamo graph: error: {exc}")


def cmd_run(args: argparse.Namespace) -> int:
    from maru_dynamo.graphs import plan as graph_plan
    from maru_dynamo.graphs import run as runner

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = _load(args.graph)
    try:
        model = graph_plan.resolve_model(args.model or spec.model, build=not args.dry_run)
        work_dir = runner.new_work_dir()
        plan = graph_plan.build_plan(spec, model=model, work_dir=work_dir, http_port=args.http_port)
    except ValueError as exc:
        sys.exit(f"maru-dynamo graph run: error: {exc}")
    if args.dry_run:
        print(graph_plan.format_plan(plan))
        work_dir.rmdir()
        return 0
    return runner.run_plan(
        plan, keep_logs=args.keep_logs, prometheus_port=args.prometheus, out=lambda line: print(line, flush=True)
    )


def _control(args: argparse.Namespace, command: str, request: Any) -> Any:
    from maru_dynamo.graphs import control

    try:
        work_dir = control.find_work_dir(args.work_dir)
        return control.send(work_dir, request, on_progress=lambda line: print(line, flush=True))
    except control.ControlError as exc:
        sys.exit(f"maru-dynamo graph {command}: error: {exc}")


def cmd_restart(args: argparse.Namespace) -> int:
    from maru_dynamo.graphs.control import ControlRequest

    if args.all == bool(args.targets):
        sys.exit("maru-dynamo graph restart: error: name the targets (worker-0 ..., frontend) or give --all")
    done = _control(args, "restart", ControlRequest("restart", targets=list(args.targets), all_workers=args.all))
    if not done.ok:
        sys.exit(f"maru-dynamo graph restart: error: {done.error}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from maru_dynamo.graphs.control import ControlRequest, format_status

    done = _control(args, "status", ControlRequest("status"))
    if not done.ok or done.status is None:
        sys.exit(f"maru-dynamo graph status: error: {done.error}")
    print(json.dumps(done.status, sort_keys=True) if args.json else format_status(done.status))
    return 0


def _values_file(path: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        sys.exit(f"maru-dynamo graph render: error: --values {path}: cannot read a YAML mapping: {exc}")
    if not isinstance(data, dict):
        sys.exit(f"maru-dynamo graph render: error: --values {path}: not a mapping of chart values")
    return data


def cmd_render(args: argparse.Namespace) -> int:
    from maru_dynamo.graphs.helm import ChartError, HelmUnavailable
    from maru_dynamo.graphs.render import RenderOptions, render_yaml

    spec = _load(args.graph)
    extra = tuple(_values_file(p) for p in args.values)
    try:
        text = render_yaml(
            spec,
            RenderOptions(
                image=args.image, namespace=args.namespace, model=args.model, nats_url=args.nats_url, values=extra
            ),
        )
    except (GraphSpecError, ChartError, HelmUnavailable) as exc:
        sys.exit(f"maru-dynamo graph render: error: {exc}")
    sys.stdout.write(text)
    return 0
