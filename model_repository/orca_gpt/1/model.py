"""Triton adapter for the Orca engine: a decoupled Python model, a thin shell over orca_triton/.

Triton tensors in, engine calls, Triton responses out. The scheduling is the engine core's
(orca.core.engine_loop.EngineLoop runs Algorithm 1 on its own thread); request meaning is
orca_triton.generate's; text is the front end's (orca.frontend: Tokenizer in, OutputProcessor out);
metrics and tritonserver's shutdown and death are orca_triton.metrics' and orca_triton.lifecycle's.

Threads: Triton calls execute(), which parses and tokenizes, submits token ids and returns at once (a text
prompt too long for the context is refused unread; a long one is tokenized on a small pool instead). The
scheduler thread loads the engine core (in initialize, which waits for it) and then runs its iterations,
queues their deltas and publishes the engine's gauges: every torch op of the engine runs on that one
thread, and no text. The response thread turns deltas into RequestOutputs (detokenizing, stop strings,
logprobs: the OutputProcessor) and those into Triton responses, and sends them, so neither delays the next
iteration. It owns every sender, so it also notices client cancellation and aborts those requests: a
request's sender is asked with each of its outputs, and any active request not asked for _CANCEL_POLL_S
(one still waiting for admission, say) by a periodic sweep. Every request gets exactly one FINAL.

A watcher thread follows tritonserver itself. On SIGTERM/SIGINT Triton stops taking HTTP connections and
waits up to --exit-timeout-secs, then exits whatever is in flight (decoupled requests are not among the
inferences it waits for). The watcher notices through Triton's HTTP port: new requests are refused, those
in flight keep generating until shortly before the exit timeout ends, and then every one left is cancelled,
so that each gets its FINAL before Triton exits. If tritonserver is gone (killed, crashed), a reaper process
kills the stub: it has nobody to answer and would otherwise stay behind.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from orca import (
    EngineConfig,
    EngineCore,
    EngineCoreOutput,
    EngineFailedError,
    OutputProcessor,
    QueueFullError,
    RequestOutput,
)
from orca.core.engine_loop import EngineLoop, fault_from_env
from orca.core.outputs import IterationStats
from orca.frontend.generation_config import describe_sampling_defaults, read_sampling_defaults
from orca.frontend.parallel_sampling import ParentRequest, child_params
from orca.frontend.structured_outputs import DEFAULT_MAX_PENDING, StructuredOutputCompiler
from orca.frontend.tokenizer import Tokenizer
from orca_triton.generate import (
    INPUT_NAMES,
    GenerateRequest,
    check_prompt_size,
    parent_response_tensors,
    parse_generate_request,
    response_tensors,
)
from orca_triton.lifecycle import HttpProbe, cmdline, log_to_stderr, start_reaper
from orca_triton.lifecycle import exit_timeout as triton_exit_timeout
from orca_triton.lora import (
    CONTROL_INPUT,
    ControlRequest,
    adapters_json,
    check_control,
    load_at_run_time,
    parse_control,
    read_multi_lora,
)
from orca_triton.metrics import Metrics

logger = logging.getLogger("orca_gpt")

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_INLINE_PROMPT_BYTES = 16 << 10  # text prompts up to this size are tokenized on execute's thread (a few ms)
_PROMPT_THREADS = 2  # the pool that tokenizes longer ones
_CANCEL_POLL_S = 0.1  # how often the response thread asks every active request's sender about cancellation
_NO_OUTPUT = object()
_WATCH_S = 0.5  # how often the watcher asks whether tritonserver still runs and is ready


@dataclass(frozen=True)
class _Failure:
    """Queued for the response thread when the engine fails."""

    reason: str


@dataclass
class _Group:
    """The n engine requests of one Triton request with n > 1 (orca/frontend/parallel_sampling.py): one
    sender, one FINAL, responses of n-element tensors."""

    parent: ParentRequest
    members: dict[str, _Active]
    closed: bool = False  # the FINAL was sent (an error or a cancellation ends every child at once)


@dataclass
class _Active:
    """A request between submit and its FINAL response (with n > 1: one of its children)."""

    sender: Any
    request: GenerateRequest
    cancelled: bool = False  # the client cancelled and the engine was asked to abort it
    asked_at: float = 0.0  # when the response thread last asked the sender about cancellation
    group: _Group | None = None
    last_token_at: float | None = None  # when its latest token was generated (vllm:time_per_output_token_seconds)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        log_to_stderr(logger.name)  # the engine's load and compile progress, in the server's log
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("orca_gpt must be decoupled (model_transaction_policy)")
        config = _engine_config(model_config)
        # vllm_backend's multi_lora.json (in the version directory, beside model.py), merged with lora_modules.
        try:
            multi_lora = read_multi_lora(Path(args["model_repository"]) / args["model_version"], config)
        except ValueError as exc:
            raise pb_utils.TritonModelException(str(exc)) from None
        report_vllm = _report_custom_metrics(model_config)
        self._ids = itertools.count()
        self._id_prefix = f"{args['model_name']}-{args['model_instance_name']}-"
        self._active: dict[str, _Active] = {}
        self._active_lock = threading.Lock()
        self._responses: queue.Queue[EngineCoreOutput | _Failure | None] = queue.Queue()
        # The core is built (loaded, compiled, warmed up) on the loop's own thread, which then steps it:
        # this thread (the stub's, which calls execute) never runs torch's ops (orca/core/engine_loop.py).
        self.loop = EngineLoop(
            lambda: _build_core(config, multi_lora), on_output=self._responses.put, on_iteration=self._on_iteration,
            on_stats=self._on_stats, on_failure=self._on_engine_failure,
            fault=fault_from_env(args["model_name"]),
        )
        self.core = self.loop.core
        self.text = Tokenizer.load(self.core.checkpoint)
        self.has_tokenizer = self.text.available
        # The model's recommended sampling (generation_config.json), for the keys a request leaves out.
        self.sampling_defaults = read_sampling_defaults(self.core.checkpoint)
        logger.info("%s", describe_sampling_defaults(self.sampling_defaults, self.core.checkpoint))
        self.eos_token_ids = self.text.eos_token_ids(self.core.eos_token_ids)
        self.outputs = OutputProcessor(self.text)  # on the response thread (add_request on execute's)
        # Structured outputs compile in a worker process; their requests are submitted once compiled. Those
        # waiting for a grammar count against max_queue (_parse_and_submit), and at most 64 wait.
        self.structured_outputs = StructuredOutputCompiler(
            self.text.hf, self.core.model_config.vocab_size, self.eos_token_ids,
            max_pending=min(self.core.config.max_queue, DEFAULT_MAX_PENDING),
        )
        self.structured_outputs.warm_up()
        # Long text prompts are tokenized here, off execute's thread (_submit); at most max_queue wait.
        self._prompt_pool = ThreadPoolExecutor(_PROMPT_THREADS, thread_name_prefix="orca-prompt")
        self._prompts_lock = threading.Lock()
        self._prompts_pending = 0
        # The metric families last, once the model has loaded: one that fails to load registers none (the
        # loop's callbacks, which read them, run from loop.start() on).
        self.metrics = Metrics({"model": args["model_name"], "version": args["model_version"]},
                               report_vllm=report_vllm)
        self.metrics.vllm.engine_loaded(self.core.max_model_len)
        self.structured_outputs.on_compiled = self.metrics.grammar_compile.observe
        self.metrics.publish(self.core.stats())
        self._model_name = args["model_name"]
        self._response_thread = threading.Thread(target=self._send_responses, name="orca-responses", daemon=True)
        self._response_thread.start()
        self.loop.start()
        self._finalizing = threading.Event()
        threading.Thread(target=self._watch_server, name="orca-server-watch", daemon=True).start()
        self._reaper = start_reaper()
        logger.info("orca_gpt ready: %s, n_slots=%d", self.core.checkpoint, self.core.n_slots)

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            control = pb_utils.get_input_tensor_by_name(request, CONTROL_INPUT)
            if control is not None:
                self._control(request.get_response_sender(), control.as_numpy())
            else:
                self._submit(request)
        return None  # decoupled: responses go out through each request's sender

    def finalize(self) -> None:
        self._finalizing.set()
        # Cancels what is in flight: each gets its FINAL through the queue. A failed engine has answered
        # everything already, and its thread may be hung for good (an iteration that never returns): do not
        # hold up Triton's unload (and exit) waiting for it.
        self.structured_outputs.shutdown()
        self._prompt_pool.shutdown(wait=True)  # those being tokenized are submitted (then cancelled below)
        self.loop.shutdown(timeout=30.0 if self.loop.failed is None else 1.0)
        self._responses.put(None)
        self._response_thread.join(timeout=30)
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait(timeout=10)

    # -- the watcher threads -----------------------------------------------------------------------
    def _watch_server(self) -> None:
        """Notices tritonserver's shutdown through its HTTP port (HttpProbe): Triton first closes new HTTP
        connections while it waits up to the exit timeout for the open ones, then stops its HTTP service and
        waits (the rest of the timeout) for the models to unload. From then new requests are refused
        (UNAVAILABLE, "the engine is shutting down"), the requests in flight have until shortly before the
        exit timeout ends, and the rest are cancelled then, so each gets its FINAL before Triton exits.
        Nothing here calls into Triton: polling pb_utils.is_model_ready from a thread of the stub, tried
        first, crashed tritonserver under load (a boost interprocess lock_exception in the next execute)."""
        args = cmdline(os.getppid())
        exit_timeout = triton_exit_timeout(args)
        probe = HttpProbe(args)
        while not probe.closed():
            if self._finalizing.wait(_WATCH_S):
                return
        if self._finalizing.is_set() or self.loop.failed is not None:
            return
        self.loop.drain()  # Triton takes no new HTTP connections now; new gRPC requests are refused here
        margin = min(exit_timeout, max(2.0, 0.25 * exit_timeout))
        logger.warning("%s: tritonserver is shutting down (exit timeout %g s): the %d requests in flight may run "
                       "%g s more, then the rest are cancelled", self._model_name, exit_timeout, len(self._active),
                       exit_timeout - margin)
        if self._finalizing.wait(exit_timeout - margin):
            return
        with self._active_lock:
            left = len(self._active)
        logger.warning("%s: the exit timeout is ending: cancelling the %d requests still in flight",
                       self._model_name, left)
        self.loop.abort_all()

    # -- LoRA adapters: the in-band control requests (orca_triton/lora.py) --------------------------
    def _control(self, sender: Any, tensor: Any) -> None:
        """A lora_control request: list answers at once; load and unload run on the engine's thread between
        iterations (EngineLoop.add_lora, remove_lora), waited for on a thread of their own so execute
        returns; a load reads the adapter's files on that thread first, from inside lora_root only
        (orca_triton/lora.py load_at_run_time). Every answer is one FINAL response: a JSON object in
        text_output, or an error naming the adapter and the reason (INVALID_ARG: a bad request or adapter;
        NOT_FOUND: unload of an adapter not served; UNAVAILABLE: the engine failed or stops)."""
        try:
            value = tensor.reshape(-1)[0] if tensor.size else b""
            req = parse_control(value.decode() if isinstance(value, bytes) else str(value))
            check_control(req, self.core.config, self._model_name)
        except Exception as exc:  # noqa: BLE001
            _answer_failure(sender, exc)
            return
        if req.action == "list":
            self._control_answer(sender, req)
            return
        threading.Thread(target=self._control_answer, args=(sender, req), name="orca-lora-control",
                         daemon=True).start()

    def _control_answer(self, sender: Any, req: ControlRequest) -> None:
        try:
            if req.action == "load":
                # lora_path confined to lora_root; the files read here, the adapter registered on the loop's thread
                lora = load_at_run_time(self.loop, req)
                answer: dict[str, Any] = {"loaded": {"name": lora.name, "path": lora.path}}
                logger.info("%s: LoRA adapter %s loaded from %s", self._model_name, lora.name, lora.path)
            elif req.action == "unload":
                if not self.loop.remove_lora(req.lora_name):
                    served = ", ".join(sorted(lora.name for lora in self.loop.list_loras())) or "none"
                    _send_error(sender, f"LoRA adapter {req.lora_name!r} is not served (served: {served})",
                                pb_utils.TritonError.NOT_FOUND)
                    return
                answer = {"unloaded": req.lora_name}
                logger.info("%s: LoRA adapter %s unloaded", self._model_name, req.lora_name)
            else:
                answer = {}
            answer["adapters"] = adapters_json(self.loop.list_loras())
            answer["enable_lora"] = self.core.config.enable_lora
            text = np.array([json.dumps(answer).encode()], dtype=np.object_)
            _send(sender, {"text_output": text}, True)
        except Exception as exc:  # noqa: BLE001 - a refused adapter (LoRAError: a ValueError) or a stopped engine
            _answer_failure(sender, exc)

    # -- execute's side --------------------------------------------------------------------------
    def _submit(self, request: Any) -> None:
        """Reads the request's inputs; a text prompt too long for the context is refused here, before it is
        decoded or tokenized (check_prompt_size). One of more than _INLINE_PROMPT_BYTES is tokenized on a
        pool thread (the tokenizer releases the GIL), so that it never holds up the requests behind it on
        this thread, Triton's one execute thread; smaller ones are parsed here, in their order of arrival."""
        sender = request.get_response_sender()
        try:
            inputs = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()  # BYTES elements are Python bytes: no view of the request
            parameters = json.loads(request.parameters() or "{}")
            if check_prompt_size(inputs, self.core.max_model_len) <= _INLINE_PROMPT_BYTES:
                self._parse_and_submit(sender, inputs, parameters)
                return
            with self._prompts_lock:
                if self._prompts_pending >= self.core.config.max_queue:
                    raise QueueFullError(f"{self._prompts_pending} long prompts wait to be tokenized (max_queue "
                                         f"{self.core.config.max_queue}): retry later")
                self._prompts_pending += 1
            self._prompt_pool.submit(self._tokenize_off_execute, sender, inputs, parameters)
        except Exception as exc:  # noqa: BLE001 - answer the request whatever went wrong
            _answer_failure(sender, exc)

    def _tokenize_off_execute(self, sender: Any, inputs: dict[str, Any], parameters: dict[str, Any]) -> None:
        """A long prompt, on a pool thread: parsed (tokenized) and submitted as on execute's thread."""
        try:
            self._parse_and_submit(sender, inputs, parameters)
        finally:
            with self._prompts_lock:
                self._prompts_pending -= 1

    def _parse_and_submit(self, sender: Any, inputs: dict[str, Any], parameters: dict[str, Any]) -> None:
        try:
            parsed = parse_generate_request(
                inputs, parameters, self.text, self.has_tokenizer, sampling_defaults=self.sampling_defaults,
                max_model_len=self.core.max_model_len,
            )
            so = parsed.params.structured_outputs
            if parsed.params.n > 1 and not self.has_tokenizer:
                raise ValueError("n > 1 needs a model with a tokenizer: text_output carries the n sequences "
                                 "(output_ids holds one)")
            if so is not None and parsed.params.n > 1:
                raise ValueError("n > 1 with structured_outputs is not supported: give n = 1 (each sequence would "
                                 "need its own grammar state)")
            if so is None:
                self._submit_parsed(sender, parsed, None)
                return
            # The engine's checks and the schema's now (compile_async checks it before queueing); the grammar
            # compiles off this thread, and the request joins the engine when it is done (or gets its error then).
            self.core.validate(parsed.prompt_token_ids, parsed.params, parsed.cache_salt)
            compiling = self.structured_outputs.pending()
            if self.loop.stats.waiting + compiling >= self.core.config.max_queue:
                raise QueueFullError(f"the waiting queue is full ({self.core.config.max_queue} requests, "
                                     f"{compiling} of them waiting for a grammar): retry later")
            self.structured_outputs.compile_async(
                so, lambda constraint, error: self._compiled(sender, parsed, constraint, error),
                cancelled=sender.is_cancelled,
            )
            self.metrics.constrained.increment(1)
        except Exception as exc:  # noqa: BLE001 - answer the request whatever went wrong
            _answer_failure(sender, exc)

    def _compiled(self, sender: Any, parsed: GenerateRequest, constraint: Any, error: str | None) -> None:
        """A structured output's grammar is compiled (or refused): on a grammar pool or timer thread."""
        if error is not None:
            _send_error(sender, error, pb_utils.TritonError.INVALID_ARG)
            return
        try:
            self._submit_parsed(sender, parsed, constraint)
        except Exception as exc:  # noqa: BLE001
            _answer_failure(sender, exc)

    def _submit_parsed(self, sender: Any, parsed: GenerateRequest, constraint: Any) -> None:
        request_id = f"{self._id_prefix}{next(self._ids)}"
        arrival = time.monotonic()
        if parsed.params.n > 1:
            self._submit_children(sender, parsed, request_id, arrival)
            self.metrics.lora_request(parsed.params.lora_name)
            return
        with self._active_lock:
            self._active[request_id] = _Active(sender, parsed)
            self.outputs.add_request(request_id, len(parsed.prompt_token_ids), parsed.params, arrival)
        try:
            self.loop.submit(request_id, parsed.prompt_token_ids, parsed.params, arrival, self.eos_token_ids,
                             cache_salt=parsed.cache_salt, constraint=constraint)
        except BaseException:
            with self._active_lock:
                self._active.pop(request_id, None)
                self.outputs.forget(request_id)
            raise
        self.metrics.lora_request(parsed.params.lora_name)

    def _submit_children(self, sender: Any, parsed: GenerateRequest, request_id: str, arrival: float) -> None:
        """n > 1: n engine requests sharing the sender (child ids and seeds: orca/frontend/parallel_sampling)."""
        parent = ParentRequest(request_id, parsed.params.n)
        children = list(zip(parent.child_ids, child_params(parsed.params)))
        group = _Group(parent, {})
        with self._active_lock:
            for child_id, params in children:
                group.members[child_id] = self._active[child_id] = _Active(sender, parsed, group=group)
                self.outputs.add_request(child_id, len(parsed.prompt_token_ids), params, arrival)
        submitted = []
        try:
            for child_id, params in children:
                self.loop.submit(child_id, parsed.prompt_token_ids, params, arrival, self.eos_token_ids,
                                 cache_salt=parsed.cache_salt)
                submitted.append(child_id)
        except BaseException:
            with self._active_lock:
                for child_id, _ in children:
                    self._active.pop(child_id, None)
                    if child_id not in submitted:
                        self.outputs.forget(child_id)
            for child_id in submitted:  # their cancelled outputs find no active request: nothing is sent
                self.loop.abort(child_id)
            raise

    # -- the scheduler thread's side (the gauges: self.metrics.publish) ---------------------------
    def _on_iteration(self, stats: IterationStats) -> None:
        self.metrics.batch.observe(stats.batch_size)
        self.metrics.iteration.observe(stats.duration)
        self._drain_lora_loads()

    def _on_stats(self, stats: Any) -> None:
        self.metrics.publish(stats)
        self._drain_lora_loads()

    def _drain_lora_loads(self) -> None:
        """The adapter loads into slots since the last call (EngineCore.lora_load_seconds, appended on this
        thread) into their histogram."""
        loads = self.core.lora_load_seconds
        while loads:
            _, seconds = loads.popleft()
            self.metrics.lora_load.observe(seconds)

    def _on_engine_failure(self, reason: str) -> None:
        """The engine failed (workers died or hung, the scheduler thread died, an iteration hung): hands
        it to the response thread, behind every output already queued."""
        self._responses.put(_Failure(reason))

    def _fail_active(self, reason: str) -> None:
        """On the response thread: every request without its FINAL gets an error now (the engine may never
        answer them); new ones are refused (EngineLoop.submit). Then the model unloads itself so that
        Triton reports it not ready (/v2/models/NAME/ready), which needs explicit model control (as
        `make serve`, the launcher and the container start Triton); under --model-control-mode=none it
        stays listed as ready and refuses every request."""
        logger.error("%s failed: %s", self._model_name, reason)
        with self._active_lock:
            failed, self._active = self._active, {}
            for request_id in failed:
                self.outputs.forget(request_id)
        for active in failed.values():
            if active.group is not None:
                if active.group.closed:
                    continue
                active.group.closed = True
            try:
                _send_error(active.sender, f"the engine failed: {reason}", pb_utils.TritonError.UNAVAILABLE)
            except Exception:  # noqa: BLE001
                logger.exception("answering a request of the failed engine failed")
        try:
            pb_utils.unload_model(model_name=self._model_name)
            logger.error("%s unloads itself: it reports not ready until it is loaded again", self._model_name)
        except Exception as exc:  # noqa: BLE001 - model control is off: say so, keep refusing requests
            logger.error(
                "%s cannot unload itself (%s): it keeps refusing requests; start tritonserver with "
                "--model-control-mode=explicit --load-model=* so a failed model reports not ready",
                self._model_name, exc,
            )

    # -- the response thread ---------------------------------------------------------------------
    def _send_responses(self) -> None:
        next_sweep = time.monotonic() + _CANCEL_POLL_S
        while True:
            try:
                out = self._responses.get(timeout=_CANCEL_POLL_S)
            except queue.Empty:
                out = _NO_OUTPUT
            if out is None:
                return
            if isinstance(out, _Failure):
                self._fail_active(out.reason)
            elif out is not _NO_OUTPUT:
                self._process(out)
            if time.monotonic() >= next_sweep:  # also under load, when the queue is never empty
                try:
                    self._abort_cancelled()
                except Exception:  # noqa: BLE001
                    logger.exception("polling for cancelled requests failed")
                next_sweep = time.monotonic() + _CANCEL_POLL_S

    def _abort_cancelled(self) -> None:
        """Asks the sender of every active request not asked for _CANCEL_POLL_S whether its client has
        cancelled: this catches requests without outputs (waiting for admission, or preempted); running
        ones are asked with each of their outputs, so the sweep seldom asks them again."""
        stale = time.monotonic() - _CANCEL_POLL_S
        # Under the lock: execute's thread sends the error FINAL of a request it could not submit after
        # removing it, and asking a sender whose FINAL is gone about cancellation crashes Triton (its
        # response factory is freed). Every other FINAL is this thread's own, sent after the removal.
        with self._active_lock:
            for request_id, active in self._active.items():
                if active.asked_at <= stale:
                    self._ask_cancelled(request_id, active)

    def _ask_cancelled(self, request_id: str, active: _Active) -> None:
        """Asks the sender whether the client cancelled (only before the request's FINAL is sent); on the
        first yes, asks the engine to abort the request, whose FINAL ("cancelled") follows."""
        if not active.cancelled:
            active.asked_at = time.monotonic()
            if active.sender.is_cancelled():
                logger.info("[vllm] Cancelling the request %s", request_id)  # vllm_backend's log line
                members = active.group.members if active.group is not None else {request_id: active}
                for member_id, member in members.items():
                    if not member.cancelled:
                        member.cancelled = True
                        self.loop.abort(member_id)

    def _process(self, delta: EngineCoreOutput) -> None:
        """One delta from the core: its RequestOutput (the front end's work), then its response."""
        try:
            processed = self.outputs.process((delta,))
        except Exception:  # noqa: BLE001 - one request's output must not stop the others'
            logger.exception("processing the output of %s failed", delta.request_id)
            return
        for request_id in processed.aborts:  # finished by a stop string: the core must stop generating it
            self.loop.abort(request_id)
        for out in processed.outputs:
            try:
                self._respond(out, delta.time)
            except Exception:  # noqa: BLE001
                logger.exception("sending a response for %s failed", out.request_id)

    def _respond(self, out: RequestOutput, at: float) -> None:
        """`at`: when the core produced this output (its delta's time)."""
        with self._active_lock:
            active = self._active.pop(out.request_id, None) if out.finished else self._active.get(out.request_id)
        if active is None:
            return
        if active.group is not None:
            self._respond_child(out, active, at)
            return
        if not out.finished:
            self._ask_cancelled(out.request_id, active)
        self._observe_tokens(out, active, at)
        if out.finished:
            self._observe_finished(out, active)
            if self._answered_end(out, active, out.request_id):
                return
        elif active.cancelled or not active.request.stream or not out.new_token_ids:
            return  # non-streaming requests answer once, at the end; a cancelled one only with its FINAL
        _send(active.sender, response_tensors(out, active.request, self.has_tokenizer), out.finished)

    def _answered_end(self, out: RequestOutput, active: _Active, request_id: str) -> bool:
        """A finished output that ends its request with an error FINAL (True): a failed generation, or the
        client's cancellation; False for a regular end (or a cancellation at shutdown), answered with data."""
        if out.finish_reason == "error":
            _send_error(active.sender, f"generation failed: {out.error}", pb_utils.TritonError.INTERNAL)
            return True
        if out.finish_reason == "cancelled" and (active.cancelled or active.sender.is_cancelled()):
            _send_error(active.sender, "request cancelled", pb_utils.TritonError.CANCELLED)
            # vllm_backend's log line, word for word: log-based tooling (and its CI) looks for it
            logger.info("[vllm] Successfully cancelled the request %s", request_id)
            return True
        return False

    def _respond_child(self, out: RequestOutput, active: _Active, at: float) -> None:
        """An output of one child of an n > 1 request: a response of all n sequences (vllm_backend's n-element
        tensors) when this child has new tokens and the request streams, or once every child has finished;
        the first error or cancellation ends the request (the other children are aborted)."""
        group = active.group
        assert group is not None
        if group.closed:
            return
        if not out.finished:
            self._ask_cancelled(out.request_id, active)
        self._observe_tokens(out, active, at)
        index = group.parent.update(out)
        if out.finished:
            self._observe_finished(out, active, count_n=False)
            if self._answered_end(out, active, group.parent.request_id):
                self._close_group(group)
                return
        final = group.parent.finished
        if not final and (active.cancelled or not active.request.stream or not out.new_token_ids):
            return
        if final:
            group.closed = True
            self.metrics.vllm.params_n(group.parent.n)
        _send(active.sender, parent_response_tensors(group.parent.latest, index, active.request, self.has_tokenizer),
              final)

    def _close_group(self, group: _Group) -> None:
        """Ends an n > 1 request early: its other children leave the active set and are aborted (their
        outputs then find nothing to answer)."""
        group.closed = True
        with self._active_lock:
            for member_id in group.members:
                self._active.pop(member_id, None)
        for member_id in group.parent.unfinished_children():
            self.loop.abort(member_id)

    def _observe_tokens(self, out: RequestOutput, active: _Active, at: float) -> None:
        """The token metrics of one output: time to first token and the prompt on the first token; the
        tokens; vLLM's per-token gap (vllm:time_per_output_token_seconds: one observation per output after
        the first, the time since the request's previous one)."""
        m, n = self.metrics, len(out.new_token_ids)
        if out.first_token_time is not None and out.num_output_tokens == n == 1:
            m.ttft.observe(out.first_token_time - out.arrival_time)
            m.prompt.increment(out.num_prompt_tokens)
            m.vllm.ttft.observe(out.first_token_time - out.arrival_time)
            m.vllm.prompt.increment(out.num_prompt_tokens)
        elif n and active.last_token_at is not None:
            m.vllm.tpot.observe(at - active.last_token_at)
        if n:
            active.last_token_at = at
            m.generated.increment(n)
            m.vllm.generation.increment(n)

    def _observe_finished(self, out: RequestOutput, active: _Active, count_n: bool = True) -> None:
        """A finished engine request's metrics (each child of an n > 1 request counts as one; the parent's n
        is observed once, when its FINAL goes out)."""
        m = self.metrics
        m.finished(out.finish_reason or "unknown").increment(1)
        m.vllm.finished(out.finish_reason, out.num_prompt_tokens, out.num_output_tokens,
                        active.request.params.max_tokens, count_n=count_n)
        if out.finish_time is not None:
            m.e2e.observe(out.finish_time - out.arrival_time)
            m.vllm.e2e.observe(out.finish_time - out.arrival_time)
            if out.first_token_time is not None and out.num_output_tokens > 1:
                m.tpot.observe((out.finish_time - out.first_token_time) / (out.num_output_tokens - 1))


def _answer_failure(sender: Any, exc: Exception) -> None:
    """The error FINAL of a request that could not be submitted: INVALID_ARG for what the client got
    wrong, UNAVAILABLE for a full queue or a failed engine, INTERNAL for the rest."""
    if isinstance(exc, ValueError):
        _send_error(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
    elif isinstance(exc, (QueueFullError, EngineFailedError)):
        _send_error(sender, str(exc), pb_utils.TritonError.UNAVAILABLE)
    else:
        logger.error("could not submit a request", exc_info=exc)
        _send_error(sender, f"internal error: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)


def _send(sender: Any, tensors: dict[str, Any], final: bool) -> None:
    response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()])
    sender.send(response, flags=_FINAL if final else 0)


def _send_error(sender: Any, message: str, code: Any) -> None:
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=_FINAL)


# vllm_backend's switch for its vllm:* metrics: a model parameter, not an engine option.
REPORT_CUSTOM_METRICS = "REPORT_CUSTOM_METRICS"


def _report_custom_metrics(model_config: dict[str, Any]) -> bool:
    """The REPORT_CUSTOM_METRICS parameter, read as vllm_backend reads it: "true" (any case) reports the
    vllm:* series; absent or "false", none."""
    raw = model_config.get("parameters", {}).get(REPORT_CUSTOM_METRICS, {}).get("string_value", "")
    if raw.strip().lower() not in ("", "true", "false"):
        raise pb_utils.TritonModelException(f"parameter {REPORT_CUSTOM_METRICS} must be true or false, got {raw!r}")
    return raw.strip().lower() == "true"


def _build_core(config: EngineConfig, multi_lora: dict[str, str]) -> EngineCore:
    """The engine core serving `config`'s lora_modules and multi_lora.json's adapters (on the loop's thread)."""
    core = EngineCore(config)
    try:
        for name, path in multi_lora.items():
            core.add_lora(name, path)
    except BaseException:
        core.shutdown()
        raise
    return core


def _engine_config(model_config: dict[str, Any]) -> EngineConfig:
    """EngineConfig from the config.pbtxt parameters (strings; empty = default)."""
    raw = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()
           if k != REPORT_CUSTOM_METRICS}
    try:
        return EngineConfig.from_parameters(raw)
    except ValueError as exc:
        raise pb_utils.TritonModelException(str(exc)) from None
