"""The compatibility matrix: each supported upstream release against each level of checks.

Levels, cheapest first:

* static    - every upstream symbol our code touches, looked up in each release's sources
              (`static.py`; vLLM, LMCache and Dynamo releases);
* scheduler - the connector's scheduler tests under each vLLM release's own scheduler
              (`scheduler.py`; the release's sources over `.venv`);
* engines   - the connector's end-to-end tests in real vLLM engines of a release installed here
              (`engines.py`; `.venv` and `.venv-compat`, made by `make setup` / `make compat`).

It prints one row per release and one column per level, and records the cells it ran in
`docs/compat-matrix.json` (keys sorted; each cell with the date it ran; cells it did not run are
kept from the file). Exit status 1 when a cell that ran failed.

    python scripts/compat/matrix.py                          # `make compat` (after setup_compat.sh)
    python scripts/compat/matrix.py --levels scheduler --vllm 0.34.0
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for `scripts.compat`
from maru_vllm.versions import DYNAMO, LMCACHE, VLLM, release_numbers
from scripts.compat.engines import environments, run_engines_level
from scripts.compat.scheduler import LevelResult, run_scheduler_level
from scripts.compat.sources import REPO

LEVELS = ("static", "scheduler", "engines")
OUT = REPO / "docs" / "compat-matrix.json"
Cell = dict[str, Any]


def _today() -> str:
    return datetime.date.today().isoformat()


def _load_static() -> Callable[..., dict] | None:
    try:
        from scripts.compat.static import run_static_level
    except ImportError:
        return None
    return run_static_level


def static_cells(vllm_versions: list[str], others: bool) -> dict[str, Cell]:
    run_static_level = _load_static()
    releases = {VLLM.dist: vllm_versions}
    if others:
        releases |= {LMCACHE.dist: list(LMCACHE.releases), DYNAMO.dist: list(DYNAMO.releases)}
    keys = [f"{d}=={v}" for d, vs in releases.items() for v in vs]
    if run_static_level is None:
        return {k: {"status": "not run", "detail": "scripts/compat/static.py is not in this checkout"} for k in keys}
    report = run_static_level(releases)
    cells = {}
    for key in keys:
        row = report["releases"].get(key)
        if row is None:
            cells[key] = {"status": "not run", "detail": "not in the static report"}
            continue
        missing = [m["symbol"] for m in row["missing"]]
        cells[key] = {
            "status": "fail" if missing else "pass",
            "detail": f"{row['checked']} symbols, {len(row['handled'])} moved/absent and handled"
            + (f", missing: {', '.join(missing)}" if missing else ""),
            "checked": row["checked"],
            "missing": missing,
        }
    return cells


def tests_cell(res: LevelResult) -> Cell:
    if res.first_error.startswith("not run"):
        return {"status": "not run", "detail": res.first_error.removeprefix("not run: ")}
    detail = f"{res.passed} passed, {res.failed} failed" + (f", {res.skipped} skipped" if res.skipped else "")
    if res.first_error:
        detail += f": {res.first_error}"
    cell: Cell = {
        "status": "pass" if res.ok else "fail",
        "detail": detail,
        "passed": res.passed,
        "failed": res.failed,
        "skipped": res.skipped,
    }
    if res.failing:
        cell["failing"] = res.failing
    if res.waived:
        cell["waived"] = res.waived
    if res.skip_reasons:
        cell["skip_reasons"] = res.skip_reasons
    return cell


def run_matrix(levels: list[str], vllm_versions: list[str], others: bool, log: Callable[[str], None]) -> dict:
    """{release key: {level: cell}} for the levels and releases asked for."""
    rows: dict[str, dict[str, Cell]] = {f"{VLLM.dist}=={v}": {} for v in vllm_versions}
    if "static" in levels:
        log("[compat] static level ...")
        start = time.monotonic()
        for key, cell in static_cells(vllm_versions, others).items():
            rows.setdefault(key, {})["static"] = cell
        log(f"[compat]   done ({time.monotonic() - start:.0f}s)")
    if "scheduler" in levels:
        for v in vllm_versions:
            log(f"[compat] scheduler level, vllm {v} ...")
            res = run_scheduler_level(v)
            rows[f"{VLLM.dist}=={v}"]["scheduler"] = cell = tests_cell(res)
            log(f"[compat]   {cell['status']} ({res.seconds:.0f}s): {cell['detail']}")
    if "engines" in levels:
        envs = environments()
        for v in vllm_versions:
            log(f"[compat] engines level, vllm {v} ({envs[v].name if v in envs else 'no environment'}) ...")
            res = run_engines_level(v, envs.get(v))
            rows[f"{VLLM.dist}=={v}"]["engines"] = cell = tests_cell(res)
            log(f"[compat]   {cell['status']} ({res.seconds:.0f}s): {cell['detail']}")
    today = _today()
    for row in rows.values():
        for cell in row.values():
            cell["date"] = today
    return rows


def merge(old: dict, rows: dict[str, dict[str, Cell]]) -> dict:
    releases = {k: dict(v) for k, v in old.get("releases", {}).items()}
    for key, cells in rows.items():
        releases.setdefault(key, {}).update(cells)
    return {"levels": list(LEVELS), "releases": releases}


def format_table(matrix: dict) -> str:
    def order(key: str) -> tuple[int, tuple[int, ...]]:
        dist, version = key.split("==")
        rank = [VLLM.dist, LMCACHE.dist, DYNAMO.dist]
        return (rank.index(dist) if dist in rank else len(rank), release_numbers(version))

    width = max([len(k) for k in matrix["releases"]] + [7])
    lines = [f"{'release':<{width}}  " + "  ".join(f"{lv:<9}" for lv in LEVELS)]
    details = []
    for key in sorted(matrix["releases"], key=order):
        cells = matrix["releases"][key]
        marks = []
        for lv in LEVELS:
            cell = cells.get(lv)
            status = "-" if cell is None else cell["status"].upper() if cell["status"] == "fail" else cell["status"]
            marks.append(f"{status:<9}")
            if cell is not None and (cell["status"] != "pass" or lv != "static"):
                details.append(f"  {key} {lv}: {cell['detail']}")
        lines.append(f"{key:<{width}}  " + "  ".join(marks))
    return "\n".join(lines + ["", *details])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default=",".join(LEVELS), help=f"comma-separated, of {','.join(LEVELS)}")
    parser.add_argument("--vllm", action="append", help="only this vLLM release (repeatable; default: all supported)")
    parser.add_argument("--out", type=Path, default=OUT, help="the JSON file to update (default: %(default)s)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave the JSON file alone")
    args = parser.parse_args(argv)
    levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    unknown = sorted(set(levels) - set(LEVELS))
    if unknown:
        parser.error(f"unknown level(s) {', '.join(unknown)}; choose from {', '.join(LEVELS)}")
    versions = args.vllm or list(VLLM.releases)
    outside = [v for v in versions if v not in VLLM.releases]
    if outside:
        parser.error(f"vLLM {', '.join(outside)} is not a supported release ({', '.join(VLLM.releases)})")
    rows = run_matrix(levels, versions, others=not args.vllm, log=lambda s: print(s, flush=True))
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    matrix = merge(old, rows)
    print()
    print(format_table({"releases": rows}))
    if not args.no_write:
        args.out.write_text(json.dumps(matrix, indent=2, sort_keys=True) + "\n")
        print(f"\n[compat] wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")
    failed = [f"{k} {lv}" for k, cells in rows.items() for lv, c in cells.items() if c["status"] == "fail"]
    if failed:
        print(f"[compat] FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
