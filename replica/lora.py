"""LoRA adapters on a simulated engine, as vLLM serves them.

An adapter is registered by name (``--lora-modules``, or ``POST /v1/load_lora_adapter``
at run time) and requests name it as their ``model``. Its weights are kept in host
memory once registered (vLLM's CPU cache of adapters); a batch may use at most
``max_loras`` adapters at once (vLLM's ``--max-loras``), each in a GPU slot. Running
an adapter that is in no slot copies it into one over the host link, evicting the
least recently used adapter that no running request uses; a request whose adapter
finds no free slot waits while later requests of other adapters go ahead, as vLLM's
scheduler skips it.

Pure bookkeeping: the scheduler asks :meth:`AdapterSlots.can_run` and calls
:meth:`AdapterSlots.use` when it admits a request; :meth:`AdapterSlots.take_loads`
tells the step which adapters it must copy in (the cost model prices the copies).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable


class UnknownAdapter(ValueError):
    """A request named an adapter this engine has not registered."""


class AdapterSlots:
    def __init__(self, max_loras: int, registered: Iterable[str] = ()) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.max_loras = max_loras
        self.registered: set[str] = set(registered)
        self._resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._running: Counter[str] = Counter()  # running requests per adapter
        self._pending_loads: list[str] = []
        #: Copies into a GPU slot since the engine started.
        self.loads = 0

    def register(self, name: str) -> None:
        self.registered.add(name)

    def unregister(self, name: str) -> bool:
        """Forget ``name``; refused (``False``) while a request uses it."""
        if name not in self.registered or self._running[name]:
            return False
        self.registered.discard(name)
        self._resident.pop(name, None)
        return True

    def check(self, name: str | None) -> None:
        if name is not None and name not in self.registered:
            raise UnknownAdapter(f"the LoRA adapter {name!r} is not loaded")

    @property
    def resident(self) -> tuple[str, ...]:
        """Adapters in GPU slots, the least recently used first."""
        return tuple(self._resident)

    @property
    def free_slots(self) -> int:
        """Slots an adapter not resident could take now: empty, or holding an adapter
        that no running request uses."""
        idle = sum(not self._running[name] for name in self._resident)
        return self.max_loras - len(self._resident) + idle

    def can_run(self, name: str | None) -> bool:
        """Whether a request under ``name`` can join the batch now: base-model requests
        always can; an adapter needs its slot, a free one, or one whose adapter no
        running request uses."""
        if name is None or name in self._resident or len(self._resident) < self.max_loras:
            return True
        return any(not self._running[other] for other in self._resident)

    def use(self, name: str | None) -> None:
        """A request under ``name`` joins the batch (``can_run`` said it may)."""
        if name is None:
            return
        if name in self._resident:
            self._resident.move_to_end(name)
        else:
            if len(self._resident) >= self.max_loras:
                victim = next(other for other in self._resident if not self._running[other])
                del self._resident[victim]
            self._resident[name] = None
            self._pending_loads.append(name)
            self.loads += 1
        self._running[name] += 1

    def done(self, name: str | None) -> None:
        """A request under ``name`` left the batch (finished, aborted or preempted)."""
        if name is not None and self._running[name]:
            self._running[name] -= 1

    def take_loads(self) -> int:
        """Adapters copied into slots since the last call (the step pays for them)."""
        count, self._pending_loads = len(self._pending_loads), []
        return count
