"""Every command block of the user docs (DOCUMENTS: README.md, docs/*.md, deploy/k8s/README.md)
is exercised, so a block that no longer works fails CI.

HOW TO MARK A BLOCK (README authors, read this). Every fenced code block of those files that is
untagged or tagged bash/sh/shell/console/zsh needs an HTML comment (invisible on GitHub) on the
line right before its opening fence, in one of three forms:

  <!-- readme-test: run [NAME] -->
      This test runs the block for real (tests marked e2e, under `make test`): one bash script in
      the repository root (logs in a scratch directory), with the venv's bin/ first on PATH and no
      VLLM_*/DYN_*/NATS_* variable or PYTHONHASHSEED inherited (a fresh user shell). Commands
      ending in `&`, and the long-running
      servers of LONG_RUNNING typed "each in its own terminal", start in the background and must
      still be running at the end. Any other command must exit 0; once a server has been
      started, a command is retried for up to RETRY_S seconds (as a user waits for services to come
      up) while every background command is still running. `curl -s` runs as `curl -sf`, so an
      HTTP error fails. SUBSTITUTIONS make the block
      private to this run (ports, socket and discovery paths, pool name, region size, the MODEL
      placeholder -> the offline tiny model). NAME (optional) picks extra checks or omitted
      commands from RUNS below; without it the block's file and line number name it.
  <!-- readme-test: covered-by tests/path.py::test_name [more refs] [free note] -->
      A clearly equivalent form of the block runs in the named tests (this test checks they exist).
  <!-- readme-test: skip REASON -->
      The block cannot run here (GPU, Kubernetes cluster, docker, CXL device...); REASON says why.

An unmarked block, a `covered-by` naming a test that does not exist, a `skip` without a reason
and a NAME in RUNS that no block uses all fail `test_every_readme_block_is_classified`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import completions
from maru_vllm.launch import free_port
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCUMENTS = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "deploy" / "k8s" / "README.md"]
COMMAND_LANGS = {"", "bash", "sh", "shell", "console", "zsh"}
MARKER = re.compile(r"^<!--\s*readme-test:\s*(run|covered-by|skip)\b(.*?)-->\s*$")
RETRY_S = 300
BLOCK_TIMEOUT_S = 600
# Servers a block may list "each in its own terminal" (without `&`): they run in the background.
LONG_RUNNING = re.compile(
    r"^(\w+=\S*\s+)*(nats-server|maru-dynamo\s+(pool\s+serve|frontend|worker)|"
    r"python3?\s+-m\s+(dynamo\.frontend|dynamo\.vllm|maru_dynamo\.components\.\w+|vllm\.entrypoints\.openai\.api_server))\b"
)


# ---- the README's blocks ---------------------------------------------------------------------
@dataclasses.dataclass
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    body: str
    kind: str | None  # run / covered-by / skip, None when unmarked
    arg: str
    doc: str = "README.md"  # the file, relative to the repository

    @property
    def name(self) -> str:
        if self.kind == "run" and self.arg:
            return self.arg.split()[0]
        return f"line{self.line}" if self.doc == "README.md" else f"{self.doc}:line{self.line}"

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def doc_blocks() -> list[Block]:
    """The command blocks of every document in DOCUMENTS."""
    out = []
    for path in DOCUMENTS:
        doc = str(path.relative_to(REPO))
        out += [dataclasses.replace(b, doc=doc) for b in readme_blocks(path.read_text())]
    return out


def readme_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mk = MARKER.match(prev.strip())
        if lang in COMMAND_LANGS:
            blocks.append(
                Block(
                    start + 1,
                    lang,
                    "\n".join(lines[start + 1 : end]),
                    mk.group(1) if mk else None,
                    mk.group(2).strip() if mk else "",
                )
            )
        i = end + 1
    return blocks


def commands(body: str) -> list[str]:
    """Logical commands: continuation lines joined, blank and comment-only lines dropped."""
    out, cur = [], ""
    for raw in body.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            cur += line[:-1].rstrip() + " "
            continue
        cur += line.strip()
        cur = _strip_comment(cur).strip()
        if cur:
            out.append(cur)
        cur = ""
    return out


def _strip_comment(cmd: str) -> str:
    """`cmd` without a trailing `# comment` (a `#` inside quotes is kept)."""
    for m in re.finditer(r"(^|\s)#", cmd):
        head = cmd[: m.start()]
        if head.count("'") % 2 == 0 and head.count('"') % 2 == 0:
            return head
    return cmd


# ---- running a block -------------------------------------------------------------------------
@dataclasses.dataclass
class Env:
    """What SUBSTITUTIONS put in place of the README's fixed ports, paths and names."""

    tmp: Path
    pool: str
    nats_port: int
    http_port: int
    model: str

    @property
    def pool_address(self) -> str:
        return f"unix://{self.tmp}/kv.sock"


SUBSTITUTIONS: list[tuple[str, Callable[[Env], str]]] = [
    (r"/tmp/maru-kv\.sock", lambda e: f"{e.tmp}/kv.sock"),
    (r"/tmp/maru-discovery", lambda e: f"{e.tmp}/discovery"),
    (r"(--name|--maru-pool-name)(\s+)kv\b", lambda e: rf"\1\2{e.pool}"),
    (r"\b4222\b", lambda e: str(e.nats_port)),
    (r"\b8000\b", lambda e: str(e.http_port)),
    (r"--size\s+\d+G\b", lambda e: "--size 512M"),
    (r"(?<![$\w])MODEL(?![\w=])", lambda e: e.model),
    (r"\bcurl -s\b", lambda e: "curl -sf"),
]


def substitute(cmd: str, env: Env) -> str:
    for pattern, repl in SUBSTITUTIONS:
        cmd = re.sub(pattern, repl(env), cmd)
    return cmd


def script(cmds: list[str], env: Env) -> str:
    """One bash script running `cmds` as described in the module docstring."""
    t = env.tmp
    out = ["set -u", "set -m  # each background command in its own process group", f"cd {REPO}"]
    started = False
    for k, cmd in enumerate(cmds):
        cmd = substitute(cmd, env)
        background = cmd.endswith("&") and not cmd.endswith("&&")
        if background or LONG_RUNNING.match(cmd):
            body = cmd[:-1].rstrip() if background else cmd
            out += [
                f"( {body} ) > {t}/bg{k}.log 2>&1 &",
                f"echo $! >> {t}/pids",
                f"echo 'bg{k}: {_quote(body)}' >> {t}/bgs",
            ]
            started = True
        elif started:
            out += [
                f"deadline=$((SECONDS + {RETRY_S}))",
                f"until {{ {cmd} ; }} > {t}/out{k}.txt 2>&1; do",
                f"  if (( SECONDS > deadline )); then echo 'readme-test: gave up on: {_quote(cmd)}'; "
                f"cat {t}/out{k}.txt; exit 1; fi",
                f"  for p in $(cat {t}/pids); do kill -0 $p 2>/dev/null || "
                f"{{ echo 'readme-test: a background command exited while waiting for: {_quote(cmd)}'; "
                "exit 1; }; done",
                "  sleep 3",
                "done",
            ]
        else:
            out += [
                f"{{ {cmd} ; }} > {t}/out{k}.txt 2>&1 || {{ echo 'readme-test: failed: {_quote(cmd)}'; "
                f"tail -50 {t}/out{k}.txt; exit 1; }}"
            ]
    return "\n".join(out) + "\n"


def _quote(s: str) -> str:
    return s.replace("'", "'\\''")


def clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_", "DYN_", "NATS_")) and k not in ("PYTHONHASHSEED", "PYTHONPATH")
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


class Run:
    def __init__(self, block: Block, env: Env) -> None:
        self.block, self.env = block, env

    def start(self, omit: dict[str, str]) -> subprocess.CompletedProcess:
        cmds = [c for c in commands(self.block.body) if c not in omit]
        (self.env.tmp / "run.sh").write_text(script(cmds, self.env))
        return subprocess.run(
            ["bash", str(self.env.tmp / "run.sh")],
            env=clean_env(),
            cwd=REPO,
            text=True,
            capture_output=True,
            timeout=BLOCK_TIMEOUT_S,
        )

    def background(self) -> list[tuple[int, str]]:
        pids = (self.env.tmp / "pids").read_text().split() if (self.env.tmp / "pids").exists() else []
        names = (self.env.tmp / "bgs").read_text().splitlines() if (self.env.tmp / "bgs").exists() else []
        return list(zip(map(int, pids), names))

    def log(self, name: str) -> str:
        p = self.env.tmp / name
        return p.read_text(errors="replace") if p.exists() else ""

    def stop(self) -> None:
        pids = [pid for pid, _ in self.background()]
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
            for pid in pids:
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(_group_alive(p) for p in pids):
                time.sleep(0.2)
        Path(f"/dev/shm/maru-{self.env.pool}").unlink(missing_ok=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# ---- extra checks and omissions per named block ------------------------------------------------
def completion_of(run: Run) -> dict:
    """The JSON the block's last curl printed."""
    outs = sorted(run.env.tmp.glob("out*.txt"), key=lambda p: int(p.stem[3:]))
    body = json.loads(outs[-1].read_text())
    assert body["choices"][0]["text"] is not None, body
    return body


def check_graph_serves_and_fills_the_pool(run: Run) -> None:
    """The block's own curl got a completion; a 3-chunk prompt then lands in the pool."""
    from maru_vllm.pool import PoolClient

    completion_of(run)
    model = run.env.model
    prompt = [32 + (i * 7919) % 95 for i in range(3 * 256 + 1)]
    completions(
        f"http://127.0.0.1:{run.env.http_port}",
        {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0},
        timeout=120,
    )
    with PoolClient.connect(run.env.pool_address, heartbeat=False, populate=False) as c:
        for _ in range(100):
            if c.stats()["objects"] >= 3:
                break
            time.sleep(0.1)
        assert c.stats()["objects"] >= 3, c.stats()


def check_pool_serves_on_its_default_socket(run: Run) -> None:
    """The block's `pool serve` (no --listen) answers on the default socket of its name."""
    from maru_vllm.pool import PoolClient
    from maru_vllm.pool.address import default_listen

    socket_path = default_listen(run.env.pool).path
    wait_until(lambda: Path(socket_path).exists(), timeout=60, what="the pool's socket")
    with PoolClient.connect(f"unix://{socket_path}", heartbeat=False, populate=False) as c:
        assert c.stats()["objects"] == 0


@dataclasses.dataclass
class RunSpec:
    omit: dict[str, str] = dataclasses.field(default_factory=dict)  # command -> why it is not run here
    check: Callable[[Run], None] = completion_of


def _no_check(run: Run) -> None:
    pass


RUNS: dict[str, RunSpec] = {
    "quick-start": RunSpec(
        omit={
            "make setup": "CI's first step (.ci/run), which this test runs in",
            "make test": "CI's second step, which runs this test",
        },
        check=_no_check,
    ),
    "pool-on-shm": RunSpec(check=check_pool_serves_on_its_default_socket),
    "aggregated-by-hand": RunSpec(check=check_graph_serves_and_fills_the_pool),
    "disaggregated-by-hand": RunSpec(check=check_graph_serves_and_fills_the_pool),
}


# ---- the tests -------------------------------------------------------------------------------
def _ref_exists(ref: str) -> bool:
    path, _, name = ref.partition("::")
    f = REPO / path
    return f.is_file() and (not name or re.search(rf"^\s*def {re.escape(name)}\(", f.read_text(), re.M) is not None)


def test_every_readme_block_is_classified() -> None:
    blocks = doc_blocks()
    assert any(b.doc == "README.md" for b in blocks), "no command block found in README.md"
    problems = []
    for b in blocks:
        where = b.where
        if b.kind is None:
            problems.append(
                f"{where}: unmarked block; put <!-- readme-test: run|covered-by|skip ... --> right "
                "before it (see tests/test_readme_blocks.py)"
            )
        elif b.kind == "skip" and not b.arg:
            problems.append(f"{where}: 'skip' needs a reason")
        elif b.kind == "covered-by":
            refs = [w for w in b.arg.split() if w.startswith(("tests/", ".ci/"))]
            if not refs:
                problems.append(f"{where}: 'covered-by' names no test")
            problems += [f"{where}: covered-by {r}: no such test" for r in refs if not _ref_exists(r)]
        elif b.kind == "run":
            for cmd in RUNS.get(b.name, RunSpec()).omit:
                if cmd not in commands(b.body):
                    problems.append(f"{where}: RUNS[{b.name!r}] omits {cmd!r}, which the block does not have")
    names = [b.name for b in blocks if b.kind == "run"]
    problems += [f"RUNS[{n!r}] matches no documented block" for n in RUNS if n not in names]
    problems += [f"two blocks are named {n!r}" for n in set(names) if names.count(n) > 1]
    assert not problems, "\n".join(problems)


def test_substitutions_make_a_block_private() -> None:
    env = Env(Path("/t"), "p1", 4000, 9000, "/m")
    cmd = (
        "nats-server -a 127.0.0.1 -p 4222 && maru-dynamo pool serve --name kv --size 8G "
        "--listen unix:///tmp/maru-kv.sock --maru-pool-name kv MODEL $MODEL MODEL=x curl -s localhost:8000"
    )
    assert substitute(cmd, env) == (
        "nats-server -a 127.0.0.1 -p 4000 && maru-dynamo pool serve --name p1 "
        "--size 512M --listen unix:///t/kv.sock --maru-pool-name p1 /m $MODEL MODEL=x "
        "curl -sf localhost:9000"
    )
    assert commands("a \\\n  b\n# c\n\nd &  # e\nf '#g' # h\n") == ["a b", "d &", "f '#g'"]


def test_the_options_table_lists_every_connector_key_with_its_default() -> None:
    """README's kv_connector_extra_config table: exactly maru_vllm.connector.config.KEYS, same defaults."""
    from maru_vllm.connector.config import KEYS

    rows = dict(re.findall(r"^\| `(maru_\w+)` \| ([^|]+) \|", README.read_text(), re.M))
    assert sorted(rows) == sorted(KEYS), "README's options table and connector.config.KEYS differ"

    def matches(cell: str, default: object) -> bool:
        value = cell.strip("`")
        if default is None:
            return cell == "none"
        if isinstance(default, bool):
            return value == str(default).lower()
        if isinstance(default, int | float):
            return float(value) == default
        return json.loads(value) == default

    for key, (default, _) in KEYS.items():
        cell = rows[key].strip()
        assert matches(cell, default) or (key == "maru_pool_address" and cell == "`$MARU_POOL_ADDRESS`"), (
            f"{key}: README says {cell}, the code's default is {default!r}"
        )


HISTORY = re.compile(r"issue #\d+|#\d+'s|\b\d\d:\d\d UTC\b|\bbefore (this|the) change\b|\bwas \d[\d.]*x\b", re.I)


def test_user_docs_describe_the_product_without_history() -> None:
    """No issue numbers, run timestamps or before/after figures in the user docs."""
    found = [
        f"{path.relative_to(REPO)}:{n}: {m.group(0)!r}"
        for path in DOCUMENTS
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for m in HISTORY.finditer(line)
    ]
    assert not found, "\n".join(found)


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", re.sub(r"```.*?```", "", text, flags=re.S), re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-"))
    return out


def test_every_relative_link_in_the_docs_resolves() -> None:
    """Links between the docs (and to files in the repository) name files and headings that exist."""
    problems = []
    for path in DOCUMENTS:
        text = path.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                problems.append(f"{path.relative_to(REPO)}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                problems.append(f"{path.relative_to(REPO)}: {target}: no such heading")
    assert not problems, "\n".join(problems)


def _run_blocks() -> list[Block]:
    return [b for b in doc_blocks() if b.kind == "run"]


@pytest.mark.e2e
@pytest.mark.timeout(BLOCK_TIMEOUT_S + 120)
@pytest.mark.parametrize("block", _run_blocks(), ids=lambda b: b.name)
def test_readme_block_runs(block: Block, tiny_model: Path) -> None:
    spec = RUNS.get(block.name, RunSpec())
    tmp = Path(tempfile.mkdtemp(prefix="rdm-", dir="/tmp"))  # short: unix socket paths are limited
    env = Env(tmp, f"rd{os.getpid()}{block.line}", free_port(), free_port(), str(tiny_model))
    run = Run(block, env)
    try:
        done = run.start(spec.omit)
        bg = run.background()
        report = "\n".join(f"--- {name}\n{run.log(name.split(':')[0] + '.log')[-3000:]}" for _, name in bg)
        assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-2000:]}\n{report}"
        dead = [name for pid, name in bg if not _group_alive(pid) or not _subshell_alive(pid)]
        assert not dead, f"background commands exited: {dead}\n{report}"
        spec.check(run)
    finally:
        run.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _subshell_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
