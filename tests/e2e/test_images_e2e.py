"""Images: a vision-language model's prompts through the pool, on a real vLLM CPU engine.

The `vlm` fixture (a tiny BLIP-2, `maru_vllm.fixtures.vlm`) behind vLLM's own OpenAI server with
the connector; images sent as PNG data URLs through the chat completions API. Two images, one
text: both prompts are the same token ids (the image's 16 placeholder tokens, then the text),
and only vLLM's block hashes tell them apart (they carry the image's hash as an extra key).

* the same text with another image never shares a chunk: the second image's prompt is computed
  and stored as chunks of its own, and the two answers differ;
* after the engine's prefix cache is reset, each prompt is loaded from the pool, and the answer
  (tokens and logprobs) equals the cold one and the local prefix-cache hit bit for bit;
* afterwards the pool holds no pin and no reservation.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from maru_dynamo.graphs.client import cached_tokens, chat_completion, post_json
from maru_vllm.fixtures.models import ensure_model
from maru_vllm.launch import ProcessGroup, free_port, stack
from maru_vllm.pool import PoolClient
from tests.e2e.conftest import CHUNK, maru_kv_config, start_pool
from tests.e2e.test_disagg_roles import settled
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e]

TEXT = "Describe the picture. " * 30  # 660 byte tokens: with the image's 16, two whole chunks
WHOLE = 2 * CHUNK


def data_url(color: tuple[int, int, int]) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


RED, GREEN = data_url((200, 30, 30)), data_url((30, 200, 30))


@pytest.fixture(scope="module")
def engine(module_procs: ProcessGroup, module_log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    pool = start_pool(module_procs, module_log_dir, "images")
    env = stack.StackEnv(discovery_dir=tmp_path_factory.mktemp("images") / "discovery").build(cpu_thread=0)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    model = ensure_model("vlm")
    proc, url = stack.vllm_openai_server(
        "vlm",
        model,
        env,
        module_log_dir,
        port=free_port(),
        max_model_len=2048,
        kv_transfer_config=maru_kv_config(pool.address, maru_pool_deadline_ms=5000),
        extra_args=["--max-num-batched-tokens", "512", "--max-num-seqs", "4"],
    )
    module_procs.start(proc)
    proc.wait_for_http(f"{url}/v1/models", timeout=300)
    return proc, url, str(model), pool


def ask(url: str, model: str, image: str) -> dict:
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": TEXT}],
        }
    ]
    return chat_completion(url, model, messages, max_tokens=8, logprobs=True, top_logprobs=1)


def answer(out: dict) -> list[tuple[str, float]]:
    return [(t["token"], t["logprob"]) for t in out["choices"][0]["logprobs"]["content"]]


def objects(pool: stack.PoolProcess) -> int:
    with PoolClient.connect(pool.address) as c:
        return int(c.stats()["objects"])


def test_images_never_share_chunks_and_load_bit_identical(engine: tuple) -> None:
    proc, url, model, pool = engine
    assert "stands aside" not in proc.log_text()
    red = ask(url, model, RED)
    assert red["usage"]["prompt_tokens_details"]["multimodal_tokens"] == {"image": 16}
    assert cached_tokens(red) == 0
    wait_until(lambda: objects(pool) == 2, 30, "the red prompt's two chunks committed")
    green = ask(url, model, GREEN)
    assert cached_tokens(green) == 0  # same token ids, another image: no hit, local or pool
    assert answer(green) != answer(red)  # the image reaches the model
    wait_until(lambda: objects(pool) == 4, 30, "the green prompt's two chunks of its own")

    wait_until(lambda: post_json(f"{url}/reset_prefix_cache", {})["success"], 60, "prefix cache reset")
    from_pool = {"red": ask(url, model, RED), "green": ask(url, model, GREEN)}
    local = {"red": ask(url, model, RED), "green": ask(url, model, GREEN)}
    cold = {"red": red, "green": green}
    for image in cold:
        assert cached_tokens(from_pool[image]) == WHOLE, image  # the whole chunks
        assert cached_tokens(local[image]) >= WHOLE, image  # vLLM's own cache hits block by block
        assert answer(from_pool[image]) == answer(cold[image]) == answer(local[image]), image
    assert objects(pool) == 4
    print(f"[e2e] images: 2 images x {WHOLE} whole-chunk tokens, each loaded from the pool, bit-identical")
    with PoolClient.connect(pool.address) as c:
        wait_until(lambda: settled(c), 60, what="no pins and no reservations in the pool")
