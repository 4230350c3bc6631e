"""A vLLM replica's load, read from its ``/metrics``: vLLM pushes none.

Our replicas push a :class:`~replica.api.stats.LoadReport` every 50 ms; a vLLM server
only exposes gauges to Prometheus. The gateway reads them where it probed the server's
``/health`` (one request instead of two, every ``health_interval_s``): the requests
running and waiting (summed over its data-parallel engines), the KV cache in use (as
free blocks, from the card's ``num_gpu_blocks``) and the LoRA adapters its running
requests use out of ``max_lora`` slots. vLLM does not say how many prompt tokens it has
still to compute: the report carries the gateway's own count of those, for the
requests it sent before the read. Requests sent after the read are added by
``router/fleet/load.py``, as for a pushed report.

The text is scanned for those four gauges alone with regular expressions, not parsed
whole: a server's ``/metrics`` runs to a hundred kilobytes of histograms.
"""

from __future__ import annotations

import re

from replica.api.stats import LoadReport

#: The four gauges' samples, in one pass over the text: each line of theirs, found by
#: its literal start (a line of a longer name that starts alike does not match).
SAMPLE = re.compile(
    r"\n(vllm:(?:num_requests_running|num_requests_waiting|kv_cache_usage_perc"
    r"|lora_requests_info))(?:\{([^}]*)\})? (\S+)"
)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def vllm_load(
    metrics: str,
    num_blocks: int | None,
    prefill_tokens: int,
    ts: float,
    engine: int | None = None,
) -> LoadReport | None:
    """The load in a vLLM server's ``/metrics`` text, read at ``ts`` (wall clock), with
    the ``prefill_tokens`` the gateway knows it has still to compute; ``None`` if the
    text has no vLLM scheduler gauges. ``engine``: one data-parallel rank's load alone
    (else every engine's, summed)."""
    samples: dict[str, list[tuple[str, float]]] = {}
    mine = None if engine is None else f'engine="{engine}"'
    for name, labels, value in SAMPLE.findall("\n" + metrics):
        if mine is None or mine in labels or 'engine="' not in labels:  # or server-wide
            samples.setdefault(name, []).append((labels, float(value)))
    running, waiting = (
        samples.get("vllm:num_requests_running"),
        samples.get("vllm:num_requests_waiting"),
    )
    if running is None or waiting is None:
        return None
    usage = [value for _, value in samples.get("vllm:kv_cache_usage_perc", ())]
    free = None
    if usage and num_blocks:
        free = max(0, round((1.0 - sum(usage) / len(usage)) * num_blocks))
    adapters, free_slots = _adapters(samples.get("vllm:lora_requests_info", []))
    return LoadReport(
        int(sum(value for _, value in running)),
        int(sum(value for _, value in waiting)),
        prefill_tokens,
        ts=ts,
        free_blocks=free,
        adapters=adapters,
        free_adapter_slots=free_slots,
    )


def _adapters(series: list[tuple[str, float]]) -> tuple[tuple[str, ...] | None, int | None]:
    """The adapters of the running requests and the slots left, from the latest
    ``vllm:lora_requests_info`` series (``None``, ``None``: LoRA not enabled)."""
    if not series:
        return None, None
    labels = dict(LABEL.findall(max(series, key=lambda s: s[1])[0]))
    running = tuple(name for name in labels.get("running_lora_adapters", "").split(",") if name)
    slots = labels.get("max_lora", "")
    free = max(0, int(slots) - len(running)) if slots.isdigit() else None
    return running, free
