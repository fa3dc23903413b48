"""`make demo` / `maru-dynamo demo`: the main job on the embedded defaults.

Starts a local graph on this machine (nats-server, Dynamo's frontend in KV-router mode and a
`dynamo.vllm` worker on the offline `tiny` model), sends a completion and a chat request
through the frontend and prints what came back, then stops everything.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from pathlib import Path

from maru_vllm.launch import ProcessGroup
from maru_vllm.launch import stack


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="run the demo graph on the embedded defaults")
    p.add_argument("--model-size", default="tiny", choices=["tiny", "bench"], help="fixture model (default tiny)")
    p.add_argument("--keep-logs", action="store_true", help="print where the logs are and keep them")
    p.set_defaults(func=run_demo)


def _post(url: str, payload: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(payload).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def run_demo(args: argparse.Namespace) -> int:
    from maru_vllm.models import ensure_model

    model = str(ensure_model(args.model_size))
    work = Path(tempfile.mkdtemp(prefix="maru-demo-"))
    logs = work / "logs"
    print(f"[demo] model {model}\n[demo] logs in {logs}")
    with ProcessGroup() as group:
        nats, nats_url = stack.nats_server(logs)
        group.start(nats).wait_for_log("Server is ready", timeout=30)
        env = stack.StackEnv(discovery_dir=work / "discovery", nats_url=nats_url)
        worker = group.start(stack.dynamo_vllm_worker("worker", model, env.build(cpu_thread=0), logs))
        frontend, url = stack.dynamo_frontend(env.build(), logs)
        group.start(frontend)
        print("[demo] waiting for the worker to register with the frontend ...")
        frontend.wait_for_http(f"{url}/v1/models", timeout=300, accept=lambda b: model.encode() in b)
        t = time.monotonic()
        out = _post(f"{url}/v1/completions", {"model": model, "prompt": "Maru shares KV. " * 20,
                                               "max_tokens": 16, "temperature": 0})
        print(f"[demo] completion ({time.monotonic() - t:.2f}s): {out['choices'][0]['text']!r}")
        print(f"[demo] usage: {out['usage']}")
        del worker
    return 0
