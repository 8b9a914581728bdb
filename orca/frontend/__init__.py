"""The front end: text and accumulated outputs around the token-only core, on the threads that consume
them (never the scheduler thread).

tokenizer.py (text -> ids, chat templates, the stop-string check), detokenizer.py (incremental text and
stop strings), output_processor.py (the core's deltas -> RequestOutputs), llm_engine.py (LLMEngine: core
+ front end for synchronous callers), llm.py (the offline LLM API), request_level.py (the paper's
request-level baseline, on an LLMEngine).
"""
