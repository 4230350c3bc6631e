"""When a backend joins: does it cache prompts as the router hashes them?

Precise routing is only as good as the agreement between router and engine: the same
block size, the same tokenizer and chat template, and KV events whose blocks key to
the identities the router computes for the same prompt. A backend that disagrees in
any of these would be routed blind, its events dropped or keyed to nothing. So each
joining backend is checked, in this order, stopping at the first disagreement:

1. **block size**: what the engine says of itself (its card: our ``/stats``, vLLM's
   ``vllm:cache_config_info``) against the router's ``--block-size``;
2. **tokenizer**: the engine's ``POST /tokenize`` (vLLM's, and ours) of a canary
   completion prompt, of a canary conversation, and of that conversation with a tool
   and a template argument (which vLLM renders into the chat template, and so must the
   gateway: ``replica/api/chat_variables.py``), against the gateway's own tokens;
3. **events**: a canary prompt, fresh (it opens with a random nonce), is sent to the
   backend alone; the ``BlockStored`` events it causes must key
   (``router/index/event_keys.py``) to the router's identities of that prompt.

Until its check passes a backend is routed approximately; one that passes is routed
precisely (what it published meanwhile read again). One that fails is routed approximately
(from the router's own decisions, its events ignored), never blind, and the verdict
names what differs and the flag that fixes it: logged once, shown in ``/stats``,
``prefix-router status`` and the dashboard. A check that cannot be made (an engine with
no ``/tokenize``, a block size it does not say) is skipped and said so.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from replica.api.card import EngineCard
from replica.api.chat_variables import tokenize_variables
from replica.api.fleet_token import ENV_FLEET_TOKEN
from replica.api.identity import identity_seed, prefix_keys
from replica.api.kv_events import KVEvent
from replica.api.tokenizer import TOKEN_DTYPE, WORDS, Message, Tokenizer
from router.fleet.data_parallel import RANK_HEADER
from router.fleet.tokenizers import ModelTokenizers
from router.index.event_keys import EventKeys

log = logging.getLogger(__name__)

#: Router strides a canary prompt spans (so its events key to several identities).
CANARY_STRIDES = 3
#: A canary conversation, for the chat template's half of the tokenizer check.
CANARY_CHAT: tuple[Message, ...] = (
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is a prefix cache?"},
)
#: What the canary conversation is sent with for the template's arguments: a tool (its
#: description not ASCII, which transformers' ``tojson`` writes as is) and Qwen's
#: ``enable_thinking``, as clients send them.
CANARY_ARGUMENTS: dict[str, object] = {
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Le temps qu'il fait à une ville",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ],
    "chat_template_kwargs": {"enable_thinking": False},
}
#: The conversation with them, as a verdict names it.
ARGUMENTS_CHAT = "chat with a tool and a template argument"


@dataclass(frozen=True)
class Verdict:
    """The check's outcome: precise, or approximate with the reason (what differs and
    the flag that fixes it); ``skipped``: checks that could not be made, and why."""

    precise: bool
    reason: str | None = None
    skipped: tuple[str, ...] = ()


@dataclass
class CanaryWatch:
    """Keys a backend's events as the router does, to see whether a canary's blocks come
    back as the identities the router computes."""

    keys: EventKeys
    seen: set[int] = field(default_factory=set)
    events: int = 0
    #: Tokens per block the stored events carry (their token ids over their hashes).
    event_block_sizes: set[int] = field(default_factory=set)

    def feed(self, events: Sequence[KVEvent]) -> None:
        for event in events:
            self.events += 1
            if event.kind == "stored" and event.block_hashes:
                tokens = len(event.token_bytes) // TOKEN_DTYPE.itemsize
                if tokens:
                    self.event_block_sizes.add(tokens // len(event.block_hashes))
                self.seen.update(self.keys.stored(event))


class BackendCheck:
    """Runs the checks of the module docstring against one backend at a time."""

    def __init__(
        self,
        client: aiohttp.ClientSession,
        tokenizers: ModelTokenizers,
        model: str,
        block_size: int,
        stride: int,
        events_timeout_s: float = 5.0,
        answer_timeout_s: float = 120.0,
    ) -> None:
        self.client, self.tokenizers, self.model = client, tokenizers, model
        self.block_size, self.stride = block_size, stride
        self.events_timeout_s, self.answer_timeout_s = events_timeout_s, answer_timeout_s

    async def check(
        self,
        url: str,
        card: EngineCard | None,
        attach: Callable[[CanaryWatch | None], None],
        catch_up: Callable[[], None],
        rank: int | None = None,
    ) -> Verdict:
        """Check the backend at ``url`` (``card``: what it says of itself, if anything).
        ``attach(watch)`` has its events fed to ``watch`` from now on (``None``: no more);
        ``catch_up()`` asks its stream to replay what it may have missed; ``rank``: the
        engine of a data-parallel server checked (its canary sent there). Raises
        ``aiohttp.ClientError`` or ``TimeoutError`` if the backend stops answering."""
        model = card.model if card and card.model else self.model
        if card and card.model and card.model != self.model:
            log.warning(
                "backend %s serves model %r, the gateway %r: requests naming %r will "
                "be refused; start the gateway with --model %s",
                url,
                card.model,
                self.model,
                self.model,
                card.model,
            )
        engine_block_size = card.block_size if card else None
        reason = self.block_size_difference(engine_block_size)
        if reason:
            return Verdict(False, reason)
        unsaid = "block size (the engine does not say it; its events' blocks are checked)"
        said = unsaid if engine_block_size is None else None
        watch = CanaryWatch(EventKeys(self.model, self.block_size, self.stride))
        engine_tokenizer = card.tokenizer if card else None
        tokenizer = await self.tokenizers.learn(model, engine_tokenizer)
        try:
            reason, skipped = await self.tokenizer_difference(
                url, model, tokenizer, engine_tokenizer
            )
            if reason:
                return Verdict(False, reason)
            attach(watch)
            reason, refused = await self.canary(url, model, tokenizer, watch, catch_up, rank)
        except NotOfItsFleet as error:
            return Verdict(False, str(error))
        finally:
            attach(None)
        skips = tuple(s for s in (said, skipped, refused) if s)
        return Verdict(reason is None, reason, skips)

    def block_size_difference(self, engine_block_size: int | None) -> str | None:
        if engine_block_size is None or engine_block_size == self.block_size:
            return None
        return (
            f"its KV blocks hold {engine_block_size} tokens, the router hashes blocks of "
            f"{self.block_size}: start the gateway with --block-size {engine_block_size}"
        )

    async def tokenizer_difference(
        self, url: str, model: str, tokenizer: Tokenizer, engine_tokenizer: str | None
    ) -> tuple[str | None, str | None]:
        """What differs between the engine's tokens and ``tokenizer``'s (its model's in
        the gateway), and a check skipped, if any."""
        text = self.canary_text(tokenizer, np.random.default_rng(0))
        pairs: list[tuple[str, dict[str, object], np.ndarray]] = [
            ("completion", {"prompt": text}, tokenizer.encode(text))
        ]
        try:
            chat = tokenizer.apply_chat_template(CANARY_CHAT)
            pairs.append(("chat", {"messages": list(CANARY_CHAT)}, chat))
        except ValueError as error:  # the gateway has no chat template
            return f"the gateway cannot render a conversation ({error})", None
        fix = self._tokenizer_fix(model, engine_tokenizer)
        for kind, body, ours in pairs:
            theirs = await self._tokenize(url, {"model": model, **body})
            if theirs is None:
                return None, "tokenizer (the engine has no /tokenize)"
            difference = _difference(ours.tolist(), theirs)
            if difference:
                return f"it tokenizes a canary {kind} differently ({difference}): {fix}", None
        return await self.arguments_difference(url, model, tokenizer)

    def _tokenizer_fix(self, model: str, engine_tokenizer: str | None) -> str:
        """The flag that gives the gateway ``model``'s tokenizer."""
        flag = "--tokenizer" if model == self.model else f"--model-tokenizer {model}="
        spaced = "" if flag.endswith("=") else " "
        if engine_tokenizer:
            return f"start the gateway with {flag}{spaced}{engine_tokenizer}"
        return f"give the gateway the engine's tokenizer with {flag}{spaced}PATH"

    async def arguments_difference(
        self, url: str, model: str, tokenizer: Tokenizer
    ) -> tuple[str | None, str | None]:
        """What differs in the canary conversation with a tool and a template argument,
        once it agrees without them (so only their rendering can differ), and a check
        skipped: an engine whose template refuses tools has no such requests to route."""
        body = {"messages": list(CANARY_CHAT), **CANARY_ARGUMENTS}
        fix = "give the gateway the chat template the engine renders tools with (--chat-template)"
        try:
            theirs = await self._tokenize(url, {"model": model, **body})
        except aiohttp.ClientResponseError as error:
            if error.status != 400:
                raise
            theirs = None
        if theirs is None:
            return None, f"template arguments (the engine refuses a {ARGUMENTS_CHAT})"
        try:
            variables = tokenize_variables(body)
            ours = tokenizer.apply_chat_template(CANARY_CHAT, variables=variables)
        except ValueError as error:
            return f"the gateway cannot render a canary {ARGUMENTS_CHAT} ({error}): {fix}", None
        difference = _difference(ours.tolist(), theirs)
        if difference:
            return f"it tokenizes a canary {ARGUMENTS_CHAT} differently ({difference}): {fix}", None
        return None, None

    async def _tokenize(self, url: str, body: dict[str, object]) -> list[int] | None:
        async with self.client.post(
            f"{url}/tokenize", json=body, timeout=aiohttp.ClientTimeout(total=30.0)
        ) as response:
            if response.status in (404, 405):
                return None
            check_credential(response.status)
            response.raise_for_status()
            tokens = (await response.json()).get("tokens")
        return [int(t) for t in tokens] if isinstance(tokens, list) else None

    def canary_text(self, tokenizer: Tokenizer, rng: np.random.Generator, nonce: str = "") -> str:
        """Words of the simulated model's vocabulary, long enough to span
        :data:`CANARY_STRIDES` router strides with ``tokenizer``; ``nonce`` first, so that
        no cache holds any of it."""
        words = [int(w).to_bytes(4, "little").decode() for w in WORDS]
        wanted = CANARY_STRIDES * self.block_size * self.stride + 1
        count, text = wanted, ""
        while len(tokenizer.encode(text)) < wanted:
            text = f"canary {nonce} " + "".join(
                words[i] for i in rng.integers(0, len(words), count)
            )
            count *= 2
        return text

    async def canary(
        self,
        url: str,
        model: str,
        tokenizer: Tokenizer,
        watch: CanaryWatch,
        catch_up: Callable[[], None],
        rank: int | None = None,
    ) -> tuple[str | None, str | None]:
        """Send a fresh canary prompt: what is wrong with the events it causes, if
        anything, and whether the check could not be made (the backend refused it)."""
        text = self.canary_text(tokenizer, np.random.default_rng(), nonce=uuid.uuid4().hex)
        tokens = tokenizer.encode(text)
        expected = set(
            prefix_keys(tokens[:-1], self.block_size, self.stride, identity_seed(self.model, None))
        )
        body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0.0}
        async with self.client.post(
            f"{url}/v1/completions",
            json=body,
            headers={} if rank is None else {RANK_HEADER: str(rank)},
            timeout=aiohttp.ClientTimeout(total=self.answer_timeout_s),
        ) as response:
            await response.read()
            check_credential(response.status)
            if response.status != 200:  # nothing learned, nothing held against it
                return None, f"events (the engine answered the canary with {response.status})"
        clock = asyncio.get_running_loop().time
        deadline, asked = clock() + self.events_timeout_s, False
        while not expected <= watch.seen:
            if clock() >= deadline:
                return self._events_verdict(watch, expected), None
            if not asked and clock() >= deadline - self.events_timeout_s / 2:
                catch_up()  # half the time gone: ask for what a quiet stream may have hidden
                asked = True
            await asyncio.sleep(0.05)
        return None, None

    def _events_verdict(self, watch: CanaryWatch, expected: set[int]) -> str:
        sizes = sorted(watch.event_block_sizes - {self.block_size})
        if sizes:
            return self.block_size_difference(sizes[0]) or ""
        if not watch.events:
            return (
                f"no KV events came for a canary prompt within {self.events_timeout_s:.0f} s: "
                "for vLLM, start it with --kv-events-config and name the endpoint "
                "(--backend URL,kv=tcp://HOST:PORT,replay=tcp://HOST:PORT)"
            )
        if watch.keys.unkeyed:
            return (
                f"its KV events could not be keyed ({watch.keys.unkeyed} blocks without the "
                "token ids or parents the router keys them by)"
            )
        found = len(expected & watch.seen)
        return (
            f"the KV events that came key to other identities than the router computes for "
            f"a canary prompt ({found} of {len(expected)} found): another engine's events "
            "(check the backend's kv= endpoint), a cache salt or LoRA adapter, or tokens "
            "other than the prompt's"
        )


class NotOfItsFleet(Exception):
    """The backend refused the gateway's requests for want of a credential."""


def check_credential(status: int) -> None:
    """Raise :class:`NotOfItsFleet` for a 401 or 403: no check can be made, and no
    request of the gateway's will be answered either, so the operator must hear why."""
    if status in (401, 403):
        raise NotOfItsFleet(
            f"it refuses the gateway's requests ({status}): it asks a fleet token the "
            f"gateway does not carry; give the gateway the replicas' token "
            f"(--fleet-token-file or ${ENV_FLEET_TOKEN})"
        )


def _difference(ours: list[int], theirs: list[int]) -> str | None:
    if ours == theirs:
        return None
    first = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
        min(len(ours), len(theirs)),
    )
    return f"{len(theirs)} tokens there, {len(ours)} here, the first difference at token {first}"
