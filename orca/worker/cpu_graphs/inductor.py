"""How the CPU graphs compile: inductor's options, the frozen graphs' cache key, the guards kept, and the
text encoding inductor's sources need."""

from __future__ import annotations

import contextlib
import hashlib
import locale
import logging
import re
import warnings
from collections.abc import Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)

# dynamo keeps at most this many graphs of one function, those of every model of a class together: an engine
# compiles up to 4 (with and without float copies and adapter rows), and one process may hold several.
RECOMPILE_LIMIT = 64

# Every graph's options. compile_threads=1: inside Triton's stub sys.executable is not Python, and inductor's
# compile workers start from it. No size, stride or alignment asserts: 0.25 ms of a ~10 ms single-stream step
# for inputs made at load and never replaced (the tests compare every graph with the eager model).
GRAPH_OPTIONS = {"compile_threads": 1, "size_asserts": False, "alignment_asserts": False}

# The frozen graphs (GraphStep with int8 layers, CompiledHead): weights as constants, so that inductor's
# weight-only GEMM templates pack them, max_autotune measuring template against torch's kernel at load;
# casts rounded as eagerly (an int8 head of a float32 model runs in bfloat16); no autotuning table in the log.
FROZEN_OPTIONS = {**GRAPH_OPTIONS, "emulate_precision_casts": True, "freezing": True, "max_autotune": True,
                  "max_autotune_gemm_backends": "CPP,ATEN", "autotune_num_choices_displayed": 0,
                  "max_autotune_report_choices_stats": False}


@contextlib.contextmanager
def frozen_compiling(fingerprint: str) -> Iterator[None]:
    """Compiling with FROZEN_OPTIONS. Inductor's cache keys a frozen weight by its shape, not its values: the
    model's `fingerprint` (weights_fingerprint) joins every key, so that a cached graph is only ever reused
    for the same weights."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(**FROZEN_OPTIONS), torch.compiler.config.patch(cache_key_tag=fingerprint), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
        yield


def weights_fingerprint(model: nn.Module) -> str:
    """A SHA-256 over the model's tensors: names, dtypes, shapes and bytes (oneDNN's packed copies, opaque,
    left out: they are made from the others)."""
    digest = hashlib.sha256()
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.is_mkldnn:
            continue
        digest.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        digest.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def utf8_text_encoding() -> None:
    """Makes UTF-8 open()'s default text encoding when the locale's is not (the C locale of Triton's stub):
    inductor reads its UTF-8 source templates with the default."""
    encoding = locale.getpreferredencoding(False)
    if encoding.lower().replace("-", "") != "utf8":
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
        logger.info("text encoding %s -> UTF-8 (LC_CTYPE C.UTF-8), for inductor's UTF-8 sources", encoding)


def guards_to_keep(entries: list) -> list[bool]:
    """torch.compile's guard_filter_fn: every guard but the tensor guards of the second and later layers
    (made at load, never replaced): 1 ms a call for SmolLM2's ~700 tensors. The first layer's and the
    model's own tensors keep theirs: every layer is built alike, so they tell a graph apart from another
    model's of the same class in the same process."""
    return [not (e.guard_type == "TENSOR_MATCH" and _LATER_LAYER.search(e.name) is not None) for e in entries]


_LATER_LAYER = re.compile(r"\._modules\['\w+'\]\._modules\['([1-9]\d*)'\]\.")
