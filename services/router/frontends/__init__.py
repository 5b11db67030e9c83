"""The router's front doors: one adapter module per protocol onto the same core (services/router/generation.py).

grpc.py serves disagg.v1.Generation, kserve.py KServe v2 / Triton's inference.GRPCInferenceService (both on the
router's gRPC port), openai.py OpenAI-compatible HTTP on --http-port.
"""
