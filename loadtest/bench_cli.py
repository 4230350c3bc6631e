"""``prefix-router bench``: the command, its report and its charts (see loadtest/bench/)."""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deploy.flags import (
    add_config_flags,
    add_engine_flags,
    add_option_flags,
    config_flags,
    config_overrides,
    engine_args,
    helped,
    shell_words,
)
from deploy.fleet import parse_entry
from loadtest import bench, plots, sglang, timeline_plots, vllm_router
from loadtest.bench import BenchConfig
from loadtest.report import (
    MODEL_KEYS,
    Row,
    command_line,
    format_table,
    model_rows,
    version,
    write_json,
)
from loadtest.timeline import Timeline
from loadtest.workloads import ChatConfig, workload_kind, workload_usage
from replica.api.config import ReplicaConfig
from replica.api.engines import ENGINES, SIM
from replica.api.fleet_token import fleet_token

TABLE_KEYS = (
    "label",
    "requests",
    "failures",
    "token_hit_rate",
    "host_hit_rate",
    "client_token_hit_rate",
    "replay_token_hit_rate",
    "block_hit_rate",
    "evictions",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "replay_ttft_p50_s",
    "replay_ttft_p99_s",
    "e2e_p50_s",
    "throughput_rps",
    "imbalance",
    "prediction_accuracy",
    "prediction_exact",
    "prediction_within_block",
    "prediction_over",
    "cpu_busy",
)
#: What P/D is for: goodput, and the latencies it is made of, live beside the replay.
GOODPUT_KEYS = (
    "label",
    "goodput_rps",
    "replay_goodput_rps",
    "slo_attainment",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "replay_itl_p99_s",
    "token_hit_rate",
    "replay_token_hit_rate",
)

READING = """\
How to read it. Each row is one policy, run live on the same seeded workload after
every replica's cache was emptied:

- `token_hit_rate`: prompt tokens the replicas found in their prefix caches (the
  engines' own count, both tiers); `host_hit_rate` the part loaded from host memory;
  `client_token_hit_rate` is the same from the `cached_tokens` of the answers' usage
  blocks, and the two agree when every request finished.
- `replay_token_hit_rate`, `replay_ttft_*`: what `prefix-router replay` predicts for
  the same workload on a simulated twin of the fleet. A live hit rate more than
  5 points away from it is flagged below.
- `ttft_*`: time to first token measured by the Locust client, end to end through
  the gateway; `e2e_p50_s` the whole answer.
- `imbalance`: the busiest replica's requests over the mean (1.00 is even).
- `prediction_accuracy`: share of requests whose cached tokens the gateway predicted
  within one router stride of the engine's figure (the gateway's block size times its
  `--stride`: 64 tokens by default, 32 in `make demo-vllm`); `prediction_exact`,
  `prediction_within_block` and `prediction_over` the shares it predicted exactly,
  within one KV block, and above the engine's figure.
- `cpu_busy`: mean share of this machine's CPUs in use during the run (all
  processes: Locust, gateway, replicas). Near 100% the machine, not the simulated
  GPUs, would set the latencies; but vLLM's CPU build keeps a core busy while it polls
  for its next step (for a second after each, yielding to any other task), so a vLLM
  fleet reads near 100% at any load that keeps it stepping: there the replay's
  latencies (the engines alone) beside the live ones say more.
"""


@dataclass(frozen=True)
class BenchOptions:
    """``prefix-router bench``'s own flags (deploy/flags.py, add_option_flags), beside the
    engine's, the chat workload's (ChatConfig) and the simulated replicas'
    (ReplicaConfig). Where it runs: an embedded deployment (the default), a Ray cluster
    (``--address``) or any gateway (``--gateway``)."""

    address: str | None = field(
        default=None, metadata=helped("a Ray cluster with `prefix-router up` (e.g. auto)")
    )
    gateway: str | None = field(
        default=None,
        metadata=helped(
            "any gateway or OpenAI-compatible server; several: requests spread at random",
            metavar="URL[,URL...]",
        ),
    )
    fleet_token_file: str = field(
        default="",
        metadata=helped(
            "with --gateway: the token the replicas ask of callers (the bench reads and "
            "empties them), in a file; default: $PREFIX_ROUTER_FLEET_TOKEN",
            metavar="FILE",
        ),
    )
    replicas: int = field(default=4, metadata=helped("embedded deployment's replicas (default: 4)"))
    prefill: int = field(
        default=0,
        metadata=helped(
            "the embedded deployment disaggregated: this many prefill replicas and "
            "--decode decode ones, in place of --replicas (aggregated policies route to "
            "them all; pd_* policies and vllm_router_pd by their roles)",
            metavar="N",
        ),
    )
    decode: int = field(default=0, metadata=helped("see --prefill", metavar="M"))
    gateways: int = field(
        default=1,
        metadata=helped("embedded deployment's gateways, requests spread at random (default: 1)"),
    )
    policies: str = field(
        default=",".join(BenchConfig().policies),
        metadata=helped(
            f"comma-separated (default: {','.join(BenchConfig().policies)}); "
            f"{sglang.LABEL}: SGLang's router in front of the same replicas; "
            f"{vllm_router.LABEL}: vLLM's router in P/D mode in front of them (--prefill); "
            "serve_pow2, serve_prefix_affinity, serve_POLICY: a Ray Serve application of "
            "as many engines (Ray Serve LLM's, of vLLM replicas, when they are vLLM "
            "servers), routed by Serve's default router, Ray Serve LLM's "
            "PrefixCacheAffinityRouter or ours with POLICY (loadtest/ray_serve.py)"
        ),
    )
    with_sglang: bool = field(
        default=False,
        metadata=helped(
            "add a row routed by SGLang's router (sglang-router), started in front of the "
            f"same replicas for its run and stopped after (same as {sglang.LABEL} in --policies)"
        ),
    )
    workload: str = field(default="chat", metadata=helped(f"{workload_usage()} (default: chat)"))
    fleet: tuple[str, ...] = field(
        default=(),
        metadata=helped(
            "repeatable, the embedded deployment's models in place of --replicas: N "
            "replicas of each; the chat workload's sessions ask for them (--chat-models), "
            "and the first model's replicas serve its --chat-adapters",
            metavar="MODEL=N",
        ),
    )
    limit: int = field(default=0, metadata=helped("traces: the first N requests only"))
    seed: int = 0
    model: str = field(
        default=BenchConfig().model,
        metadata=helped(
            "the model requests name; with --engine vllm, the model folder the replicas serve"
        ),
    )
    serve_arg: tuple[str, ...] = field(
        default=(),
        metadata=helped(
            "repeatable; more flags for the embedded `prefix-router serve`, such as the "
            "gateway's: --serve-arg='--stride 1'",
            metavar="FLAGS",
        ),
    )
    users: int = BenchConfig().users
    run_time: float = field(
        default=BenchConfig().run_time_s,
        metadata=helped(
            "upper bound per policy; a run ends once every session is played", metavar="SECONDS"
        ),
    )
    out: str = field(default="reports/bench", metadata=helped("report directory"))
    no_replay: bool = field(default=False, metadata=helped("skip the replay predictions"))
    replay_profile: str = field(
        default="",
        metadata=helped(
            "with --engine vllm: the profile `prefix-router calibrate` wrote for these "
            "engines, so that the replay predicts their fleet beside each live row",
            metavar="FILE",
        ),
    )
    session_keys: bool = field(
        default=False,
        metadata=helped("clients send each session's id as x-session-id (and so does the replay)"),
    )
    no_progress: bool = False
    size_load: float = field(
        default=0.0,
        metadata=helped(
            "before the runs, time one engine (as `prefix-router calibrate` does) and size "
            "the chat load to it: the session rate (and sessions, arriving as long as "
            "given) at which the fleet's twin, routed round robin, is busy this share of "
            "the time; the profile then predicts each row (loadtest/bench/sizing.py)",
            metavar="SHARE",
        ),
    )
    slo_ttft_s: float = field(
        default=BenchConfig().slo_ttft_s,
        metadata=helped("goodput's objective for the time to first token (default: 2)"),
    )
    slo_itl_s: float = field(
        default=BenchConfig().slo_itl_s,
        metadata=helped(
            "goodput's objective for each request's inter-token latency p99 (default: 0.1)"
        ),
    )


def add_bench_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "bench",
        help="compare routing policies under real HTTP load (Locust), with a report",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_option_flags(parser, BenchOptions)
    add_engine_flags(parser, {name: kind.summary for name, kind in ENGINES.items()})
    add_config_flags(parser, ChatConfig, prefix="chat-", skip=("seed",))
    # the workload is bytes4: the replicas' tokenizer is the simulated model's
    skip = ("model", "tokenizer", "chat_template")
    add_config_flags(parser, ReplicaConfig, prefix="replica-", skip=skip)
    parser.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    if args.address and args.gateway:
        raise ValueError("--address and --gateway name one target or the other, not both")
    policies = tuple(p for p in args.policies.split(",") if p)
    if args.with_sglang and sglang.LABEL not in policies:
        policies += (sglang.LABEL,)
    if ENGINES[args.engine].loads_model and Path(args.model).is_dir():  # as `serve` names it
        args.model = str(Path(args.model).resolve())
    config = BenchConfig(
        policies=policies,
        model=args.model,
        trace_limit=args.limit,
        workload=args.workload,
        chat=_chat_overrides(args),
        seed=args.seed,
        users=args.users,
        run_time_s=args.run_time,
        predict=not args.no_replay,
        replay_profile=args.replay_profile,
        session_keys=args.session_keys,
        progress=not args.no_progress,
        slo_ttft_s=args.slo_ttft_s,
        slo_itl_s=args.slo_itl_s,
    )
    if args.size_load:
        bench.check_size_load(args.size_load, args.workload)
    out = Path(args.out)
    with _target(args) as (gateways, description, token):
        print(f"bench: {description}; policies {', '.join(policies)}", file=sys.stderr)
        sizing = None
        if args.size_load:
            config, sizing = bench.sized(config, gateways, token, args.size_load, out)
            print(f"bench: load sized to the engines: {sizing.summary()}", file=sys.stderr)
        rows, fleet, timelines = bench.compare(config, gateways, out, token)
    meta = {
        "seed": config.seed,
        "command": command_line(),
        "version": version(),
        "target": description,
        "workload": config.workload,
        "chat": config.chat_config() if workload_kind(config.workload).chat else None,
        "replica_config": next((asdict(c) for c in fleet.replicas.values() if c), None),
        "cpu_busy": max((r["cpu_busy"] for r in rows), default=None),
        "cpu_count": _cpu_count(),
        "replay": config.predict,
        "sizing": asdict(sizing) if sizing else None,
    }
    print(format_table(rows, TABLE_KEYS))
    if any(row.get("goodput_rps") is not None for row in rows):
        slos = f"TTFT <= {args.slo_ttft_s} s, each request's ITL p99 <= {args.slo_itl_s} s"
        print(f"\ngoodput ({slos}):")
        print(format_table(rows, GOODPUT_KEYS))
    if any(row.get("models") for row in rows):
        print("\nper model (or adapter) named:")
        print(format_table(model_rows(rows), MODEL_KEYS))
    write_report(out, rows, meta, timelines)
    print(f"report: {out / 'report.md'}")
    return 0


@contextlib.contextmanager
def _target(args: argparse.Namespace) -> Iterator[tuple[list[str], str, str]]:
    """The gateways' URLs, what they are, and the fleet's token (its replicas ask it)."""
    if args.gateway:
        urls = [url.rstrip("/") for url in args.gateway.split(",") if url]
        yield urls, f"{_gateways_text(urls)}", fleet_token(args.fleet_token_file)
    elif args.address:
        urls, token = bench.cluster_gateways(args.address)
        yield urls, f"Ray cluster {args.address}, {_gateways_text(urls)}", token
    else:
        flags = _serve_flags(args)
        count = sum(parse_entry(e).replicas for e in args.fleet) if args.fleet else args.replicas
        if args.prefill or args.decode:
            flags += ["--prefill", str(args.prefill), "--decode", str(args.decode)]
            count = args.prefill + args.decode
        print(
            f"bench: starting {count} {args.engine} replicas, {args.gateways} gateway(s)…",
            file=sys.stderr,
        )
        with bench.embedded(count, flags, args.gateways) as (urls, token):
            engine = "" if args.engine == SIM.name else f"{args.engine} "
            models = f" ({', '.join(args.fleet)})" if args.fleet else ""
            replicas = f"{count} {engine}replicas{models}"
            yield urls, f"embedded deployment, {replicas}, {_gateways_text(urls)}", token


def _gateways_text(urls: list[str]) -> str:
    if len(urls) == 1:
        return f"gateway {urls[0]}"
    return f"{len(urls)} gateways ({', '.join(urls)}), requests spread at random"


def _serve_flags(args: argparse.Namespace) -> list[str]:
    """The embedded ``serve``'s flags: a vLLM fleet's model and flags, or the simulated
    replicas' (the user's, else the bench's sizes for its chat workload; traces get what
    the profile's hardware holds); then the user's own."""
    more = [*_fleet_flags(args), *shell_words(args.serve_arg)]
    if vllm_router.LABEL in args.policies.split(","):
        # vLLM's router in P/D mode sends its workers no credential
        print(
            f"bench: {vllm_router.LABEL} sends no credential: the replicas answer anyone",
            file=sys.stderr,
        )
        more.append("--open-replicas")
    if ENGINES[args.engine].loads_model:
        if args.model == BenchConfig().model:
            raise ValueError(
                f"--engine {args.engine} needs --model PATH, the model folder to serve"
            )
        # its own fleet: vLLM's dev mode for /reset_prefix_cache between runs
        engine = ["--engine", args.engine, "--model", args.model, "--vllm-dev-mode"]
        # each word quoted: serve splits its --engine-arg values as a shell would
        return [*engine, *(f"--engine-arg={shlex.quote(arg)}" for arg in engine_args(args)), *more]
    overrides = config_overrides(args, ReplicaConfig, prefix="replica_")
    if workload_kind(args.workload).chat:
        overrides.setdefault("num_blocks", bench.BENCH_REPLICA_BLOCKS)
        overrides.setdefault("host_blocks", bench.BENCH_HOST_BLOCKS)
    return [*config_flags(overrides, prefix="replica-"), *more]


def _chat_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The chat workload's parameters; with ``--fleet``, its sessions ask for the
    fleet's models unless ``--chat-models`` says otherwise."""
    overrides = config_overrides(args, ChatConfig, prefix="chat_")
    if args.fleet and workload_kind(args.workload).chat:
        overrides.setdefault("models", ",".join(parse_entry(e).model for e in args.fleet))
    return overrides


def _fleet_flags(args: argparse.Namespace) -> list[str]:
    """``serve``'s ``--fleet`` flags, the first model serving the workload's adapters."""
    if not args.fleet:
        return []
    entries = [parse_entry(text) for text in args.fleet]
    chat = (
        ChatConfig(**_chat_overrides(args)) if workload_kind(args.workload).chat else ChatConfig()
    )
    flags = []
    for index, entry in enumerate(entries):
        adapters = entry.adapters or (chat.adapter_names if index == 0 else ())
        text = f"{entry.model}={entry.replicas}" + (f":{','.join(adapters)}" if adapters else "")
        flags += ["--fleet", text]
    return flags


def write_report(
    out: Path, rows: Sequence[Row], meta: dict[str, Any], timelines: Mapping[str, Timeline]
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "report.json", rows, meta)
    (out / "timelines.json").write_text(
        json.dumps({label: t.as_dict() for label, t in timelines.items()}) + "\n"
    )
    charts = write_charts(out, rows, timelines)
    busy = meta.get("cpu_busy")
    lines = [
        "# prefix-router bench",
        "",
        f"`{meta['command']}` (seed {meta['seed']}, version {meta['version']})",
        "",
        f"Target: {meta['target']}. Workload: {meta['workload']}"
        + (f" {_chat_summary(meta['chat'])}" if meta.get("chat") else "")
        + ".",
        "",
        format_table(rows, TABLE_KEYS),
        "",
        *_sizing_lines(meta.get("sizing")),
        f"CPU: at most {busy:.0%} busy on average during a run (busiest second "
        f"{max(r['cpu_busy_peak'] for r in rows):.0%}), over {meta['cpu_count']} CPUs."
        if busy is not None
        else "CPU: not measured.",
        "",
        *_event_latency_lines(rows),
        *_over_prediction_lines(rows),
        *_flags(rows, replayed=bool(meta.get("replay", True))),
        READING,
        *(f"![{title}]({name})\n" for name, title in charts.items()),
    ]
    (out / "report.md").write_text("\n".join(lines))


def write_charts(
    out: Path, rows: Sequence[Row], timelines: Mapping[str, Timeline]
) -> dict[str, str]:
    """The report's PNGs, by file name with their titles: the comparison's bars, then
    the runs over time as the gateway's live dashboard shows them."""
    charts = {
        "hit_rate.png": (plots.live_hit_rate_chart, rows, "token hit rate per policy"),
        "ttft.png": (plots.ttft_percentiles_chart, rows, "TTFT per policy"),
        "load.png": (plots.load_chart, rows, "requests per replica"),
        "hit_rate_over_time.png": (
            timeline_plots.hit_rate_over_time_chart,
            timelines,
            "hit rate over time",
        ),
        "ttft_over_time.png": (timeline_plots.ttft_over_time_chart, timelines, "TTFT over time"),
        "replica_load.png": (
            timeline_plots.replica_load_chart,
            timelines,
            "outstanding requests per replica",
        ),
        "cache_occupancy.png": (
            timeline_plots.cache_occupancy_chart,
            timelines,
            "cache occupancy per replica",
        ),
    }
    for name, (chart, data, _) in charts.items():
        chart(data, out / name)  # type: ignore[operator]
    return {name: title for name, (_, _, title) in charts.items()}


def _event_latency_lines(rows: Sequence[Row]) -> list[str]:
    """The KV stream's latency once: it belongs to the transport, not to a policy."""
    last = rows[-1] if rows else {}
    p50, p99 = last.get("kv_event_latency_p50_s"), last.get("kv_event_latency_p99_s")
    if p50 is None or p99 is None:
        return []
    return [
        f"KV events, from the engine's step to the gateways' index: p50 {p50 * 1e3:.1f} ms, "
        f"p99 {p99 * 1e3:.1f} ms (every stream, every gateway, the whole bench).",
        "",
    ]


def _sizing_lines(sizing: dict[str, Any] | None) -> list[str]:
    """How the load was sized to the engines (``--size-load``), if it was."""
    if not sizing:
        return []
    found = bench.Sizing(**sizing)
    timed = f"; the engines' profile (the replay's too): `{found.profile}`" if found.profile else ""
    return [f"Load sized to the engines (`--size-load`): {found.summary()}{timed}.", ""]


def _over_prediction_lines(rows: Sequence[Row]) -> list[str]:
    """Why the engines found fewer cached tokens than predicted, per row that predicted."""
    lines = []
    for row in rows:
        over = row.get("prediction_over")
        if not over:
            continue
        causes = ", ".join(
            f"{row.get(f'prediction_over_{cause}') or 0:.1%} {meaning}"
            for cause, meaning in OVER_CAUSE_MEANINGS.items()
        )
        lines.append(
            f"- **{row['label']}** predicted too many cached tokens for {over:.1%}: {causes}."
        )
    return ["Predictions over the engine's figure, by cause:", "", *lines, ""] if lines else []


#: How the report names each cause of an over-prediction (router/core.py, OVER_CAUSES).
OVER_CAUSE_MEANINGS = {
    "pending": "pending (the router's own decisions ahead of what the engine had stored)",
    "evicted": "evicted while they waited in the engine's queue",
    "unexplained": "unexplained (the events said more and told of no eviction)",
}


def _chat_summary(chat: dict[str, Any]) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in chat.items()) + ")"


def _flags(rows: Sequence[Row], replayed: bool) -> list[str]:
    """What a reader must not miss: how live and replay compare, unfinished runs."""
    lines = [*_replay_lines(rows, replayed)]
    for row in rows:
        if row.get("failures"):
            lines.append(f"- **{row['label']}**: {row['failures']} requests failed.")
        client, engine = row.get("client_cached_tokens"), row.get("cached_tokens")
        if client is not None and engine is not None and client != engine:
            why = (
                "the decode replicas report the prompt they pulled as cached, as vLLM "
                "does; the engines count the hits where each prompt was prefilled"
                if row.get("pulled_tokens")
                else "requests cut off at the end of the run?"
            )
            lines.append(
                f"- **{row['label']}**: clients saw {client} cached tokens, the engines "
                f"counted {engine} ({why})."
            )
    return [*lines, ""]


def _replay_lines(rows: Sequence[Row], replayed: bool) -> list[str]:
    """Say which rows were compared with the replay and how; claim nothing for the rest."""
    agree = [r["label"] for r in rows if r.get("replay_differs") is False]
    unknown = [r["label"] for r in rows if r.get("replay_differs") is None]
    lines = [
        f"- **{r['label']}**: live hit rate {r['token_hit_rate']:.1%} differs from the "
        f"replay's {r['replay_token_hit_rate']:.1%} by more than "
        f"{bench.REPLAY_TOLERANCE:.0%} points."
        for r in rows
        if r.get("replay_differs")
    ]
    if agree:
        tolerance = f"{bench.REPLAY_TOLERANCE * 100:.0f}"
        lines.append(
            f"- Live and replayed hit rates agree within {tolerance} points: {', '.join(agree)}."
        )
    if unknown:
        why = (
            "the target has no simulated twin (not every replica is one of ours, or "
            "several replicas behind a router whose algorithm the replay does not have)"
            if replayed
            else "the replay was skipped (--no-replay)"
        )
        lines.append(f"- Not compared with a replay: {', '.join(unknown)}: {why}.")
    return lines


def _cpu_count() -> int:
    import os

    return os.cpu_count() or 1
