"""``orca-bench distributed``: the control plane of distributed execution (orca/executor/distributed.py), in this
process: for each layout (--layouts, tp x pp) a fresh engine runs B requests (--batch) at each context
length (--context-lens), decode iterations only measured. Per iteration: the plan's pickled size, the
driver's submit-to-collect time, and the workers' own execute time (the ranks' earliest start to the end
of the rank that answers, the last stage's first: the one the driver waits for; another may stamp its end
after that answer is on its way; engine.profile on); overhead = the first minus the second, the control
plane's share (pickling, socket writes and reads, the result's way back). Medians; n_workers 1 so
iterations do not overlap.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from orca_client.bench.common import machine_info, write_json
from orca_client.bench.options import doc_description, positive_int


def cmd_distributed(args: argparse.Namespace) -> int:
    import torch

    from orca import EngineConfig, LLMEngine, SamplingParams

    layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")]
    context_lens = [int(x) for x in args.context_lens.split(",")]
    result: dict[str, Any] = {
        "benchmark": "distributed", "machine": machine_info(), "command": sys.argv, "model": args.model,
        "batch": args.batch, "decode_steps": args.decode_steps, "runs": [],
    }
    for tp, pp in layouts:
        engine = LLMEngine(EngineConfig(
            model=args.model, device="cpu", dtype=args.dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp,
            n_workers=1, n_slots=args.batch * (max(context_lens) + args.decode_steps + 16), block_size=16,
        ))
        try:
            vocab = engine.model_config.vocab_size
            for ctx in context_lens:
                for i in range(args.batch):
                    prompt = [(7 * i + j) % vocab for j in range(ctx)]
                    engine.add_request(f"{tp}x{pp}-{ctx}-{i}", prompt, SamplingParams(
                        temperature=0, max_tokens=args.decode_steps, ignore_eos=True))
                engine.profile = True
                plan_bytes, durations, decode = [], [], {}
                while engine.has_unfinished():
                    engine.step()
                    it = engine.last_iteration
                    if it.num_initiation or it.batch_size != args.batch:
                        continue  # decode iterations of the whole batch only
                    durations.append(it.duration)
                    decode[it.batch_id] = it.duration
                    if tp * pp > 1:
                        plan_bytes.append(engine.executor.plan_bytes)
                overheads = []
                if tp * pp > 1:  # a rank's timing may arrive after its iteration's result: match by batch id
                    spans: dict[int, list[Any]] = {}
                    for t in engine.executor.stage_timings:
                        spans.setdefault(t.batch_id, []).append(t)
                    answers = (pp - 1) * tp  # the last stage's first rank (orca.parallel.Layout.rank)
                    for batch_id, duration in decode.items():
                        if len(spans.get(batch_id, ())) == tp * pp:
                            end = next(t.end for t in spans[batch_id] if t.rank == answers)
                            overheads.append(duration - (end - min(t.start for t in spans[batch_id])))
                run = {
                    "tensor_parallel_size": tp, "pipeline_parallel_size": pp, "context_len": ctx,
                    "tokens_held": args.batch * ctx, "iterations": len(durations),
                    "iteration_ms_median": 1e3 * float(np.median(durations)) if durations else None,
                    "plan_bytes_median": float(np.median(plan_bytes)) if plan_bytes else None,
                    "overhead_ms_median": 1e3 * float(np.median(overheads)) if overheads else None,
                    "overhead_ms_p90": 1e3 * float(np.percentile(overheads, 90)) if overheads else None,
                }
                result["runs"].append(run)
                print(f"tp {tp} x pp {pp}  context {ctx:5d}  tokens held {run['tokens_held']:6d}  "
                      f"iteration {run['iteration_ms_median']:.2f} ms  "
                      + (f"plan {run['plan_bytes_median']:.0f} B  control-plane overhead "
                         f"{run['overhead_ms_median']:.3f} ms (p90 {run['overhead_ms_p90']:.3f})"
                         if overheads else "(in-process worker: no control plane)"), flush=True)
        finally:
            engine.shutdown()
    result["torch_threads"] = torch.get_num_threads()
    if args.json:
        write_json(args.json, result)
    return 0


def add_parser(sub: Any) -> None:
    d = sub.add_parser("distributed", help="the control plane's cost per iteration for tp / pp layouts, in "
                       "this process (CPU, gloo)", description=doc_description(__doc__))
    d.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    d.add_argument("--dtype", default="float32", help="engine dtype (default: %(default)s)")
    d.add_argument("--layouts", default="1x1,2x1,1x2", help="tp x pp layouts, comma-separated (default: %(default)s)")
    d.add_argument("--batch", type=positive_int, default=8, help="requests decoding together (default: %(default)s)")
    d.add_argument("--context-lens", default="32,512", help="prompt lengths, comma-separated: the tokens held grow, "
                   "the plan must not (default: %(default)s)")
    d.add_argument("--decode-steps", type=positive_int, default=32, help="tokens per request (default: %(default)s)")
    d.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    d.set_defaults(func=cmd_distributed)
