"""The router: the public front doors over prefill, decode and encode workers, in one process (server.py).

A request's path through these files: a front door (frontends/openai.py for OpenAI HTTP, frontends/grpc.py for
disagg.v1, frontends/kserve.py for KServe v2) maps it onto generation.py's GenerationRequest and iterates
orchestrator.py's Core.stream; there prepare.py tokenises it, disagg_decision.py and policies/ place it,
encode_prefill.py runs Encode and Prefill up to the first token, decode_stream.py streams the rest from a decode
worker (over decode_mux.py's shared DecodeMany stream, as decode_events.py's events), flight.py holds the request's
state and applies those events, and responses.py turns them into the text and usage the front door sends.
"""
