"""A tokenizer per model: a fleet serving a Llama and a Qwen is routed precisely for both.

Block identities hash token ids, and two models' tokenizers give different ids for the
same text, so each model's requests are tokenized with that model's tokenizer. Which
one, for a model:

1. the one the operator names for it (``--model-tokenizer MODEL=TOKENIZER``);
2. else the gateway's own (``--tokenizer``), for the gateway's model;
3. else the one its replicas' cards name (their model folder, or ``bytes4``), learned
   when the first of them joins, if this machine can read it (loaded in a thread: a
   large tokenizer takes a second);
4. else the gateway's own, which the replica's join check then finds wrong, naming the
   flag that fixes it.

``--chat-template`` replaces the gateway's own tokenizer's template only: another
model's comes with its tokenizer. A request for a model whose tokenizer is still loading
is tokenized with the gateway's own, and routed as the join check routes its replicas
meanwhile: approximately.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from replica.api.tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: Loads a tokenizer by name (``bytes4``, or a Hugging Face tokenizer's path).
Load = Callable[[str], Tokenizer]


class ModelTokenizers:
    """Each model's tokenizer (see the module's doc). ``default``: the gateway's own, named
    ``default_name``, for ``default_model`` and any model with no other; ``named``: the
    operator's, by model; ``load``: how another is loaded (without the gateway's
    ``--chat-template``)."""

    def __init__(
        self,
        default: Tokenizer,
        default_name: str,
        default_model: str,
        named: dict[str, str],
        load: Load,
    ) -> None:
        self.default, self._load = default, load
        self._loaded: dict[str, Tokenizer] = {default_name: default}
        # the gateway's model and the named ones are never replaced by what a card says
        self._by_model: dict[str, Tokenizer] = {default_model: default}
        self._loading: dict[str, asyncio.Future[Tokenizer]] = {}
        for model, name in named.items():
            self._by_model[model] = self._tokenizer(name)
        #: Whether any model has a tokenizer other than the gateway's own (read per request).
        self.several = self._several()

    def of(self, model: str | None) -> Tokenizer:
        """``model``'s tokenizer (the gateway's own for a model it knows none of)."""
        return self._by_model.get(model, self.default) if model else self.default

    async def learn(self, model: str, name: str | None) -> Tokenizer:
        """``model``'s tokenizer once a replica's card says it is ``name``: loaded the
        first time (in a thread), unless the model already has one. One that cannot be
        loaded here (a hub name, a folder on another machine) leaves the gateway's own,
        which the join check then refuses with the fix."""
        if model in self._by_model or not name:
            return self.of(model)
        if name not in self._loaded:
            pending = self._loading.get(name)
            if pending is None:
                pending = self._loading[name] = asyncio.ensure_future(
                    asyncio.to_thread(self._load, name)
                )
            try:
                self._loaded[name] = await pending
            except (ValueError, OSError) as error:
                log.warning(
                    "model %r: its replicas' tokenizer %r cannot be loaded here (%s); "
                    "give it with --model-tokenizer %s=PATH",
                    model,
                    name,
                    error,
                    model,
                )
                return self.default
            finally:
                self._loading.pop(name, None)
        self._by_model.setdefault(model, self._loaded[name])
        self.several = self._several()
        return self._by_model[model]

    def _several(self) -> bool:
        return any(t is not self.default for t in self._by_model.values())

    def _tokenizer(self, name: str) -> Tokenizer:
        if name not in self._loaded:
            self._loaded[name] = self._load(name)
        return self._loaded[name]
