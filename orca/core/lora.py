"""Multi-LoRA in the engine core: which adapters exist (LoRARequest) and which sit in the workers'
`max_loras` slots (LoRASlots), in plain numbers.

A request is admitted only when its adapter is resident or can be made so (a free slot, or the least
recently used one no admitted request uses); otherwise it waits and later requests may pass it. An admitted
request pins its adapter's slot until it leaves, so a slot is never rewritten under a batch in flight.
Loads travel in the next plan (StepPlan.lora_loads). Slot ids are 0 .. max_loras - 1; -1 is the base model.
More: docs/design.md, "Multi-LoRA".
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A registered adapter: its name (what requests and the OpenAI API's `model` say), its id (unique
    for the engine's life: an adapter removed and added again under the same name gets a new one, so no
    cached K/V of the old one is ever reused) and its directory (adapter_config.json and
    adapter_model.safetensors)."""

    name: str
    lora_id: int
    path: str


class LoRASlots:
    """Which adapter (by id) each of `max_loras` slots holds, and how many admitted requests use each."""

    def __init__(self, max_loras: int) -> None:
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"max_loras must be an integer >= 1, got {max_loras!r}")
        self.max_loras = max_loras
        self._slot_of: dict[int, int] = {}  # lora_id -> slot
        self._users: dict[int, int] = {}  # lora_id -> admitted requests using it (resident ids only)
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident ids no request uses, least recent first
        self._free = list(range(max_loras - 1, -1, -1))  # never used yet; popped lowest first
        self.num_loads = 0  # cumulative: adapters put into a slot

    @property
    def resident(self) -> dict[int, int]:
        """lora_id -> slot of every adapter in a slot now."""
        return dict(self._slot_of)

    @property
    def num_active(self) -> int:
        """Adapters used by at least one admitted request."""
        return sum(1 for n in self._users.values() if n > 0)

    def slot(self, lora_id: int) -> int:
        return self._slot_of[lora_id]

    def can_acquire(self, lora_id: int) -> bool:
        """Whether a request of this adapter can be admitted now."""
        return lora_id in self._slot_of or bool(self._free) or bool(self._idle)

    def acquire(self, lora_id: int) -> tuple[int, bool]:
        """One more admitted request uses the adapter: (its slot, whether the adapter must be put there,
        i.e. it was not resident). Evicts the least recently used idle adapter when no slot is free."""
        if lora_id in self._slot_of:
            self._idle.pop(lora_id, None)
            self._users[lora_id] += 1
            return self._slot_of[lora_id], False
        if self._free:
            slot = self._free.pop()
        elif self._idle:
            victim, _ = self._idle.popitem(last=False)
            slot = self._slot_of.pop(victim)
            del self._users[victim]
        else:
            raise RuntimeError(f"no LoRA slot for adapter {lora_id}: all {self.max_loras} are in use")
        self._slot_of[lora_id] = slot
        self._users[lora_id] = 1
        self.num_loads += 1
        return slot, True

    def release(self, lora_id: int) -> None:
        """An admitted request of the adapter left (finished, preempted or aborted); the adapter stays in
        its slot, idle once no request uses it, until a slot is needed for another."""
        self._users[lora_id] -= 1
        if self._users[lora_id] == 0:
            self._idle[lora_id] = None

    def forget(self, lora_id: int) -> None:
        """The adapter was removed from the engine: its slot, if it is idle, becomes free."""
        if lora_id in self._idle:
            del self._idle[lora_id]
            self._free.append(self._slot_of.pop(lora_id))
            del self._users[lora_id]
