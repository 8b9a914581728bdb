"""llama.cpp on the offline workload, run by the llama.cpp peer's python (scripts/peers/setup_llama_cpp.sh).

Batched: llama-cpp-python's low-level API, one context holding every request as its own sequence
(n_seq_max = max_num_seqs): the prompts go through llama_decode packed into batches of up to n_batch
tokens, each prompt's last token asking for logits; then every decode step is one llama_decode of one
token per unfinished sequence at its own position. The next token is the argmax of the sequence's logits
row (greedy; EOS is not looked at), and a sequence leaves the batch once it has its max_tokens.

Single stream: the plain high-level path, llama_cpp.Llama: eval of the prompt, then sample (temp 0:
greedy) and eval one token at a time.

Usage: PEER_PYTHON llama_cpp_runner.py WORKLOAD.json|- RESULT.json|- (see runner_common).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import platform
import sys
import time
from typing import Any

import llama_cpp
import numpy as np
from runner_common import batch_record, read_workload, single_stream, timed, write_result


def _silence() -> None:
    """llama.cpp's own log lines (model load, context sizes) go nowhere; errors still raise."""
    @llama_cpp.llama_log_callback
    def quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        return None

    _silence.callback = quiet  # kept alive: llama.cpp holds the pointer
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))


class Batched:
    """A context with max_num_seqs sequences and the greedy continuous decode of many requests."""

    def __init__(self, model_path: str, threads: int, n_seq: int, per_seq_ctx: int, n_batch: int) -> None:
        mparams = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_seq_max = n_seq
        cparams.n_ctx = n_seq * per_seq_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(n_batch, 512)
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_seq, self.n_batch = n_seq, n_batch
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.config = {
            "n_ctx": llama_cpp.llama_n_ctx(self.ctx), "n_seq_max": n_seq, "n_batch": n_batch,
            "n_ubatch": cparams.n_ubatch, "n_threads": threads, "kv_unified": bool(cparams.kv_unified),
            "flash_attn_type": int(cparams.flash_attn_type),
        }

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        for k, (token, pos, seq, logits) in enumerate(entries):
            b.token[k] = token
            b.pos[k] = pos
            b.n_seq_id[k] = 1
            b.seq_id[k][0] = seq
            b.logits[k] = logits
        b.n_tokens = len(entries)
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, index: int) -> int:
        row = llama_cpp.llama_get_logits_ith(self.ctx, index)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(self.n_vocab,))))

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        """Greedy continuations of up to n_seq requests at once (more are run in waves of n_seq)."""
        out: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(prompts), self.n_seq):
            wave = range(start, min(start + self.n_seq, len(prompts)))
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
            # Prefill: every prompt's tokens, packed into batches of n_batch; logits for each last token.
            entries = [(tok, pos, i - start, pos == len(prompts[i]) - 1)
                       for i in wave for pos, tok in enumerate(prompts[i])]
            for lo in range(0, len(entries), self.n_batch):
                chunk = entries[lo:lo + self.n_batch]
                self._decode(chunk)
                for k, (_, _, seq, logits) in enumerate(chunk):
                    if logits:
                        out[start + seq].append(self._argmax(k))
            # Decode: one token per unfinished sequence per llama_decode.
            active = [i for i in wave if len(out[i]) < max_tokens[i]]
            while active:
                self._decode([(out[i][-1], len(prompts[i]) + len(out[i]) - 1, i - start, True) for i in active])
                for k, i in enumerate(active):
                    out[i].append(self._argmax(k))
                active = [i for i in active if len(out[i]) < max_tokens[i]]
        return out

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


def main() -> None:
    work, out_path = read_workload(sys.argv)
    prompts, max_tokens = work["prompts"], work["max_tokens"]
    threads = int(work["threads"])
    n_seq = min(int(work.get("max_num_seqs") or len(prompts)), len(prompts))
    longest = max(len(p) + n for p, n in zip(prompts, max_tokens))
    ss = work["single_stream"]
    longest = max(longest, len(ss["prompt"]) + int(ss["max_tokens"]))
    per_seq_ctx = -(-longest // 256) * 256
    n_batch = max(512, min(4096, sum(len(p) for p in prompts)))
    llama_cpp.llama_backend_init()
    _silence()

    start = time.perf_counter()
    engine = Batched(work["model"], threads, n_seq, per_seq_ctx, n_batch)
    load_seconds = time.perf_counter() - start
    engine.generate(prompts[:2], [2] * len(prompts[:2]))  # warm-up, as orca's
    tokens, seconds = timed(lambda: engine.generate(prompts, max_tokens))
    config = engine.config
    engine.close()

    llm = llama_cpp.Llama(model_path=work["model"], n_ctx=per_seq_ctx, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)

    def one(prompt: list[int], n: int) -> list[int]:
        llm.reset()
        llm.eval(prompt)
        generated: list[int] = []
        while True:
            token = llm.sample(top_k=1, temp=0.0)
            generated.append(token)
            if len(generated) == n:
                return generated
            llm.eval([token])

    result: dict[str, Any] = {
        "system": "llama_cpp",
        "model": work["model"],
        "threads": threads,
        "load_seconds": load_seconds,
        **batch_record(tokens, seconds),
        "single_stream": single_stream(one, ss),
        "config": config,
        "versions": {
            "llama_cpp_python": importlib.metadata.version("llama_cpp_python"),
            "python": platform.python_version(),
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        },
    }
    write_result(out_path, result)


if __name__ == "__main__":
    main()
