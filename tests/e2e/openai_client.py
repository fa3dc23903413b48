"""Tiny OpenAI-API client for tests (stdlib only, loopback servers)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def post_json(url: str, payload: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def get_json(url: str, timeout: float = 30.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def completion(
    base_url: str, model: str, prompt: str | list[int], max_tokens: int = 8, logprobs: int | None = None, **extra: Any
) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    if logprobs is not None:
        payload["logprobs"] = logprobs
    return post_json(f"{base_url}/v1/completions", payload)


def cached_tokens(response: dict[str, Any]) -> int:
    details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)
