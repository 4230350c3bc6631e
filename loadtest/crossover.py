"""``prefix-router crossover``: when loading a prefix from host memory beats recomputing it.

The seed chapter's second exercise. A prompt of L tokens whose KV sits in the host
tier can be loaded over PCIe (a copy's latency plus L x the KV bytes per token over
the link's bandwidth, then one block computed for the logits) or recomputed (a
prefill of L tokens). Recomputing a short prompt hides under the weight read that
every step pays anyway, so it is nearly free; the copy always pays its latency and
bytes. Past a prompt length, the crossover, loading wins, and by a factor that grows
with the length (prefill grows faster than linearly, the copy linearly).

Both costs come from the engine's own cost model (``replica/api/cost_model.py``): the
same arithmetic decides, request by request, whether the engine loads or recomputes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replica.api.cost_model import LINKS, PROFILES, CostProfile, HostLink
from replica.api.identity import DEFAULT_BLOCK_SIZE

#: Prompt lengths swept, in tokens: 16 to 128k on a doubling-and-a-half grid.
LENGTHS = tuple(sorted({int(16 * 2 ** (k / 2)) // 16 * 16 for k in range(27)}))


@dataclass(frozen=True)
class Costs:
    """Time to the first token of an L-token prompt held in host memory."""

    tokens: int
    recompute_s: float
    load_s: float

    @property
    def load_wins(self) -> bool:
        return self.load_s < self.recompute_s


def costs(profile: CostProfile, link: HostLink, tokens: int, block: int) -> Costs:
    held = (tokens - 1) // block * block  # the engine computes at least the last token
    load = profile.load_time(held, 1, link) + profile.prefill_time(held, tokens - held)
    return Costs(tokens, profile.prefill_time(0, tokens), load)


def crossover(profile: CostProfile, link: HostLink, block: int = DEFAULT_BLOCK_SIZE) -> int:
    """The shortest prompt (in whole blocks) from which loading always beats recomputing."""
    tokens = 16 * 2**17
    low, high = block, tokens
    while high - low > block:  # loading wins at ``high``, loses at ``low``
        middle = (low + high) // 2 // block * block
        if costs(profile, link, middle, block).load_wins:
            high = middle
        else:
            low = middle
    return high


def add_crossover_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "crossover",
        help="when loading a prefix from host memory beats recomputing it, per profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--profiles", default=",".join(PROFILES), help="comma-separated")
    parser.add_argument("--links", default=",".join(LINKS), help="comma-separated")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--out", metavar="DIR", help="write crossover.md and crossover.png")
    parser.set_defaults(run=run_crossover)


def run_crossover(args: argparse.Namespace) -> int:
    profiles = [_pick(PROFILES, name, "profile") for name in args.profiles.split(",") if name]
    links = [_pick(LINKS, name, "host link") for name in args.links.split(",") if name]
    table = crossover_table(profiles, links, args.block_size)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "crossover.md").write_text(
            f"# prefix-router crossover\n\n{table}\n\n![costs](crossover.png)\n"
        )
        crossover_chart(profiles, links, args.block_size, out / "crossover.png")
        print(f"wrote {out / 'crossover.md'}", file=sys.stderr)
    return 0


def crossover_table(profiles: Sequence[CostProfile], links: Sequence[HostLink], block: int) -> str:
    """One row per profile and link: the crossover, and both costs at three lengths."""
    lines = [
        "| profile | link | crossover (tokens) | 1k: recompute / load | 8k | 32k |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for profile in profiles:
        for link in links:
            cells = [
                f"{_ms(c.recompute_s)} / {_ms(c.load_s)}"
                for c in (costs(profile, link, n, block) for n in (1024, 8192, 32768))
            ]
            point = crossover(profile, link, block)
            lines.append(
                f"| {profile.name} | {link.name} | {point:,} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


def crossover_chart(
    profiles: Sequence[CostProfile], links: Sequence[HostLink], block: int, path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(profiles), figsize=(5 * len(profiles), 4), squeeze=False)
    for axis, profile in zip(axes[0], profiles, strict=True):
        lengths = [n for n in LENGTHS if n >= block]
        recompute = [costs(profile, links[0], n, block).recompute_s * 1e3 for n in lengths]
        axis.plot(lengths, recompute, color="#c44e52", label="recompute (prefill)")
        for link, style in zip(links, ("-", "--", ":"), strict=False):
            load = [costs(profile, link, n, block).load_s * 1e3 for n in lengths]
            axis.plot(lengths, load, style, color="#4c72b0", label=f"load over {link.name}")
            point = crossover(profile, link, block)
            axis.axvline(point, linestyle=style, color="#999999", linewidth=0.8)
        axis.set(
            xscale="log", yscale="log", title=profile.name, xlabel="prompt tokens in host memory"
        )
        axis.set_ylabel("time to first token (ms)")
        axis.grid(True, which="both", alpha=0.2)
        axis.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _pick(registry: dict[str, Any], name: str, what: str) -> Any:
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(registry)}")
    return registry[name]
