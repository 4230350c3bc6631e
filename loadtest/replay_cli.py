"""``prefix-router replay``: compare routing policies offline, in virtual time.

For every point of an optional sweep and every policy, replay the workload through
simulated replicas, then add two reference rows: ``infinite_cache`` (the reusable
fraction of the workload: an unlimited cache shared by the whole fleet) and
``single_engine_Nx`` (one engine with the fleet's capacity and compute).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import sys
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from tqdm import tqdm

from deploy.flags import (
    add_config_flags,
    add_option_flags,
    config_overrides,
    helped,
    with_overrides,
)
from loadtest import plots
from loadtest.replay import ReplayConfig, ReplayResult, infinite_cache_bound, replay
from loadtest.report import (
    MODEL_KEYS,
    TENANT_KEYS,
    Row,
    command_line,
    format_table,
    model_rows,
    reference_row,
    replay_row,
    tenant_rows,
    ttft_values,
    version,
    write_json,
)
from loadtest.workloads import (
    ChatConfig,
    Workload,
    WorkloadOptions,
    workload_for,
    workload_kind,
    workload_usage,
)
from router.policies import POLICIES

DEFAULT_POLICIES = "round_robin,power_of_two,sglang_cache_aware,cache_aware"
#: Capacities of ``--sweep-capacity`` without values: from far too small to ample.
DEFAULT_CAPACITY_SWEEP = "128,256,512,1024,2048,4096,8192,16384"
#: The chat workload's default load is per replica, so every fleet size runs at the
#: utilisation the seed chapter's single engine sees.
CHAT_SESSIONS_PER_REPLICA = ChatConfig().num_sessions
CHAT_RATE_PER_REPLICA = ChatConfig().session_rate
SWEEPABLE = {
    "replicas": "replicas",
    "capacity": "capacity_blocks",
    "routers": "routers",
    "fairness": "fairness",
    "pd": "pd",
}
#: The figures P/D exists for, printed when a row disaggregated or pulled.
KV_KEYS = (
    "label",
    "pd",
    "goodput_rps",
    "slo_attainment",
    "token_hit_rate",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "disaggregated_share",
    "pulled_share",
    "pulls_per_second",
    "pulled_gb",
    "pull_fallbacks",
)

FLEET_KEYS = (
    "label",
    "replica_hours",
    "replicas_peak",
    "token_hit_rate",
    "ttft_p50_s",
    "ttft_p99_s",
)
TABLE_KEYS = (
    "label",
    "replicas",
    "capacity_blocks",
    "requests",
    "failures",
    "token_hit_rate",
    "host_hit_rate",
    "block_hit_rate",
    "fraction_of_bound",
    "prefill_tokens_computed",
    "prefill_tokens_saved",
    "evictions",
    "shared_prefix_evictions",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "itl_p99_s",
    "e2e_p50_s",
    "throughput_rps",
    "goodput_rps",
    "imbalance",
    "prediction_accuracy",
)


@dataclass(frozen=True)
class LoadByFleetSize:
    """How the workload's load follows the fleet's size."""

    sessions_per_replica: int = field(
        default=CHAT_SESSIONS_PER_REPLICA,
        metadata=helped(f"chat sessions per replica (default: {CHAT_SESSIONS_PER_REPLICA})"),
    )
    rate_per_replica: float = field(
        default=CHAT_RATE_PER_REPLICA,
        metadata=helped(
            f"chat sessions started per second per replica (default: {CHAT_RATE_PER_REPLICA})"
        ),
    )
    replicas_per_copy: int | None = field(
        default=None,
        metadata=helped(
            "one copy of the trace per this many replicas, each copy a tenant of its own "
            "shifted in time (default: one copy whatever the fleet)"
        ),
    )
    copy_shift_s: float = field(
        default=60.0,
        metadata=helped("the copies start spread over this many seconds (default: 60)"),
    )


@dataclass(frozen=True)
class ReplayOptions:
    """``prefix-router replay``'s own flags (deploy/flags.py, add_option_flags), beside those of
    the fleet (ReplayConfig) and of the chat workload (ChatConfig)."""

    workload: str = field(default="chat", metadata=helped(f"{workload_usage()} (default: chat)"))
    policies: str = field(
        default=DEFAULT_POLICIES,
        metadata=helped(
            f"comma-separated, from: {', '.join(POLICIES)} (default: {DEFAULT_POLICIES})"
        ),
    )
    sweep: str | None = field(
        default=None,
        metadata=helped(
            "rows for several values of replicas, capacity, routers, fairness or pd (a "
            "prefill:decode split), e.g. replicas=1,2,4,8, fairness=fcfs,vtc,prefill or "
            "pd=0:0,2:6,4:4 (0:0: every replica does both)",
            metavar="NAME=V1,V2,...",
        ),
    )
    sweep_capacity: str | None = field(
        default=None,
        metadata=helped(
            f"same as --sweep capacity=... (default list: {DEFAULT_CAPACITY_SWEEP})",
            nargs="?",
            const=DEFAULT_CAPACITY_SWEEP,
            metavar="BLOCKS,...",
        ),
    )
    limit: int | None = field(
        default=None, metadata=helped("replay only the first N trace requests")
    )
    load: LoadByFleetSize = field(
        default_factory=LoadByFleetSize,
        metadata={
            "title": "load by fleet size",
            "description": "chat's sessions and rate grow with the replicas unless "
            "--chat-num-sessions or --chat-session-rate is given; a trace is copied once "
            "per --replicas-per-copy",
        },
    )
    no_reference: bool = field(default=False, metadata=helped("skip the reference rows"))
    json: str | None = field(
        default=None, metadata=helped("write the rows as JSON (DESIGN.md sec. 7)", metavar="PATH")
    )
    out: str | None = field(
        default=None, metadata=helped("write report.md, report.json and PNG charts", metavar="DIR")
    )
    no_progress: bool = field(default=False, metadata=helped("no progress bars"))
    jobs: int = field(
        default=1,
        metadata=helped("replays run at once, one process each (default: 1; memory grows with it)"),
    )


def add_replay_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "replay",
        help="compare routing policies on simulated replicas, in virtual time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_option_flags(parser, ReplayOptions)
    add_config_flags(parser, ReplayConfig)  # the routing knobs too: --stride, --recompute-weight
    add_config_flags(parser, ChatConfig, prefix="chat-", skip=("seed",))
    parser.set_defaults(run=run_replay)


# ------------------------------------------------------------------- set-up


def _sweep(args: argparse.Namespace) -> tuple[str | None, list[int] | list[str]]:
    spec = args.sweep or (f"capacity={args.sweep_capacity}" if args.sweep_capacity else None)
    if spec is None:
        return None, []
    name, _, values = spec.partition("=")
    if name not in SWEEPABLE:
        raise ValueError(
            "--sweep takes replicas=..., capacity=..., routers=..., fairness=... or pd=..., "
            f"got {spec!r}"
        )
    if name in ("fairness", "pd"):  # checked by ReplayConfig
        return SWEEPABLE[name], [v for v in values.split(",") if v]
    try:
        return SWEEPABLE[name], [int(v) for v in values.split(",") if v]
    except ValueError:
        raise ValueError(f"--sweep values must be whole numbers, got {values!r}") from None


def _configs(args: argparse.Namespace) -> tuple[str | None, list[ReplayConfig]]:
    base = with_overrides(ReplayConfig(), config_overrides(args, ReplayConfig))
    key, values = _sweep(args)
    if key is None:
        return None, [base]
    if key == "pd":
        return key, [_split(base, str(value)) for value in values]
    return key, [
        dataclasses.replace(base, **cast(dict[str, Any], {key: value})) for value in values
    ]


def _split(base: ReplayConfig, split: str) -> ReplayConfig:
    """``base`` with the P/D split ``P:D``."""
    prefill, colon, decode = split.partition(":")
    if not (colon and prefill.isdigit() and decode.isdigit()):
        raise ValueError(f"--sweep pd= takes splits P:D (e.g. 2:6), got {split!r}")
    if not int(prefill) + int(decode):  # 0:0, the aggregated fleet of --replicas
        return dataclasses.replace(base, prefill=0, decode=0)
    return dataclasses.replace(base, prefill=int(prefill), decode=int(decode))


def _build_workloads(args: argparse.Namespace, sizes: list[int]) -> None:
    """The workload of every fleet size, into ``_WORKLOADS``, each built once: one per
    size if its kind scales with the fleet (chat's load per replica, a trace copied
    once per ``--replicas-per-copy``), else the same for all. Built before any worker
    forks: the workers share them."""
    _WORKLOADS.clear()
    kind = workload_kind(args.workload)
    built: dict[int, Workload] = {}
    for replicas in sizes:
        options = _workload_options(args, replicas)
        key = replicas if kind.scales_with_fleet(options) else 0  # 0: the same for every size
        if key not in built:
            built[key] = workload_for(args.workload, options)
        _WORKLOADS[replicas] = built[key]


def _workload_options(args: argparse.Namespace, replicas: int) -> WorkloadOptions:
    return WorkloadOptions(
        seed=args.seed if args.seed is not None else ReplayConfig().seed,
        chat=config_overrides(args, ChatConfig, prefix="chat_"),
        limit=args.limit,
        replicas=replicas,
        sessions_per_replica=args.sessions_per_replica,
        rate_per_replica=args.rate_per_replica,
        replicas_per_copy=args.replicas_per_copy,
        copy_shift_s=args.copy_shift_s,
    )


# ------------------------------------------------------------------- running


def run_replay(args: argparse.Namespace) -> int:
    policies = _policies(args)
    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    sweep_key, configs = _configs(args)
    _build_workloads(args, [config.replicas for config in configs])
    jobs = [job for config in configs for job in _jobs(config, policies, sweep_key, args)]
    done = list(zip(jobs, _run_all(jobs, args), strict=True))
    rows: list[Row] = []
    ttfts: dict[str, list[float]] = {}
    for config in configs:
        fleet = [(job, out) for job, out in done if job.fleet is config]
        rows += _fleet_rows(config, fleet, sweep_key, ttfts, args.no_reference)
    _print_tables(rows)
    meta = {"seed": configs[0].seed, "command": command_line(), "version": version()}
    if args.json:
        write_json(args.json, rows, meta)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.out:
        _write_report(Path(args.out), rows, ttfts, sweep_key, meta)
    return 0


def _policies(args: argparse.Namespace) -> list[str]:
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    return policies


def _fleet_rows(
    config: ReplayConfig,
    fleet: list[tuple[_Job, _Done]],
    sweep_key: str | None,
    ttfts: dict[str, list[float]],
    no_reference: bool,
) -> list[Row]:
    """One fleet's rows: a policy's each (its TTFTs into ``ttfts``), then the
    references, each hit rate related to the infinite-cache bound."""
    rows = []
    for job, (row, values, _) in fleet:
        if not job.reference:
            if sweep_key:  # ``routers`` is no field of a replay's row: named here
                row[sweep_key] = getattr(config, sweep_key)
            rows.append(row)
            ttfts[job.label] = values
    rows += [] if no_reference else _reference_rows(config, fleet, sweep_key)
    _relate_to_bound(rows)
    return rows


def _print_tables(rows: list[Row]) -> None:
    """The table of rows, then those of what some rows hold: models, hot prefixes, the
    fleet's size, tenants."""
    print(format_table(rows, TABLE_KEYS))
    if any(row.get("pd", "0:0") != "0:0" or row.get("pulls") for row in rows):
        print("\nKV that moved (goodput: TTFT and ITL p99 within the --slo-* objectives):")
        print(format_table([r for r in rows if "pulls" in r], KV_KEYS))
    if any(row.get("models") for row in rows):
        print("\nper model (or adapter) named:")
        print(format_table(model_rows(rows), MODEL_KEYS))
    for row in rows:
        if row.get("hot_sets"):
            _print_hot_sets(row)
    if any(row.get("fleet_sizes") for row in rows):
        print("\nthe fleet's size (replicas held: serving, starting or stopping):")
        pools = ("prefill_peak", "decode_peak") if any("pool_sizes" in r for r in rows) else ()
        print(format_table(rows, (*FLEET_KEYS[:3], *pools, *FLEET_KEYS[3:])))
    if any(row.get("tenants") for row in rows):
        print("\nper tenant (jain_fairness: Jain's index of their service over fair shares):")
        print(format_table(rows, ("label", "jain_fairness", "token_hit_rate", "ttft_p99_s")))
        print(format_table(tenant_rows(rows), TENANT_KEYS))


def _print_hot_sets(row: Row) -> None:
    print(f"\n{row['label']}: hot prefixes on several replicas (set size from time on):")
    largest_first = sorted(row["hot_sets"].items(), key=lambda item: -item[1]["largest"])
    for prefix, figures in largest_first[:5]:
        steps = ", ".join(f"{n} from {t:.0f} s" for t, n in figures["sizes"])
        print(f"  {prefix}: {steps}")


#: Workloads by fleet size, built by the parent before the workers fork.
_WORKLOADS: dict[int, Workload] = {}


@dataclass(frozen=True)
class _Job:
    """One replay: a policy on a fleet, or the pooled engine that is its reference."""

    fleet: ReplayConfig  # the fleet it belongs to (the pooled engine's own has 1 replica)
    config: ReplayConfig
    policy: str
    label: str
    reference: bool = False
    keep_records: bool = False  # the fleet's first run: the bound follows its arrivals

    @property
    def workload(self) -> Workload:
        return _WORKLOADS[self.fleet.replicas]


#: What a job gives back: its row, its TTFTs, and its records if it keeps them.
_Done = tuple[Row, list[float], ReplayResult | None]


def _jobs(
    config: ReplayConfig, policies: list[str], sweep_key: str | None, args: argparse.Namespace
) -> list[_Job]:
    suffix = f" @ {sweep_key}={getattr(config, sweep_key)}" if sweep_key else ""
    jobs = [
        _Job(config, config, policy, policy + suffix, keep_records=index == 0)
        for index, policy in enumerate(policies)
    ]
    if not args.no_reference and config.replicas > 1 and not config.fleet:  # one engine, one model
        label = f"single_engine_{config.replicas}x" + suffix
        jobs.append(_Job(config, config.pooled(), "round_robin", label, reference=True))
    return jobs


def _run_all(jobs: list[_Job], args: argparse.Namespace) -> list[_Done]:
    """Every job, in order; with ``--jobs`` N > 1, N at a time in forked processes
    (each replay is single-threaded and deterministic, so the rows are the same)."""
    if args.jobs == 1 or len(jobs) == 1:
        return [_run_with_bar(job, args) for job in jobs]
    total = sum(job.workload.num_requests for job in jobs)
    context = multiprocessing.get_context("fork")
    counter = context.Value("q", 0)
    with (
        ProcessPoolExecutor(args.jobs, context, _share_counter, (counter,)) as pool,
        tqdm(
            total=total,
            desc=f"{len(jobs)} replays",
            unit="req",
            disable=args.no_progress,
            file=sys.stderr,
            leave=False,
        ) as bar,
    ):
        # The largest first, so the longest replays do not start last.
        order = sorted(range(len(jobs)), key=lambda i: -jobs[i].workload.num_requests)
        submitted = {i: pool.submit(_run_counted, jobs[i]) for i in order}
        futures = [submitted[i] for i in range(len(jobs))]
        while not all(future.done() for future in futures):
            wait(futures, timeout=0.5, return_when=FIRST_EXCEPTION)
            bar.update(counter.value - bar.n)
        return [future.result() for future in futures]


def _run_with_bar(job: _Job, args: argparse.Namespace) -> _Done:
    bar = tqdm(
        total=job.workload.num_requests,
        desc=job.label,
        unit="req",
        disable=args.no_progress,
        file=sys.stderr,
        leave=False,
    )
    with bar:
        return _run_job(job, bar.update)


_COUNTER: Any = None  # a worker's share of the progress count


def _share_counter(counter: Any) -> None:
    global _COUNTER
    _COUNTER = counter


def _run_counted(job: _Job) -> _Done:
    pending = [0]

    def done() -> None:  # counted in hundreds: a lock per request would cost more
        pending[0] += 1
        if pending[0] == 100:
            with _COUNTER.get_lock():
                _COUNTER.value += pending[0]
            pending[0] = 0

    return _run_job(job, done)


def _run_job(job: _Job, on_request_done: Callable[[], object]) -> _Done:
    result = replay(job.workload, job.config, job.policy, on_request_done)
    row = replay_row(result, job.label)
    # Only the records travel back: a fleet of a thousand holds gigabytes of blocks.
    kept = dataclasses.replace(result, engines=[]) if job.keep_records else None
    return row, ttft_values(result), kept


def _reference_rows(
    config: ReplayConfig, fleet: list[tuple[_Job, _Done]], sweep_key: str | None
) -> list[Row]:
    """The bounds for one fleet, from its runs: the infinite cache, over the first
    run's arrivals, and the pooled engine's row."""
    suffix = f" @ {sweep_key}={getattr(config, sweep_key)}" if sweep_key else ""
    template, _, first = next(done for job, done in fleet if job.keep_records)
    assert first is not None
    bound = infinite_cache_bound(_WORKLOADS[config.replicas], first)
    rows = [
        reference_row(
            "infinite_cache" + suffix,
            template,
            bound.prompt_tokens,
            bound.cached_tokens,
            block_hit_rate=bound.hit_blocks / bound.query_blocks if bound.query_blocks else None,
        )
    ]
    for job, (row, _, _) in fleet:
        if job.reference:
            row.update(
                policy=None, replicas=config.replicas, capacity_blocks=config.capacity_blocks
            )
            if sweep_key:  # drawn at the point it stands for (``routers``: one engine, any G)
                row[sweep_key] = getattr(config, sweep_key)
            rows.append(row)
    return rows


def _relate_to_bound(rows: list[Row]) -> None:
    """Each row's token hit rate as a fraction of the infinite-cache bound."""
    bound = next((r for r in rows if r["label"].startswith("infinite_cache")), None)
    if bound is None or not bound["token_hit_rate"]:
        return
    for row in rows:
        if row["token_hit_rate"] is not None:
            row["fraction_of_bound"] = row["token_hit_rate"] / bound["token_hit_rate"]


def _write_report(
    out: Path, rows: list[Row], ttfts: dict[str, list[float]], sweep_key: str | None, meta: dict
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "report.json", rows, meta)
    charts = ["hit_rate.png", "ttft.png", "load.png"]
    plots.hit_rate_chart(rows, out / charts[0])
    plots.ttft_chart(ttfts, out / charts[1])
    plots.load_chart([r for r in rows if r.get("policy")], out / charts[2])
    if sweep_key and sweep_key != "fairness":
        charts.append("sweep.png")
        plots.sweep_chart(rows, sweep_key, out / charts[-1])
    if any(row.get("tenants") for row in rows):
        charts.append("tenants.png")
        plots.tenant_ttft_chart(rows, out / charts[-1])
    if any(row.get("fleet_sizes") for row in rows):
        charts.append("fleet_size.png")
        plots.fleet_size_chart(rows, out / charts[-1])
    if any(row.get("hot_sets") for row in rows):
        charts.append("hot_sets.png")
        plots.hot_sets_chart(rows, out / charts[-1])
    lines = [
        "# prefix-router replay",
        "",
        f"`{meta['command']}` (seed {meta['seed']}, version {meta['version']})",
        "",
        format_table(rows, TABLE_KEYS),
        "",
        "Rates are fractions of prompt tokens (blocks); `fraction_of_bound` is the token hit",
        "rate over the infinite-cache bound; `imbalance` is the busiest replica's requests",
        "over the mean; `prediction_accuracy` is the share of requests whose predicted",
        "cached tokens were within one router stride of the engine's figure.",
        "",
        *(f"![{name}]({name})" for name in charts),
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    print(f"wrote {out / 'report.md'}", file=sys.stderr)
