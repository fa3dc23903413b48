"""A deterministic prefix-sharing chat workload: shared system prompts, multi-turn sessions.

Shape (everything in byte tokens, ids 32..126 of the fixture models' byte-level tokenizer, so a
prompt of N ids is exactly N prompt tokens through the completions API):

* ``systems`` system prompts of ``system_tokens`` tokens each;
* ``sessions`` sessions, session ``s`` bound to system prompt ``s % systems``, or, with
  ``hot_sessions`` = H > 0, the first H sessions all bound to system prompt 0 (a popular
  assistant: the hot prefix that KV routing piles onto one worker) and the others to
  ``(s - H) % systems``;
* ``turns`` turns per session: turn ``t``'s prompt is the session's system prompt, then for each
  earlier turn its user message and a fixed assistant reply, then turn ``t``'s user message::

      prompt(s, t) = system[k(s)] + user(s, 0) + reply(s, 0) + ... + reply(s, t-1) + user(s, t)

* requests go out one at a time, interleaved turn by turn across sessions (all sessions' turn 0,
  then all turn 1, ...): session ``s`` turn ``t`` is request ``t * sessions + s``.

The assistant replies are fixed pseudo-text from the seed, not the model's completions. The
fixture models have random weights, so their completions carry no meaning that a realistic
workload would need, and a prompt that depends on an earlier completion would make every later
prompt depend on the engine's numerics (thread count, batch shape, worker). With fixed replies
the whole request list is known before the run, identical for every configuration compared and
for every run, and unit-testable; only where requests are routed (and so what is cached where)
differs. The price is that an engine's cached decode tokens never match the next turn (they
would not match token-for-token in a real chat either once a template re-renders the reply);
the next turn reuses the previous prompt, which is what prefix caching and the pool hold.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Iterator

TOKEN_LO, TOKEN_HI = 32, 127  # printable bytes: one token each in the fixture tokenizer


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    systems: int = 2
    sessions: int = 5  # odd: round-robin over 2 workers must not pin sessions by accident
    turns: int = 3
    system_tokens: int = 640
    user_tokens: int = 96
    assistant_tokens: int = 64
    seed: int = 0
    hot_sessions: int = 0  # the first N sessions share system prompt 0 (0: sessions cycle over the prompts)

    def __post_init__(self) -> None:
        for field in ("systems", "sessions", "turns", "system_tokens", "user_tokens"):
            if getattr(self, field) < 1:
                raise ValueError(f"WorkloadSpec.{field} must be >= 1, got {getattr(self, field)}")
        if self.assistant_tokens < 0:
            raise ValueError(f"WorkloadSpec.assistant_tokens must be >= 0, got {self.assistant_tokens}")
        if not 0 <= self.hot_sessions <= self.sessions:
            raise ValueError(
                f"WorkloadSpec.hot_sessions must be between 0 and sessions ({self.sessions}), got {self.hot_sessions}"
            )
        used = {self.system_of(s) for s in range(self.sessions)}
        if len(used) < self.systems:
            raise ValueError(
                f"{self.sessions} sessions ({self.hot_sessions} of them hot) cannot cover {self.systems} system prompts"
            )

    def system_of(self, session: int) -> int:
        """The system prompt session `session` is bound to."""
        if session < self.hot_sessions:
            return 0
        return (session - self.hot_sessions) % self.systems

    def prompt_tokens(self, turn: int) -> int:
        """Length of any session's prompt at `turn`."""
        return self.system_tokens + turn * (self.user_tokens + self.assistant_tokens) + self.user_tokens


@dataclasses.dataclass(frozen=True)
class Request:
    index: int  # position in the send order
    session: int
    turn: int
    system: int  # which system prompt the session is bound to
    prompt: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.prompt)


@dataclasses.dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    system_prompts: tuple[tuple[int, ...], ...]
    requests: tuple[Request, ...]

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(r) for r in self.requests)

    def unique_prefix_tokens(self) -> int:
        """Tokens of the prefix tree of all prompts: what an ideal shared cache computes once each.

        A lower bound on prefill work (engines cache whole blocks only and always compute a
        prompt's last token, so real counts are higher).
        """
        total = 0
        for i, r in enumerate(self.requests):
            shared = max((_common_prefix(r.prompt, q.prompt) for q in self.requests[:i]), default=0)
            total += len(r) - shared
        return total


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _rng(seed: int, *label: object) -> random.Random:
    """An independent, stable stream per (seed, label): adding sessions never changes others."""
    digest = hashlib.sha256(repr((seed, *label)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n))


def build_workload(spec: WorkloadSpec) -> Workload:
    """The request list of `spec`, identical on every call with the same spec."""
    systems = tuple(_tokens(_rng(spec.seed, "system", k), spec.system_tokens) for k in range(spec.systems))
    history: list[tuple[int, ...]] = []
    for s in range(spec.sessions):
        history.append(systems[spec.system_of(s)])
    requests: list[Request] = []
    for t in range(spec.turns):
        for s in range(spec.sessions):
            user = _tokens(_rng(spec.seed, "user", s, t), spec.user_tokens)
            prompt = history[s] + user
            requests.append(Request(len(requests), s, t, spec.system_of(s), prompt))
            reply = _tokens(_rng(spec.seed, "assistant", s, t), spec.assistant_tokens)
            history[s] = prompt + reply
    return Workload(spec, systems, tuple(requests))
