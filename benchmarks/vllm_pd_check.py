"""Does a KV cache handed from one vLLM server to another really arrive? (vLLM's CPU build)

Prefill/decode disaggregation with vLLM's own KV connectors, one prefill server (P) and
one decode server (D) on this machine, against a reference server (R) without a
connector that computes every prompt itself:

- ``ExampleConnector`` (files on a shared path): P prefills a 1,500-token prompt with
  ``max_tokens`` 1 and vLLM's P/D request (``kv_transfer_params`` with
  ``do_remote_decode``), D decodes 32 tokens greedily with what P answered. D's tokens
  and log-probabilities are compared with R's; then the stored KV of another prompt is
  overwritten with noise between the two calls (D must answer differently: the loaded
  KV is used, not recomputed), and that of a third is deleted (D must compute it itself).
- ``NixlConnector`` with ``kv_buffer_device: cpu``: the same P/D exchange through NIXL
  (UCX); then D is given the ``kv_transfer_params`` of another prompt of the same
  length. NIXL is not in vLLM's CPU build: ``--nixl-path DIR`` puts a folder holding
  its Python packages (the ``nixl`` meta package and ``nixl_cu12``, unpacked from their
  wheels) on the servers' ``PYTHONPATH``; without it the script reports how vLLM fails.

Prints one row per call: TTFT, the cached tokens vLLM reports, the largest difference
of a generated token's log-probability from R's, and whether the tokens are R's.

    python -m benchmarks.vllm_pd_check --model reports/tiny-model [--nixl-path DIR] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from deploy.processes import free_port
from replica.vllm_server import Ports, VLLMConfig, VLLMServer

PROMPT_TOKENS, DECODE_TOKENS = 1500, 32
ENGINE_ARGS = ("--kv-cache-memory-bytes", "16M", "--max-model-len", "4096")
#: vLLM's P/D request to a prefill server (as its toy proxy sends it).
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
LOG_MARKS = (
    "External Cache Hit!",
    "Inject KV cache",
    "attn_metadata is None",
    "KV Transfer metrics",
)


class Server(VLLMServer):
    """A project vLLM server with extra environment variables (PYTHONPATH, NIXL's port)."""

    def __init__(self, name: str, config: VLLMConfig, env: dict[str, str]) -> None:
        super().__init__(config, "127.0.0.1", Ports(free_port(), free_port(), free_port()))
        self.name, self.extra_env = name, env

    def environment(self, workdir: Path) -> dict[str, str]:
        return super().environment(workdir) | self.extra_env

    def log(self) -> str:
        path = self.workdir / "server.log" if self.workdir else None
        return path.read_text(errors="replace") if path and path.exists() else ""


@dataclass
class Answer:
    ttft_ms: float
    cached: int | None
    tokens: list[str]
    logprobs: list[float]
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class Row:
    call: str
    answer: Answer
    reference: Answer | None
    expect: str  # "same" or "different"


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 7900) for _ in range(PROMPT_TOKENS)]


def complete(
    server: Server, tokens: list[int], max_tokens: int, params: dict[str, Any] | None = None
) -> Answer:
    """Greedy completion with ``kv_transfer_params``. Streamed (for the TTFT) but for a
    prefill (``max_tokens`` 1): vLLM returns the KV's whereabouts only in a whole answer,
    whose latency is then the TTFT."""
    body = {
        "model": server.config.model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        **({"kv_transfer_params": params} if params else {}),
    }
    url = f"{server.url}/v1/completions"
    start = time.perf_counter()
    if max_tokens == 1:
        answer = httpx.post(url, json=body, timeout=300).raise_for_status().json()
        choice = answer["choices"][0]["logprobs"]
        return Answer(
            (time.perf_counter() - start) * 1000,
            answer["usage"]["prompt_tokens_details"]["cached_tokens"],
            choice["tokens"],
            choice["token_logprobs"],
            answer.get("kv_transfer_params"),
        )
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    ttft, out, logprobs, cached = 0.0, [], [], None
    with httpx.stream("POST", url, json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                ttft = ttft or (time.perf_counter() - start) * 1000
                out += choice["logprobs"]["tokens"]
                logprobs += choice["logprobs"]["token_logprobs"]
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return Answer(ttft, cached, out, logprobs)


def start(servers: list[Server], stack: contextlib.ExitStack) -> None:
    for server in servers:
        stack.callback(server.stop)
        server.launch()
    for server in servers:
        server.wait_ready()
        complete(server, prompt(1000)[:100], 2)  # a first answer with log-probs takes seconds


def keep_logs(servers: list[Server], folder: Path) -> None:
    for server in servers:
        (folder / f"{server.name}.log").write_text(server.log())


def idle_cpu(server: Server, seconds: float = 3.0) -> float:
    """Cores a server's processes keep busy while it serves nothing."""
    import psutil

    assert server.process is not None
    guard = psutil.Process(server.process.pid)
    group = [guard, *guard.children(recursive=True)]

    def busy() -> float:
        with contextlib.suppress(psutil.Error):
            return sum(p.cpu_times().user + p.cpu_times().system for p in group)
        return 0.0

    before = busy()
    time.sleep(seconds)
    return (busy() - before) / seconds


def example_connector(args: argparse.Namespace, work: Path, ref: Server) -> list[Row]:
    config = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(work / "kv")},
    }
    engine = (*ENGINE_ARGS, "--kv-transfer-config", json.dumps(config))
    p = Server("example-P", VLLMConfig(args.model, engine, cpus=(0,)), {})
    d = Server("example-D", VLLMConfig(args.model, engine, cpus=(1,)), {})
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        start([p, d], stack)
        stack.callback(keep_logs, [p, d], work)
        for name, seed, spoil in (("P/D", 1, None), ("noise", 2, "noise"), ("deleted", 3, "rm")):
            reference = complete(ref, prompt(seed), DECODE_TOKENS)
            rows.append(Row(f"R  {name}: computes it itself", reference, None, "same"))
            if spoil is None:
                again = complete(ref, prompt(seed), DECODE_TOKENS)
                rows.append(Row(f"R  {name}: again, from its cache", again, reference, "same"))
            before = set((work / "kv").glob("*"))
            prefill = complete(p, prompt(seed), 1, PREFILL_PARAMS)
            rows.append(Row(f"P  {name}: prefill, max_tokens 1", prefill, None, "same"))
            print(f"P's kv_transfer_params ({name}): {prefill.kv_transfer_params}")
            (stored,) = set((work / "kv").glob("*")) - before
            if spoil == "rm":
                shutil.rmtree(stored)
            elif spoil == "noise":
                spoil_files(stored)
            decode = complete(d, prompt(seed), DECODE_TOKENS, prefill.kv_transfer_params)
            expect = "different" if spoil == "noise" else "same"
            label = {None: "decode", "noise": "decode, KV files noise", "rm": "decode, KV deleted"}
            rows.append(Row(f"D  {name}: {label[spoil]}", decode, reference, expect))
    return rows


def spoil_files(folder: Path) -> None:
    """Overwrite every layer's stored KV with noise of the same shape."""
    import torch
    from safetensors.torch import load_file, save_file

    for path in folder.glob("*.safetensors"):
        kv = load_file(str(path))["kv_cache"]
        save_file({"kv_cache": torch.randn(kv.shape).to(kv.dtype)}, str(path))


def nixl(args: argparse.Namespace, work: Path, references: dict[int, Answer]) -> list[Row]:
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [args.nixl_path, os.environ.get("PYTHONPATH")]))
    }

    def server(name: str, role: str, cpu: int) -> Server:
        config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        engine = (*ENGINE_ARGS, "--kv-transfer-config", json.dumps(config))
        port = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        return Server(name, VLLMConfig(args.model, engine, cpus=(cpu,)), env | port)

    p, d = server("nixl-P", "kv_producer", 0), server("nixl-D", "kv_consumer", 1)
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        try:
            start([p, d], stack)
        except RuntimeError as error:  # vLLM's CPU build without NIXL
            (work / "nixl-error.log").write_text(str(error))
            cause = [line for line in str(error).splitlines() if "Error: " in line]
            print(f"NixlConnector did not start: {cause[0] if cause else error}")
            return rows
        print(f"idle, in cores: nixl-P {idle_cpu(p):.2f}, nixl-D {idle_cpu(d):.2f}")
        prefills = {seed: complete(p, prompt(seed), 1, PREFILL_PARAMS) for seed in (4, 5)}
        print(f"P's kv_transfer_params (NIXL): {short(prefills[5].kv_transfer_params)}")
        # Prompt 4's blocks go to a decode of prompt 5 first: a prefill's blocks are
        # freed on P once read.
        for name, seed, given in (("other prompt's KV", 5, 4), ("P/D", 5, 5)):
            rows.append(Row(f"P  NIXL {name}: prefill", prefills[given], None, "same"))
            params = prefills[given].kv_transfer_params
            with contextlib.suppress(httpx.HTTPError):  # D's own prefix cache: empty
                httpx.post(f"{d.url}/reset_prefix_cache", timeout=10)
            decode = complete(d, prompt(seed), DECODE_TOKENS, params)
            expect = "same" if seed == given else "different"
            rows.append(Row(f"D  NIXL {name}: decode", decode, references[seed], expect))
        time.sleep(11)  # vLLM logs its transfer metrics every 10 s
        keep_logs([p, d], work)
    return rows


def short(params: dict[str, Any] | None) -> str:
    if not params:
        return str(params)
    blocks = params.get("remote_block_ids") or [[]]
    shown = {**params, "remote_block_ids": f"[{len(blocks[0])} blocks: {blocks[0][:3]}...]"}
    return json.dumps(shown)


def table(rows: list[Row]) -> None:
    print(f"\n{'call':<42} {'TTFT ms':>8} {'cached':>6} {'max |dlogprob|':>14}  tokens  expected")
    for row in rows:
        a, ref = row.answer, row.reference
        delta = (
            max(abs(x - y) for x, y in zip(a.logprobs, ref.logprobs, strict=True)) if ref else None
        )
        same = None if ref is None else a.tokens == ref.tokens and delta == 0
        verdict = "" if ref is None else ("OK" if same == (row.expect == "same") else "NOT MET")
        print(
            f"{row.call:<42} {a.ttft_ms:8.0f} {a.cached!s:>6} "
            f"{'' if delta is None else f'{delta:.2e}':>14}  "
            f"{'' if same is None else ('= R' if same else '!= R'):>6}  {row.expect} {verdict}"
        )


def log_lines(folder: Path) -> None:
    for path in sorted(folder.glob("*.log")):
        lines = [
            line for line in path.read_text().splitlines() if any(m in line for m in LOG_MARKS)
        ]
        print(f"\n{path.name}: {len(lines)} connector lines")
        for line in lines[:8]:
            print(f"  {line[:360]}")


@contextlib.contextmanager
def terminated_cleanly() -> Iterator[None]:
    """SIGTERM as SystemExit, so that every server is stopped however the run ends."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="reports/tiny-model", help="a Hugging Face folder")
    parser.add_argument("--nixl-path", help="a folder with the nixl and nixl_cu12 packages")
    parser.add_argument("--keep", action="store_true", help="keep the KV files and server logs")
    args = parser.parse_args()
    args.model = str(Path(args.model).resolve())
    work = Path(tempfile.mkdtemp(prefix="vllm-pd-check-"))
    rows: list[Row] = []
    try:
        with terminated_cleanly(), contextlib.ExitStack() as stack:
            ref = Server("reference", VLLMConfig(args.model, ENGINE_ARGS, cpus=(0,)), {})
            start([ref], stack)
            references = {5: complete(ref, prompt(5), DECODE_TOKENS)}  # before NIXL spins
            rows += example_connector(args, work, ref)
            rows += nixl(args, work, references)
    finally:
        table(rows)
        log_lines(work)
        if args.keep:
            print(f"\nKV files and logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
