"""Images: a vision-language model's prompts through `graph run`, Dynamo's frontend and the pool.

The `vlm` fixture (a tiny BLIP-2, `maru_vllm.fixtures.vlm`) on two Maru workers with Dynamo's
`--enable-multimodal`; images sent as PNG data URLs through the frontend's chat completions API.
Two images, one text: both prompts are the same token ids (the image's 16 placeholder tokens,
then the text), and only vLLM's block hashes tell them apart (they carry the image's hash).

* the same text with another image never shares a chunk: the second image's prompt is computed
  and stored as chunks of its own, and the two answers differ;
* worker B, which never saw either, loads each prompt from the pool, and the answer (tokens and
  logprobs) equals worker A's cold answer and A's local prefix-cache hit bit for bit;
* what Dynamo's KV router credits for an image prompt every worker holds (measured: none);
* afterwards the pool holds no pin and no reservation.
"""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import pytest
from PIL import Image

from maru_dynamo.graphs.client import cached_tokens, chat_completion
from maru_vllm.fixtures.models import ensure_model
from maru_vllm.pool import PoolClient
from tests.e2e.conftest import CHUNK
from tests.e2e.test_disagg_roles import settled
from tests.e2e.test_graph_supervision import GraphRun
from tests.e2e.test_spec_decode_graph import instance_id
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e]

TEXT = "Describe the picture. " * 30  # 660 byte tokens: with the image's 16 and the template's, 2 chunks
WHOLE = 2 * CHUNK


def data_url(color: tuple[int, int, int]) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


RED, GREEN = data_url((200, 30, 30)), data_url((30, 200, 30))


def ask(url: str, model: str, image: str, worker: int | None) -> dict:
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": TEXT}]
    extra = {"nvext": {"backend_instance_id": worker}} if worker is not None else {}
    return chat_completion(
        url, model, [{"role": "user", "content": content}], max_tokens=8, logprobs=True, top_logprobs=1, **extra
    )


def answer(out: dict) -> list[tuple[str, float]]:
    return [(t["token"], t["logprob"]) for t in out["choices"][0]["logprobs"]["content"]]


def objects(address: str) -> int:
    with PoolClient.connect(address) as c:
        return int(c.stats()["objects"])


def router_credits(frontend_log: Path) -> list[int]:
    """The overlap (blocks) Dynamo's KV router credited the worker it picked, request by request."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", frontend_log.read_text(errors="replace"))
    return [int(n) for n in re.findall(r"route request completed.*?overlap_blocks=(\d+)", text)]


@pytest.mark.timeout(600)
def test_images_through_the_frontend_never_share_chunks_and_load_bit_identical(tmp_path: Path) -> None:
    model = ensure_model("vlm")
    graph = tmp_path / "vlm.yaml"
    graph.write_text(
        json.dumps(
            {
                "name": "maru-vlm",
                "model": str(model),
                "pool": {"name": "kv", "size": "256M"},
                "workers": [{"name": "worker", "replicas": 2, "args": ["--enable-multimodal"]}],
            }
        )
    )
    run = GraphRun(str(graph))
    work: Path | None = None
    passed = False
    try:
        work = Path(run.wait_line(r"logs in (/\S+)/logs", timeout=60).group(1))
        url = run.wait_line(r"\[graph\] ready: (http://127\.0\.0\.1:\d+) \(2 workers\)", timeout=400).group(1)
        logs = work / "logs"
        a, b = (instance_id(logs / f"worker-worker-{i}.log") for i in range(2))
        pool = f"unix://{work}/pool-kv.sock"
        before = objects(pool)  # the warm-ups' chunks

        red = ask(url, str(model), RED, a)
        assert cached_tokens(red) == 0
        wait_until(lambda: objects(pool) == before + 2, 30, "the red prompt's two chunks committed")
        green = ask(url, str(model), GREEN, a)
        assert cached_tokens(green) == 0  # same token ids, another image: no hit, local or pool
        assert answer(green) != answer(red)  # the image reaches the model
        wait_until(lambda: objects(pool) == before + 4, 30, "the green prompt's two chunks of its own")

        cold = {"red": red, "green": green}
        from_pool = {"red": ask(url, str(model), RED, b), "green": ask(url, str(model), GREEN, b)}
        local = {"red": ask(url, str(model), RED, a), "green": ask(url, str(model), GREEN, a)}
        for image in cold:
            assert cached_tokens(from_pool[image]) == WHOLE, image  # the whole chunks, from the pool
            assert cached_tokens(local[image]) >= WHOLE, image  # vLLM's own cache hits block by block
            assert answer(from_pool[image]) == answer(cold[image]) == answer(local[image]), image
        assert objects(pool) == before + 4

        routed_before = len(router_credits(logs / "frontend.log"))
        routed = ask(url, str(model), RED, None)  # both workers hold it; the router picks
        assert answer(routed) == answer(red)
        credits = wait_until(
            lambda: (c := router_credits(logs / "frontend.log"))[routed_before:] and c,
            10,
            "the router's decision logged",
        )
        credit = credits[-1]
        print(
            f"[e2e] images: each image's {WHOLE} whole-chunk tokens loaded from the pool, bit-identical; "
            f"router credit for an image prompt both workers hold: {credit} blocks"
        )
        # Dynamo 1.6.1's router matches an image prompt to none of the workers' blocks (vLLM's,
        # keyed with the image's hash): it credits nothing, where it credits the same text
        # without an image once a worker holds it.
        assert credit == 0
        text_only = [{"role": "user", "content": TEXT}]
        chat_completion(url, str(model), text_only, max_tokens=1, nvext={"backend_instance_id": a})
        wait_until(lambda: objects(pool) == before + 6, 30, "the text prompt's two chunks committed")
        routed_before = len(router_credits(logs / "frontend.log"))
        chat_completion(url, str(model), text_only, max_tokens=1)
        text_credit = wait_until(
            lambda: (c := router_credits(logs / "frontend.log"))[routed_before:] and c[-1], 10, "the text decision"
        )
        print(f"[e2e] router credit for the same text without an image: {text_credit} blocks")
        assert text_credit > 0
        with PoolClient.connect(pool) as c:
            wait_until(lambda: settled(c), 60, what="no pins and no reservations in the pool")
        passed = True
    finally:
        run.stop(work, keep_logs=not passed)
