"""Decoupled smoke model: streams ``n`` responses per request from a thread.

It exists to prove the launcher serves a decoupled Python-backend model and to
pin down Python backend 2.51 behaviour the engine relies on.  Request
parameters steer it:

* ``n`` (int, default 3): responses before the FINAL flag; response ``i`` has
  ``OUT = IN + i`` and ``INFO`` = JSON of what the model saw (parameters JSON,
  optional FLAG/TEXT/IDS inputs as received, the stub's sys.prefix and numpy
  version, which show whether it runs in our virtualenv).
* ``sleep`` (float seconds, default 0): pause after each response, so clients
  can cancel mid-stream.
* ``error`` (str, a ``TritonError`` code name such as ``INVALID_ARG``): after
  ``n`` responses send an error response carrying that code, with FINAL.

Metrics (custom, on the metrics port): ``smoke_requests_total``,
``smoke_cancelled_total{source="sender"|"request"}`` (which of
``response_sender.is_cancelled()`` / ``request.is_cancelled()`` saw it) and the histogram
``smoke_duration_seconds`` with buckets 0.1/1/10 s.
"""

import json
import sys
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self._lock = threading.Lock()
        self._threads = []
        self._requests_family = pb_utils.MetricFamily(
            name="smoke_requests_total",
            description="requests received",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self._requests = self._requests_family.Metric(labels={"model": "smoke"})
        self._cancelled_family = pb_utils.MetricFamily(
            name="smoke_cancelled_total",
            description="requests that saw is_cancelled() become true",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self._cancelled = {
            source: self._cancelled_family.Metric(labels={"model": "smoke", "source": source})
            for source in ("sender", "request")
        }
        self._duration_family = pb_utils.MetricFamily(
            name="smoke_duration_seconds",
            description="request duration",
            kind=pb_utils.MetricFamily.HISTOGRAM,
        )
        self._duration = self._duration_family.Metric(labels={"model": "smoke"}, buckets=[0.1, 1.0, 10.0])

    def execute(self, requests):
        # Decoupled: return at once, answer from threads (as the engine will).
        for request in requests:
            self._requests.increment(1)
            thread = threading.Thread(target=self._serve, args=(request,), daemon=True)
            thread.start()
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        return None

    def _serve(self, request):
        sender = request.get_response_sender()
        started = time.monotonic()
        try:
            self._stream(request, sender)
        except Exception as exc:  # never leave a request without FINAL
            error = pb_utils.TritonError(f"smoke model failed: {exc!r}")
            sender.send(
                pb_utils.InferenceResponse(error=error),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        finally:
            self._duration.observe(time.monotonic() - started)

    def _stream(self, request, sender):
        raw_params = request.parameters()
        params = json.loads(raw_params or "{}")
        base = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)[0])
        info = {"parameters": raw_params, "sys_prefix": sys.prefix, "numpy": np.__version__}
        for name in ("FLAG", "TEXT", "IDS"):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                value = tensor.as_numpy()
                info[name] = {
                    "dtype": str(value.dtype),
                    "shape": list(value.shape),
                    "value": [v.decode() if isinstance(v, bytes) else v.item() for v in value.reshape(-1)],
                }
        for i in range(int(params.get("n", 3))):
            cancelled = {"sender": sender.is_cancelled(), "request": request.is_cancelled()}
            for source, flag in cancelled.items():
                if flag:
                    self._cancelled[source].increment(1)
            if any(cancelled.values()):
                break
            outputs = [
                pb_utils.Tensor("OUT", np.array([base + i], dtype=np.int32)),
                pb_utils.Tensor("INFO", np.array([json.dumps(info).encode()], dtype=np.object_)),
            ]
            sender.send(pb_utils.InferenceResponse(output_tensors=outputs))
            time.sleep(float(params.get("sleep", 0)))
        if "error" in params:
            code = getattr(pb_utils.TritonError, params["error"])
            error = pb_utils.TritonError(f"smoke error {params['error']}", code)
            assert error.code() == code, (error.code(), code)
            sender.send(
                pb_utils.InferenceResponse(error=error),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
            return
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=10)
