"""The engine core's LoRA adapters, served by name: registered, checked, read on the caller's thread and
handed to the workers with the next plan (the slots themselves: orca/core/lora.py)."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from typing import Any

from orca.checkpoint import ModelConfig
from orca.config import EngineConfig
from orca.core.lora import LoRARequest, LoRASlots

logger = logging.getLogger(__name__)


class LoRAAdapters:
    """EngineCore's adapter methods; the state is the core's own (set in its __init__)."""

    config: EngineConfig
    model_config: ModelConfig
    lora_slots: LoRASlots | None
    loras: dict[str, LoRARequest]
    _lora_ids: itertools.count
    _lora_removed: list[int]  # ids whose host copies the workers may drop (next plan)
    _lora_added: list[tuple[int, Any]]  # (id, adapter read) for the workers to keep (next plan)
    lora_load_seconds: deque[tuple[str, float]]  # (adapter, seconds) of each load, for metrics to drain

    def add_lora(self, name: str, path: str, adapter: Any = None) -> LoRARequest:
        """Serves the adapter in directory `path` under `name`, after reading it whole and checking it
        against the model (orca/models/lora.py read_adapter: LoRAError, a ValueError naming the adapter and
        the reason), on the caller's thread; `adapter`: that read, done already (EngineLoop.add_lora reads
        on its caller's thread, before the call comes to the loop's). A name already served is refused:
        remove it first. The host copy goes to the workers with the next plan (StepPlan.lora_added): they
        never read the files."""
        self.check_new_lora(name, path)
        if adapter is None:
            adapter = self.read_lora(name, path)
        lora = self.loras[name] = LoRARequest(name, next(self._lora_ids), path)
        self._lora_added.append((lora.lora_id, adapter))
        logger.info("LoRA adapter %s (id %d) from %s", name, lora.lora_id, path)
        return lora

    def check_new_lora(self, name: str, path: str) -> None:
        """ValueError when add_lora(name, path) would be refused before reading anything (LoRA off, no name
        or path, a name already served). Reads only the served names: any thread may call it (add_lora
        checks again)."""
        if self.lora_slots is None:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora true")
        if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
            raise ValueError(f"a LoRA adapter needs a name and a path, got {name!r} and {path!r}")
        served = self.loras.get(name)
        if served is not None:
            raise ValueError(f"LoRA adapter {name!r} is already served (from {served.path}): remove it "
                             "first to replace it")

    def read_lora(self, name: str, path: str) -> Any:
        """The adapter in `path` read and checked for this engine's model and max_lora_rank, on the caller's
        thread (orca/models/lora.py read_adapter; LoRAError names the adapter and the reason)."""
        from orca.models.lora import read_adapter  # reads files and tensors only: no model code

        return read_adapter(name, path, self.model_config, self.config.max_lora_rank)

    def remove_lora(self, name: str) -> bool:
        """Stops serving an adapter: new requests naming it are refused; requests already holding it run
        to their end. False if no adapter has that name."""
        lora = self.loras.pop(name, None)
        if lora is None:
            return False
        self.lora_slots.forget(lora.lora_id)  # type: ignore[union-attr]
        self._lora_added = [(i, a) for i, a in self._lora_added if i != lora.lora_id]  # never handed over
        self._lora_removed.append(lora.lora_id)
        return True

    def list_loras(self) -> list[LoRARequest]:
        return list(self.loras.values())

    def _lora(self, name: str) -> LoRARequest:
        """The adapter a request names; ValueError naming the adapters served when it is none of them."""
        if self.lora_slots is None:
            raise ValueError(f"lora_name {name!r}: this model serves no LoRA adapters (enable_lora is off)")
        lora = self.loras.get(name)
        if lora is None:
            served = ", ".join(sorted(self.loras)) or "none"
            raise ValueError(f"lora_name {name!r} is not an adapter this model serves (served: {served})")
        return lora
